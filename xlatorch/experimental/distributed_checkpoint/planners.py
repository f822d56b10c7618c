"""Planners that let ``torch.distributed.checkpoint.save`` / ``load`` write and read device
tensors block by block (torch_xla's ``SPMDSavePlanner`` / ``SPMDLoadPlanner``).

Saving: every block of a device tensor's data is one write item, and a block is written by
the process holding its first copy (``replica_id`` 0), from that device's data alone: no
gather to one host. A whole (replicated, or single-device) tensor is one item, written once
in the job. Loading: every block this process holds is read from whichever saved chunks
overlap it (``create_read_items_for_chunk_list``), so a checkpoint loads onto any mesh and
sharding, or onto one device; once all of a tensor's blocks are read, its new data is made
of them on the devices that hold them, keeping its sharding.

Values other than device tensors (CPU tensors, numbers, anything pickled) go through
PyTorch's default planning.
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    create_default_global_load_plan,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.utils._pytree import tree_map

from xlatorch.experimental.distributed_checkpoint._helpers import (
    _CpuShards,
    _is_sharded_tensor,
    _unwrap_xla_sharded_tensor,
    index_key,
    is_device_tensor,
)
from xlatorch.runtime.execute import shards as _shards

__all__ = ["SPMDSavePlanner", "SPMDLoadPlanner"]


def _split(state_dict) -> tuple[dict, dict, dict]:
    """Flatten ``state_dict``: (split device tensors and CPU shard snapshots, everything
    else, the flattening's mappings). One sync first if any device tensor is pending."""
    flat, mappings = flatten_state_dict(state_dict)
    flat = tree_map(_unwrap_xla_sharded_tensor, flat)
    _shards.settle_all(flat.values())
    sharded = {k: v for k, v in flat.items() if isinstance(v, _CpuShards) or _is_sharded_tensor(v)}
    unsharded = {k: v for k, v in flat.items() if k not in sharded}
    return sharded, unsharded, mappings


def _properties(dtype: torch.dtype) -> TensorProperties:
    # Not TensorProperties.create_from_tensor: it asks a device tensor is_pinned().
    return TensorProperties(dtype=dtype)


def _write_item(fqn: str, position, offsets, sizes, global_size, dtype) -> WriteItem:
    offsets, sizes = torch.Size(offsets), torch.Size(sizes)
    return WriteItem(
        index=MetadataIndex(fqn, offsets, position),
        type=WriteItemType.SHARD if position is not None else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), _properties(dtype), torch.Size(global_size)),
    )


class SPMDSavePlanner(SavePlanner):
    """A ``SavePlanner`` for state dicts holding device tensors, sharded (SPMD) or not.

    ``dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(path),
    planner=SPMDSavePlanner())``: each process writes the blocks of split tensors whose
    first copy it holds, each downloaded from its own device when the writer asks for it;
    whole device tensors and other values are written once in the job. Syncs once if
    anything in the state dict is pending. A state dict from ``_sharded_cpu_state_dict``
    (the CPU snapshot ``CheckpointManager.save_async`` takes) is written the same way.
    """

    def __init__(self):
        self.is_coordinator = False
        self.mappings = None
        self.sharded_state_dict: dict[str, Any] = {}  # split device tensors / _CpuShards, by flat key
        self.unsharded_state_dict: dict[str, Any] = {}  # everything else
        self._owned: dict[str, dict] = {}  # fqn -> {position: block or XLAShard} still to write

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        if isinstance(storage_meta, bool):  # torch_xla's signature: (state_dict, is_coordinator)
            storage_meta, is_coordinator = None, storage_meta
        self.is_coordinator = is_coordinator
        self.sharded_state_dict, self.unsharded_state_dict, self.mappings = _split(state_dict)
        self._owned = {}

    def create_local_plan(self) -> SavePlan:
        others = {k: v for k, v in self.unsharded_state_dict.items() if not is_device_tensor(v)}
        plan = create_default_local_save_plan(others, self.is_coordinator)
        items = list(plan.items)
        for fqn, t in self.unsharded_state_dict.items():
            if is_device_tensor(t):  # whole on every device: one item, deduplicated across processes
                items.append(_write_item(fqn, None, (0,) * t.dim(), t.shape, t.shape, t.dtype))
        for fqn, v in self.sharded_state_dict.items():
            owned = self._owned[fqn] = {}
            if isinstance(v, _CpuShards):
                for i, s in enumerate(v.shards):
                    owned[i] = s
                    offsets = tuple(sl.start for sl in s.indices)
                    sizes = tuple(sl.stop - sl.start for sl in s.indices)
                    items.append(_write_item(fqn, i, offsets, sizes, v.global_shape, s.data.dtype))
                continue
            for i, b in enumerate(_shards.blocks(v)):
                if b.replica_id == 0 and math.prod(b.sizes) > 0:
                    owned[i] = b
                    items.append(_write_item(fqn, i, b.offsets, b.sizes, v.shape, v.dtype))
        return dataclasses.replace(plan, items=items, planner_data=self.mappings)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        all_plans = dedup_save_plans(all_plans)
        global_plan, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        merged = {}
        for p in global_plan:
            merged.update(p.planner_data or {})
        return global_plan, dataclasses.replace(metadata, planner_data=merged)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        """The CPU data of one write item: a block is downloaded now, from its device."""
        fqn = write_item.index.fqn
        if fqn in self.unsharded_state_dict:
            obj = self.unsharded_state_dict[fqn]
            if write_item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(obj, buf)
                return buf
            return obj.detach().cpu() if is_device_tensor(obj) else obj
        owned = self._owned.get(fqn)
        if owned is None:  # resolve_data without create_local_plan (tests): plan this tensor's blocks
            self.create_local_plan()
            owned = self._owned[fqn]
        part = owned.pop(write_item.index.index, None)
        if part is None:
            raise RuntimeError(f"xlatorch: block {write_item.index.index} of '{fqn}' was already written, or is "
                               f"not held by this process")  # fmt: skip
        if isinstance(part, _shards.Block):
            return _shards.block_to_cpu(part, self.sharded_state_dict[fqn].dtype)
        return part.data

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.unsharded_state_dict:
            return self.unsharded_state_dict[index.fqn]
        return self.sharded_state_dict[index.fqn]

    def transform_object(self, write_item: WriteItem, object: Any):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(object, buf)
            return buf
        return object


class SPMDLoadPlanner(LoadPlanner):
    """A ``LoadPlanner`` that loads a checkpoint into device tensors in place, onto their
    current sharding (any mesh, or one device), whatever sharding it was saved with.

    ``dist_cp.load(state_dict, storage_reader=dist_cp.FileSystemReader(path),
    planner=SPMDLoadPlanner())``: the tensors of ``state_dict`` must be on the device with
    the sharding wanted. Each process reads only the parts of the checkpoint that overlap
    the blocks its devices hold, into host buffers; a tensor gets its new data (one upload
    per local device) when all its blocks are read. Other values are loaded as PyTorch's
    default planner loads them (CPU tensors in place, other objects replaced).
    """

    def __init__(self):
        self.metadata: Metadata | None = None
        self.is_coordinator = False
        self.original_state_dict = None
        self.mappings = None
        self.sharded_state_dict: dict[str, Any] = {}
        self.unsharded_state_dict: dict[str, Any] = {}
        self._buffers: dict[str, list] = {}  # device tensor fqn -> host buffer per local block
        self._pending: dict[str, int] = {}  # device tensor fqn -> elements still to read

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.original_state_dict = state_dict
        self.sharded_state_dict, self.unsharded_state_dict, self.mappings = _split(state_dict)
        self._buffers, self._pending = {}, {}

    def _device_tensors(self) -> dict:
        out = dict(self.sharded_state_dict)
        out.update((k, v) for k, v in self.unsharded_state_dict.items() if is_device_tensor(v))
        return out

    def create_local_plan(self) -> LoadPlan:
        others = {k: v for k, v in self.unsharded_state_dict.items() if not is_device_tensor(v)}
        plan = create_default_local_load_plan(others, self.metadata)
        items = list(plan.items)
        for fqn, t in self._device_tensors().items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise RuntimeError(f"xlatorch: '{fqn}' is not in the checkpoint (it holds "
                                   f"{sorted(self.metadata.state_dict_metadata)[:8]}...)")  # fmt: skip
            if not isinstance(md, TensorStorageMetadata):
                raise RuntimeError(f"xlatorch: '{fqn}' is a tensor here but the checkpoint holds a "
                                   f"{type(md).__name__} for it")  # fmt: skip
            if tuple(md.size) != tuple(t.shape):
                raise ValueError(f"xlatorch: size mismatch for '{fqn}': the checkpoint has {tuple(md.size)}, "
                                 f"the tensor {tuple(t.shape)}")  # fmt: skip
            chunks = [ChunkStorageMetadata(torch.Size(s.start for s in ix), torch.Size(s.stop - s.start for s in ix))
                      for ix in _shards.layout(t)]  # fmt: skip
            self._buffers[fqn] = [torch.empty(tuple(c.sizes), dtype=t.dtype) for c in chunks]
            self._pending[fqn] = sum(math.prod(c.sizes) for c in chunks)
            reads = create_read_items_for_chunk_list(fqn, md, chunks)
            covered = sum(math.prod(r.lengths) for r in reads)
            if covered != self._pending[fqn]:
                raise RuntimeError(
                    f"xlatorch: the checkpoint's chunks of '{fqn}' cover {covered} of the "
                    f"{self._pending[fqn]} elements this process needs (an incomplete checkpoint)"
                )
            items += reads
            if self._pending[fqn] == 0:
                self._finish(fqn)
        return dataclasses.replace(plan, items=items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return create_default_global_load_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=False))  # fmt: skip

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Where the reader copies one read: a view of a host buffer of a device tensor's
        block, or the CPU tensor of the state dict itself."""
        fqn = read_item.dest_index.fqn
        if fqn in self._buffers:
            buf = self._buffers[fqn][read_item.dest_index.index]
        else:
            buf = find_state_dict_object(self.unsharded_state_dict, read_item.dest_index)
        return self.transform_tensor(read_item, buf)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._buffers:
            return self._buffers[index.fqn][index.index]
        return find_state_dict_object(self.unsharded_state_dict, index)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, o, n)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        if fqn not in self._pending:
            return
        self._pending[fqn] -= math.prod(read_item.lengths)
        if self._pending[fqn] < 0:
            raise RuntimeError(f"xlatorch: the checkpoint's chunks of '{fqn}' overlap (more elements read than "
                               f"its blocks hold)")  # fmt: skip
        if self._pending[fqn] == 0:
            self._finish(fqn)

    def _finish(self, fqn: str) -> None:
        t = self._device_tensors()[fqn]
        bufs = self._buffers.pop(fqn)
        parts = {index_key((s.start for s in ix), (s.stop - s.start for s in ix)): b
                 for ix, b in zip(_shards.layout(t), bufs)}  # fmt: skip
        _shards.assemble(t, parts)
        del self._pending[fqn]
