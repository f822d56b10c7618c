"""``xser``: checkpoints written one tensor at a time (``torch_xla.utils.serialization``).

``xser.save(state_dict, path)`` keeps host memory near the largest tensor instead of
the whole model; ``xser.load(path)`` returns the structure with CPU tensors, ready for
``model.load_state_dict``.

Layout::

    path                      the structure file: a header (magic, length, CRC-32) and
                              a torch.save payload holding the manifest (each tensor
                              file's name, size and CRC-32) and ``data`` with every
                              tensor replaced by a reference (file, view steps, flags)
    path.tensors/gen-<id>/    one torch.save file per storage, ``tensor_<i>.pt``

The structure file is the commit point. A save writes a new ``gen-<id>`` folder, then
the structure file atomically (temporary file, fsync, rename), then deletes older
generations; a crash at any point leaves ``path`` naming one complete generation,
old or new, never a mix; a failed save (a full disk: ``OSError`` ENOSPC naming ``path``)
removes what it wrote. ``load`` checks every file it reads against the manifest and
raises ``CheckpointError``, naming the file, for anything missing, truncated or changed.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import re
import secrets
import shutil
import struct
import zlib

import torch

from xlatorch.runtime.execute.materialize import _base_to_cpu
from xlatorch.runtime.execute.serialization import (
    CheckpointCorruptError,
    RecordingFile,
    atomic_write,
    encode_view,
    fsync_dir,
    replay,
    tensor_pickle_module,
    write_error,
)
from xlatorch.runtime.trace.tensor import XlaTensor

__all__ = ["save", "load", "CheckpointError", "TensorReference"]

MAGIC = b"xlatorch.xser\n"
VERSION = 1
_HEADER = struct.Struct("<BQI")  # version, payload length, payload CRC-32
_GEN = re.compile(r"gen-[0-9a-f]+\Z")
_CHUNK = 1 << 20


# A checkpoint file is missing, truncated or corrupt; the message names the file. One class
# for every checkpoint xlatorch reads (torch.load raises it too), a RuntimeError.
CheckpointError = CheckpointCorruptError


def _tensors_dir(path: str) -> str:
    return path + ".tensors"


def save(data, path, master_only: bool = True, global_master: bool = False) -> None:
    """Save ``data`` (e.g. ``model.state_dict()``) to ``path``, streaming tensors to disk.

    Every tensor (device or CPU, anywhere ``torch.save`` would find it) is written to
    its own file, one storage at a time: a device storage is downloaded, written,
    fsynced and dropped before the next, so the extra host memory is about the largest
    tensor. Tensors that share a storage (views, ``detach``, tied weights) are written
    once and alias again after ``load``. Every process syncs what is pending (one graph
    cut); only the master ordinal writes unless ``master_only`` is False. Atomic as a
    whole: see the module docstring. A failure the OS reports (a missing directory, a full
    disk) raises its ``OSError`` subclass naming ``path``, after removing what this save
    wrote; the previous checkpoint at ``path`` stays loadable.
    """
    from xlatorch.core.xla_model import is_master_ordinal
    from xlatorch.runtime.execute.sync import sync
    from xlatorch.runtime.multi.sharding import gathered

    sync("save")
    with gathered(data):  # SPMD over several processes: shards split across them, gathered by all
        if master_only and not is_master_ordinal(local=not global_master):
            return
        _save(data, path)


def _save(data, path) -> None:
    path = os.fspath(path)
    tdir = _tensors_dir(path)
    gen = f"gen-{secrets.token_hex(8)}"
    gdir = os.path.join(tdir, gen)
    made_tdir = False
    try:
        try:  # not makedirs: a missing directory is an error naming path, as for xm.save and open()
            os.mkdir(tdir)
            made_tdir = True
        except FileExistsError:
            pass
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None
        os.mkdir(gdir)
        sources: list = []  # per file: a device Storage or a CPU tensor
        by_storage: dict[int, int] = {}

        def reduce(t):
            if type(t) is XlaTensor:
                st = t._st
                fid = by_storage.get(st.sid)
                if fid is None:
                    fid = by_storage[st.sid] = len(sources)
                    sources.append(st)
                steps = encode_view(t._vw)
            else:  # pickle's memo already dedups a tensor reached twice
                fid, steps = len(sources), ()
                sources.append(t.detach())
            param = isinstance(t, torch.nn.Parameter)
            return (_tensor, (fid, steps, t.requires_grad, param, tuple(t.shape), t.dtype))

        buf = io.BytesIO()
        torch.save(data, buf, pickle_module=tensor_pickle_module(reduce))
        files = []
        for i in range(len(sources)):
            src, sources[i] = sources[i], None  # drop each tensor once written
            files.append(_write_tensor(gdir, f"tensor_{i}.pt", src))
            del src
        fsync_dir(gdir)
        fsync_dir(tdir)
        manifest = io.BytesIO()
        torch.save({"version": VERSION, "dir": gen, "files": files, "data": buf.getvalue()}, manifest)
        payload = manifest.getvalue()
        header = MAGIC + _HEADER.pack(VERSION, len(payload), zlib.crc32(payload))
        atomic_write(path, lambda f: (f.write(header), f.write(payload)))
    except BaseException as e:
        shutil.rmtree(gdir, ignore_errors=True)
        if made_tdir:
            with contextlib.suppress(OSError):
                os.rmdir(tdir)
        if isinstance(e, OSError) and e.filename == path:
            raise  # atomic_write's, already naming path
        err = write_error(path, e)
        if err is not None:
            raise err from e
        raise
    for name in os.listdir(tdir):  # older generations, and folders of interrupted saves
        if name != gen and _GEN.match(name):
            shutil.rmtree(os.path.join(tdir, name), ignore_errors=True)


class _CrcWriter(RecordingFile):
    """A write-only file that keeps the CRC-32 and size of what passes through it (and the
    first OSError a write raised)."""

    def __init__(self, f):
        super().__init__(f)
        self.crc, self.size = 0, 0

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        self.size += memoryview(b).nbytes
        return super().write(b)

    def flush(self) -> None:
        self.f.flush()


def _write_tensor(gdir: str, name: str, src) -> tuple[str, int, int]:
    cpu = src if isinstance(src, torch.Tensor) else _base_to_cpu(src)
    with open(os.path.join(gdir, name), "xb") as f:
        w = _CrcWriter(f)
        try:
            torch.save(cpu, w)
        except RuntimeError:
            if w.error is None:
                raise
            raise w.error from None  # torch's zip writer reports a failed write as "unexpected pos"
        f.flush()
        os.fsync(f.fileno())
    return (name, w.size, w.crc)


# --- load ----------------------------------------------------------------------------


class _Loading:
    """What ``_tensor`` needs while ``load`` unpickles: the files and the bases read so far."""

    def __init__(self, gdir: str, files, weights_only: bool):
        self.gdir, self.files, self.weights_only = gdir, files, weights_only
        self.bases: dict[int, torch.Tensor] = {}

    def base(self, fid: int) -> torch.Tensor:
        base = self.bases.get(fid)
        if base is None:
            if type(fid) is not int or not 0 <= fid < len(self.files):
                raise CheckpointError(f"{self.gdir}: the structure refers to tensor file #{fid!r}, not in its manifest")
            name, size, crc = self.files[fid]
            base = self.bases[fid] = _read_tensor(os.path.join(self.gdir, _component(name, self.gdir)), size, crc)
        return base


_LOADING: contextvars.ContextVar[_Loading] = contextvars.ContextVar("xser_loading")


def _tensor(fid, steps, requires_grad, param, shape, dtype):
    # Called by the unpickler for each saved tensor reference.
    ctx = _LOADING.get(None)
    if ctx is None:
        raise RuntimeError("xlatorch: an xser tensor reference can only be loaded by xser.load")
    t = replay(ctx.base(fid), steps, requires_grad, param)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        name = os.path.join(ctx.gdir, ctx.files[fid][0])
        raise CheckpointError(
            f"{name}: holds a tensor of shape {tuple(t.shape)} and dtype {t.dtype} where the structure "
            f"expects {tuple(shape)} and {dtype}"
        )
    return t


def load(path, weights_only: bool = True):
    """Load a checkpoint written by ``xser.save``: the saved structure, with CPU tensors.

    Every file read is checked against the structure file's manifest (size and CRC-32);
    a missing, truncated or corrupt file raises ``CheckpointError`` naming it, and
    nothing is returned. ``weights_only`` is passed to ``torch.load`` for the structure
    (the default, True, loads state dicts and plain containers; False allows any
    picklable object, so only load trusted files with it). A file written by
    ``torch.save`` or ``xm.save`` is loaded with ``torch.load``, which checks it first
    (a damaged file raises ``CheckpointError`` naming it).
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        blob = f.read()
    if not blob.startswith(MAGIC):
        with torch.serialization.safe_globals(_REFERENCE_NAMES):
            data = torch.load(path, map_location="cpu", weights_only=weights_only)
        return _resolve_references(data, path, weights_only)
    head = blob[len(MAGIC) : len(MAGIC) + _HEADER.size]
    if len(head) < _HEADER.size:
        raise CheckpointError(f"{path}: truncated xser structure file ({len(blob)} bytes)")
    version, length, crc = _HEADER.unpack(head)
    payload = blob[len(MAGIC) + _HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated xser structure file ({len(payload)} of {length} payload bytes)")
    if zlib.crc32(payload) != crc:
        raise CheckpointError(f"{path}: corrupt xser structure file (CRC-32 mismatch)")
    if version != VERSION:
        raise CheckpointError(f"{path}: xser format version {version}; this xlatorch reads version {VERSION}")
    manifest = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    gdir = os.path.join(_tensors_dir(path), _component(manifest["dir"], path))
    token = _LOADING.set(_Loading(gdir, manifest["files"], weights_only))
    try:
        # The payload's CRC matched: a failure here is torch.load's own (weights_only), not corruption.
        with torch.serialization.safe_globals([_tensor]):
            return torch.load(io.BytesIO(manifest["data"]), map_location="cpu", weights_only=weights_only)
    finally:
        _LOADING.reset(token)


class TensorReference:
    """Where torch_xla's ``xser.save`` put a tensor: ``<path>.tensors/tensor_<tid>.pt`` (its
    structure file holds one of these in the tensor's place). ``load`` reads such checkpoints:
    each reference becomes its tensor."""

    def __init__(self, tid: int):
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference({self.tid})"


# The class under both names a structure file may record (torch_xla's, and this module's).
_REFERENCE_NAMES = [(TensorReference, "torch_xla.utils.serialization.TensorReference"), TensorReference]


def _resolve_references(data, path: str, weights_only: bool):
    """``data`` (a torch_xla-format structure) with each ``TensorReference`` replaced by its
    tensor file, loaded once; a missing file raises ``CheckpointError`` naming it."""
    from torch.utils._pytree import tree_leaves

    from xlatorch.core.tensor_batches import ToXlaTensorArena

    if not any(type(v) is TensorReference for v in tree_leaves(data)):
        return data  # a torch.save / xm.save file: as torch.load gives it (a state dict keeps its metadata)

    def load_all(refs):
        out = []
        for r in refs:
            fname = os.path.join(path + ".tensors", f"tensor_{int(r.tid)}.pt")
            if not os.path.exists(fname):
                raise CheckpointError(f"{fname}: tensor file missing")
            out.append(torch.load(fname, map_location="cpu", weights_only=weights_only))
        return out

    return ToXlaTensorArena(load_all, lambda v: type(v) is TensorReference).transform(data)


def _component(name, where: str) -> str:
    # File names come from the checkpoint: keep them inside its folders.
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
        raise CheckpointError(f"{where}: invalid file name {name!r} in the structure file")
    return name


def _read_tensor(fname: str, size: int, crc: int) -> torch.Tensor:
    try:
        f = open(fname, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"{fname}: tensor file missing") from None
    with f:
        got_size = os.fstat(f.fileno()).st_size
        if got_size != size:
            raise CheckpointError(f"{fname}: tensor file is {got_size} bytes, expected {size} (truncated or replaced)")
        got, chunk = 0, bytearray(_CHUNK)
        view = memoryview(chunk)
        while n := f.readinto(chunk):
            got = zlib.crc32(view[:n], got)
    if got != crc:
        raise CheckpointError(f"{fname}: corrupt tensor file (CRC-32 mismatch)")
    t = torch.load(fname, map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{fname}: holds {type(t).__name__}, not a tensor")
    return t
