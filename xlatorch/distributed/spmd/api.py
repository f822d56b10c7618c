"""DTensor's API on SPMD shardings (``torch_xla.distributed.spmd.api``): a
``torch.distributed.DeviceMesh`` of the xla device and DTensor placements become a ``Mesh``
and a partition spec, then ``mark_sharding``."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch

from xlatorch.distributed.spmd.xla_sharding import Mesh, ShardingType, XLAShardedTensor, mark_sharding

__all__ = ["auto_policy", "with_xla", "convert_to_xla_mesh", "convert_to_xla_partition_spec", "xla_distribute_tensor",
           "xla_distribute_module"]  # fmt: skip


def auto_policy(mod_name: str, mod: torch.nn.Module, mesh) -> None:
    """The ``partition_fn`` that asks ``xla_distribute_module`` for XLA's automatic sharding
    (``xr.use_spmd(auto=True)``) instead of partitioning parameters itself."""


def with_xla(func: Callable) -> Callable:
    """``func`` (a method) with ``xr.use_spmd()`` called before each call."""
    import functools

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        _spmd()
        return func(self, *args, **kwargs)

    return wrapper


def _spmd() -> None:
    from xlatorch import runtime as xr

    xr.use_spmd()


def convert_to_xla_mesh(dt_mesh) -> Mesh:
    """The ``Mesh`` of a ``DeviceMesh`` (same device ids, shape and dimension names)."""
    _spmd()
    from xlatorch import runtime as xr

    if dt_mesh.size() != xr.global_runtime_device_count():
        raise ValueError(f"xlatorch: the DeviceMesh has {dt_mesh.size()} devices, the job "
                         f"{xr.global_runtime_device_count()}")  # fmt: skip
    ids = dt_mesh.mesh
    return Mesh(ids.flatten().tolist(), tuple(ids.size()), dt_mesh.mesh_dim_names)


def convert_to_xla_partition_spec(tensor: torch.Tensor, placements) -> tuple:
    """The partition spec of DTensor ``placements`` (one per mesh dimension): ``Shard(d)`` on
    mesh dimension i splits tensor dimension d over mesh axis i (several mesh dimensions
    sharding one tensor dimension: a tuple of axes, in mesh order); ``Replicate()`` splits
    nothing. Other placements (``Partial``) raise ``ValueError``."""
    _spmd()
    spec: list = [None] * tensor.dim()
    for mesh_idx, p in enumerate(placements):
        if p.is_shard():
            d = p.dim % tensor.dim()
            spec[d] = mesh_idx if spec[d] is None else (*(spec[d] if isinstance(spec[d], tuple) else (spec[d],)),
                                                        mesh_idx)  # fmt: skip
        elif not p.is_replicate():
            raise ValueError(f"Unsupported placement type: {type(p).__name__}")
    return tuple(spec)


def xla_distribute_tensor(tensor: torch.Tensor, device_mesh, placements=None) -> XLAShardedTensor:
    """``tensor`` (moved to the xla device unless it is a meta tensor) sharded over
    ``device_mesh`` (a ``DeviceMesh`` of device type ``'xla'``) by DTensor ``placements``
    (default: replicated), as ``mark_sharding`` shards. Calls ``xr.use_spmd()``."""
    from torch.distributed.tensor.placement_types import Replicate

    _spmd()
    if device_mesh.device_type != "xla":
        raise ValueError(f"xlatorch: xla_distribute_tensor needs a DeviceMesh of device type 'xla', got "
                         f"{device_mesh.device_type!r}")  # fmt: skip
    mesh = convert_to_xla_mesh(device_mesh)
    if type(tensor).__name__ == "DTensor":
        raise ValueError("Cannot distribute a DTensor with local tensor on xla devices. The input tensor must be "
                         "global.")  # fmt: skip
    if isinstance(tensor, XLAShardedTensor):
        if tensor.sharding_type != ShardingType.REPLICATED:
            raise ValueError("xlatorch: the XLAShardedTensor is already sharded: clear_sharding it first")
        tensor = tensor.global_tensor
    if not tensor.is_meta:
        tensor = tensor.to("xla")
    if placements is None:
        placements = [Replicate() for _ in range(device_mesh.ndim)]
    if len(placements) != device_mesh.ndim:
        raise ValueError(f"`placements` must have the same length as `device_mesh.ndim`! Found placements length: "
                         f"{len(placements)}, and device_mesh.ndim: {device_mesh.ndim}.")  # fmt: skip
    return mark_sharding(tensor, mesh, convert_to_xla_partition_spec(tensor, placements))


def _hook_fn(fn: Callable, what: str):
    n = len(inspect.signature(fn).parameters)
    if n == 2:
        warnings.warn(f"Deprecating {what} that takes two arguments, please use {what} that takes in "
                      "(module, inputs, device_mesh) instead!", stacklevel=3)  # fmt: skip
    elif n != 3:
        raise ValueError(f"{what} should take in 3 arguments, but got {n} arguments!")
    return n


def xla_distribute_module(module: torch.nn.Module, device_mesh=None, partition_fn: Callable | None = None,
                          input_fn: Callable | None = None,
                          output_fn: Callable | None = None) -> torch.nn.Module:  # fmt: skip
    """Shard ``module`` over ``device_mesh``: ``partition_fn(name, submodule, device_mesh)`` is
    called on every submodule (it shards parameters, e.g. with ``xla_distribute_tensor``); what
    it leaves is replicated. ``input_fn(module, inputs, device_mesh)`` becomes a forward pre-hook
    and ``output_fn(module, outputs, device_mesh)`` a forward hook. ``partition_fn=auto_policy``
    asks for XLA's automatic sharding, which is not supported here (``NotImplementedError``).
    Calls ``xr.use_spmd()``; returns ``module``."""
    _spmd()
    if partition_fn is not None:
        if getattr(partition_fn, "__name__", "") == "auto_policy":
            from xlatorch import runtime as xr

            xr.use_spmd(auto=True)  # raises: no automatic sharding
            module = module.to("xla")
        else:
            for name, sub in module.named_modules():
                partition_fn(name, sub, device_mesh)
    if input_fn is not None:
        if _hook_fn(input_fn, "input_fn") == 2:
            module.register_forward_pre_hook(lambda _, inputs: input_fn(inputs, device_mesh))
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        if _hook_fn(output_fn, "output_fn") == 2:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(outputs, device_mesh))
        else:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module
