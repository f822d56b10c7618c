"""A device tensor's data block by block, as distributed checkpoints write and read it.

``blocks(t)`` lists the blocks of ``t``'s data that this process holds (one per local
device: where it sits in the global tensor, which copy of that block it is, its device and
its single-device data); ``block_to_cpu`` downloads one. ``assemble(t, parts)`` gives ``t``
new data made of host blocks, each uploaded to the local devices that hold that block under
``t``'s current sharding: nothing is gathered to one host and no process touches another's
blocks. A tensor whose annotation the mesh does not divide holds its data replicated
(``multi/sharding.py``): it is one block, the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import torch

from xlatorch.runtime.base import record
from xlatorch.runtime.execute.materialize import materialized
from xlatorch.runtime.execute.sync import sync
from xlatorch.runtime.execute.transfer import _to_numpy, from_array
from xlatorch.runtime.ir.values import Data, Out
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, write

__all__ = ["Block", "blocks", "block_to_cpu", "is_split", "layout", "assemble", "settle_all"]


@dataclass(frozen=True)
class Block:
    """One local block of a device tensor's data.

    ``index``: one slice per dimension with explicit bounds (``()`` for a 0-d tensor);
    ``replica_id``: which copy of that block this is (0 is the one a checkpoint writes);
    ``device``: the ``jax.Device`` holding it; ``data``: its single-device ``jax.Array``."""

    index: tuple
    replica_id: int
    device: object
    data: object

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(s.start for s in self.index)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)


def settle_all(tensors) -> None:
    """Give every pending tensor among ``tensors`` its device data in one sync (a graph cut)."""
    if any(type(t) is XlaTensor and type(value_of(t)) is Out for t in tensors):
        sync("checkpoint")


def _bounded(index, shape) -> tuple:
    out = []
    for sl, n in zip(index, shape):
        start = 0 if sl.start is None else min(sl.start, n)
        stop = n if sl.stop is None else min(sl.stop, n)
        out.append(slice(start, stop))
    return tuple(out)


def _array(t: XlaTensor):
    v = materialized(t)
    return v, v.array, tuple(v.aval[0])


def is_split(t: XlaTensor) -> bool:
    """Whether ``t``'s data is split between devices (not whole on each)."""
    _, arr, _ = _array(t)
    return not arr.sharding.is_fully_replicated


def blocks(t: XlaTensor) -> list[Block]:
    """The blocks of ``t``'s data on this process's devices, in the order the array lists
    them (syncs if ``t`` is pending; transfers nothing)."""
    _, arr, shape = _array(t)
    return [Block(_bounded(s.index, shape), s.replica_id, s.device, s.data) for s in arr.addressable_shards]


def layout(t: XlaTensor) -> list[tuple]:
    """The distinct block indices this process holds, first appearance first."""
    seen: dict = {}
    for b in blocks(t):
        seen.setdefault(_key(b.index), b.index)
    return list(seen.values())


def block_to_cpu(b: Block, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of one block (counted in ``TransferFromDeviceTime``)."""
    with record.TIMED("TransferFromDeviceTime"):
        return from_array(b.data, dtype)


def _key(index) -> tuple:
    return tuple((s.start, s.stop) for s in index)


def assemble(t: XlaTensor, parts: dict) -> None:
    """Give ``t`` new device data from host blocks, keeping its sharding.

    ``parts`` maps each block index ``layout(t)`` lists (as ``((start, stop), ...)`` per
    dimension) to a CPU tensor of that block. Each block is uploaded to every local device
    that holds it; the array is built from those single-device arrays (no collective).
    """
    v, arr, shape = _array(t)
    dtype = v.aval[1]
    sharding = arr.sharding
    pieces = []
    with record.TIMED("TransferToDeviceTime"):
        for dev, index in sharding.addressable_devices_indices_map(shape).items():
            key = _key(_bounded(index, shape))
            host = _to_numpy(parts[key].to(dtype), private=dev.platform == "cpu")
            pieces.append(jax.device_put(host, dev))
        new = pieces[0] if len(pieces) == 1 and len(sharding.device_set) == 1 else (
            jax.make_array_from_single_device_arrays(shape, sharding, pieces))  # fmt: skip
    record.COUNTERS["CheckpointBlocksLoaded"] += len(parts)
    write(t, Data(new, (shape, dtype), v.dev))
