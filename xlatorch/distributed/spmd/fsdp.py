"""Fully sharded data parallel, the SPMD way (torch_xla's ``SpmdFullyShardedDataParallel``, "FSDPv2").

Every parameter is split along one dimension over the mesh axis ``"fsdp"``; the user shards
the batch over the same axis. There is no hand-written gather or reduce-scatter: the step
is one program and XLA's partitioner inserts the all-gathers of parameters and the
reduce-scatters of gradients. Optimizer state follows its parameter's sharding.
"""

from __future__ import annotations

import torch
from torch import nn

from xlatorch.distributed.spmd.xla_sharding import Mesh, get_global_mesh, mark_sharding

__all__ = ["SpmdFullyShardedDataParallel"]

AXIS = "fsdp"


def _param_spec(p: torch.Tensor, size: int, extra_data_axis: str | None) -> tuple:
    """Shard the first dimension that ``size`` divides (a parameter with none stays replicated)."""
    spec: list = [None] * p.dim()
    for d, n in enumerate(p.shape):
        if n % size == 0 and n >= size:
            spec[d] = (extra_data_axis, AXIS) if extra_data_axis else AXIS
            break
    return tuple(spec)


def _shard_batch(out: torch.Tensor, mesh: Mesh, extra_data_axis: str | None) -> None:
    spec = [None] * out.dim()
    spec[0] = (extra_data_axis, AXIS) if extra_data_axis else AXIS
    mark_sharding(out, mesh, tuple(spec))


class SpmdFullyShardedDataParallel(nn.Module):
    """Wrap ``module`` (on the xla device, under ``xr.use_spmd()``) so its parameters are
    sharded over the mesh axis ``"fsdp"`` and its output's batch dimension too.

    Args:
      module: the model; moved to the xla device if it is not there.
      mesh: a mesh with an ``"fsdp"`` axis (default: ``xs.get_global_mesh()``).
      shard_output: ``fn(output, mesh)`` annotating the output (needed when the output is not
        one tensor); default: dimension 0 of the output over ``"fsdp"``.
      auto_wrap_policy, auto_wrapper_callable: accepted for torch_xla's signature; every
        parameter is sharded anyway (one program: wrapping granularity changes nothing here).
      extra_data_axis: a second mesh axis the batch is split over (HSDP: data x fsdp).
    """

    def __init__(self, module: nn.Module, mesh: Mesh | None = None, shard_output=None, auto_wrap_policy=None,
                 auto_wrapper_callable=None, extra_data_axis: str | None = None):  # fmt: skip
        super().__init__()
        mesh = mesh or get_global_mesh()
        if mesh is None or AXIS not in mesh._names():
            raise ValueError('xlatorch: SpmdFullyShardedDataParallel needs a mesh with an "fsdp" axis '
                             "(pass mesh= or xs.set_global_mesh)")  # fmt: skip
        if extra_data_axis is not None and extra_data_axis not in mesh._names():
            raise ValueError(f"xlatorch: extra_data_axis {extra_data_axis!r} is not an axis of {mesh}")
        if any(p.device.type != "xla" for p in module.parameters()):
            module = module.to("xla")
        size = mesh.shape()[AXIS]
        for p in module.parameters():
            mark_sharding(p, mesh, _param_spec(p, size, None))
        self.module = module
        self.mesh = mesh
        self.shard_output = shard_output
        self.extra_data_axis = extra_data_axis

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.shard_output is not None:
            self.shard_output(out, self.mesh)
        elif isinstance(out, torch.Tensor):
            _shard_batch(out, self.mesh, self.extra_data_axis)
        else:
            raise ValueError("xlatorch: the wrapped module's output is not one tensor: pass shard_output=fn(output, "
                             "mesh) to annotate it")  # fmt: skip
        return out
