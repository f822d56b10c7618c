"""A checkpoint directory that is verified when read: PyTorch's ``FileSystemWriter`` /
``FileSystemReader`` plus a CRC-32 of every item written.

The writer records each item's CRC-32 (computed from the bytes on disk, after they are
written and fsynced) in ``.checksums``, written before ``.metadata``, which stays the
commit point. The reader refuses a directory without ``.metadata``, a ``.metadata`` that
does not unpickle, a missing or truncated data file, and an item whose bytes do not match
its CRC-32, with ``CheckpointCorruptError`` naming the file and the tensor (and block) it
holds. A checkpoint written by PyTorch's own writer (no ``.checksums``) is checked for
missing and truncated files only.
"""

from __future__ import annotations

import io
import json
import os
import zlib

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from xlatorch.runtime.execute.serialization import CheckpointCorruptError, atomic_write

__all__ = ["CheckedFileSystemWriter", "CheckedFileSystemReader", "CheckpointCorruptError"]

CHECKSUMS = ".checksums"


def _crc(f, offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left:
        b = f.read(min(left, 1 << 22))
        if not b:
            break
        crc = zlib.crc32(b, crc)
        left -= len(b)
    return crc


class CheckedFileSystemWriter(FileSystemWriter):
    """``torch.distributed.checkpoint.FileSystemWriter`` that also writes each item's CRC-32
    (``.checksums``, before ``.metadata``). Same arguments."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        fut = super().write_data(plan, planner)
        fut.wait()
        results = fut.value()
        by_file: dict = {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r)
        sums = []
        for rel, rs in by_file.items():
            with open(os.path.join(self.path, rel), "rb") as f:
                for r in rs:
                    s = r.storage_data
                    sums.append((rel, s.offset, s.length, _crc(f, s.offset, s.length)))
        fut: Future = Future()
        # The checksums travel to the coordinator with the results (the planner data of a
        # WriteResult is opaque to PyTorch): a first pseudo-result per process.
        fut.set_result(list(results) + [_Sums(sums)])
        return fut

    def finish(self, metadata: Metadata, results: list) -> None:
        table = {}
        clean = []
        for rs in results:
            clean.append([r for r in rs if not isinstance(r, _Sums)])
            for r in rs:
                if isinstance(r, _Sums):
                    table.update({f"{rel}:{off}": [length, crc] for rel, off, length, crc in r.sums})
        path = os.path.join(self.path, CHECKSUMS)
        data = json.dumps({"version": 1, "crc32": table}).encode()
        atomic_write(path, lambda f: f.write(data))
        super().finish(metadata, clean)


class _Sums(WriteResult):
    """Not a write: one process's ``(file, offset, length, crc32)`` list, carried to ``finish``."""

    def __init__(self, sums):
        object.__setattr__(self, "sums", sums)
        object.__setattr__(self, "index", None)
        object.__setattr__(self, "size_in_bytes", 0)
        object.__setattr__(self, "storage_data", None)


class CheckedFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that verifies what it reads: a
    damaged or incomplete checkpoint raises ``CheckpointCorruptError`` naming the file and
    the tensor it holds. Same arguments."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not os.path.exists(path):
            raise CheckpointCorruptError(f"xlatorch: {self.path} is not a complete checkpoint: it has no "
                                         f"{os.path.basename(path)} (its save did not finish)")  # fmt: skip
        try:
            md = super().read_metadata(*args, **kwargs)
        except Exception as e:
            raise CheckpointCorruptError(f"xlatorch: {path} is damaged: it does not load as a checkpoint's "
                                         f"metadata ({type(e).__name__}: {e})") from None  # fmt: skip
        if not isinstance(md, Metadata) or not isinstance(getattr(md, "storage_data", None), dict):
            raise CheckpointCorruptError(f"xlatorch: {path} is damaged: it holds a {type(md).__name__}, not a "
                                         f"checkpoint's metadata")  # fmt: skip
        self._sums = None
        sums = os.path.join(self.path, CHECKSUMS)
        if os.path.exists(sums):
            try:
                with open(sums, "rb") as f:
                    self._sums = json.loads(f.read())["crc32"]
            except Exception as e:
                raise CheckpointCorruptError(f"xlatorch: {sums} is damaged ({type(e).__name__}: {e})") from None
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        sums = getattr(self, "_sums", None)
        per_file: dict = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, reqs in per_file.items():
            path = os.path.join(self.path, rel)
            what = _describe(reqs)
            if not os.path.exists(path):
                raise CheckpointCorruptError(f"xlatorch: {path} is missing: the checkpoint is incomplete (that "
                                             f"file holds {what})")  # fmt: skip
            size = os.path.getsize(path)
            need = max(self.storage_data[r.storage_index].offset + self.storage_data[r.storage_index].length
                       for r in reqs)  # fmt: skip
            if size < need:
                raise CheckpointCorruptError(f"xlatorch: {path} is truncated: {size} bytes, the checkpoint's "
                                             f"metadata places data up to byte {need} (it holds {what})")  # fmt: skip
            with open(path, "rb") as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_one(f, path, rel, req, planner, sums)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, f, path, rel, req, planner, sums) -> None:
        info: _StorageInfo = self.storage_data[req.storage_index]
        f.seek(info.offset)
        raw = f.read(info.length)
        if sums is not None:
            want = sums.get(f"{rel}:{info.offset}")
            if want is None or want[0] != info.length or zlib.crc32(raw) != want[1]:
                raise CheckpointCorruptError(f"xlatorch: {path} is corrupt: the bytes of {_describe([req])} do "
                                             f"not match their CRC-32")  # fmt: skip
        stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(raw))
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read()))
            return
        try:
            data = stream if stream.seekable() else io.BytesIO(stream.read())
            tensor = torch.load(data, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(f"xlatorch: {path} is corrupt: {_describe([req])} does not load "
                                         f"({type(e).__name__}: {e})") from None  # fmt: skip
        for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            tensor = tensor.narrow(dim, o, n)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(f"xlatorch: {path}: {_describe([req])} has shape {tuple(tensor.shape)} "
                                         f"where {tuple(target.shape)} was expected")  # fmt: skip
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _describe(reqs) -> str:
    names = []
    for r in reqs[:3]:
        off = tuple(r.storage_index.offset or ())
        names.append(f"'{r.storage_index.fqn}'" + (f" (block at {off})" if any(off) else ""))
    more = f" and {len(reqs) - 3} more" if len(reqs) > 3 else ""
    return ", ".join(names) + more
