"""What the planners share: which state-dict values are split device tensors, and the CPU
snapshot of a state dict that an asynchronous checkpoint writes (``_sharded_cpu_state_dict``).

Names follow torch_xla's ``distributed_checkpoint/_helpers.py`` where its tests import them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from xlatorch.distributed.spmd import XLAShard, XLAShardedTensor
from xlatorch.runtime.execute import shards as _shards
from xlatorch.runtime.trace.tensor import XlaTensor

__all__ = ["_CpuShards", "_is_sharded_tensor", "_unwrap_xla_sharded_tensor", "_sharded_cpu_state_dict",
           "is_device_tensor", "index_key"]  # fmt: skip


def _unwrap_xla_sharded_tensor(x: Any) -> Any:
    """The device tensor behind an ``XLAShardedTensor``; anything else as it is."""
    return x.global_tensor if isinstance(x, XLAShardedTensor) else x


def is_device_tensor(x: Any) -> bool:
    return type(_unwrap_xla_sharded_tensor(x)) is XlaTensor


def _is_sharded_tensor(x: Any) -> bool:
    """Whether ``x`` (a device tensor or an ``XLAShardedTensor``) has its data split between
    devices. A replicated tensor, an unevenly annotated one (its data is held replicated)
    and every tensor outside SPMD are not split. Syncs if ``x`` is pending."""
    x = _unwrap_xla_sharded_tensor(x)
    return type(x) is XlaTensor and _shards.is_split(x)


def index_key(offsets, sizes) -> tuple:
    """A block's key: ``((start, stop), ...)`` per dimension."""
    return tuple((int(o), int(o) + int(s)) for o, s in zip(offsets, sizes))


@dataclasses.dataclass
class _CpuShards:
    """A split device tensor's blocks that this process writes, downloaded to CPU: one
    ``XLAShard`` per block whose first copy (``replica_id`` 0) a local device holds."""

    shards: list
    global_shape: torch.Size


def _owned_cpu_shards(t: XlaTensor) -> _CpuShards:
    out = []
    for b in _shards.blocks(t):
        if b.replica_id == 0:
            out.append(XLAShard(_shards.block_to_cpu(b, t.dtype), list(b.index), str(b.device), 0))
    return _CpuShards(out, t.shape)


def _sharded_cpu_state_dict(state_dict):
    """A copy of ``state_dict`` with every device tensor on CPU: a split tensor becomes the
    ``_CpuShards`` of the blocks this process writes (nothing is gathered), any other device
    tensor a CPU tensor. One sync first if anything is pending. The copies do not alias the
    device data, so training may go on (and donate those buffers) while they are written."""
    flat, spec = tree_flatten(state_dict)
    flat = [_unwrap_xla_sharded_tensor(x) for x in flat]
    _shards.settle_all(flat)
    done: dict = {}  # aliases (tied weights) are downloaded once

    def to_cpu(x):
        if type(x) is not XlaTensor:
            return x
        hit = done.get(id(x))
        if hit is None:
            hit = done[id(x)] = _owned_cpu_shards(x) if _shards.is_split(x) else x.detach().cpu()
        return hit

    return tree_unflatten([to_cpu(x) for x in flat], spec)
