"""Device tensors on disk: one copy per storage, view steps as data, atomic files.

A device tensor is its storage's value plus a chain of view steps (``XlaTensor._vw``),
and that is what is written: each storage's value once, and for each tensor its view
steps as plain data (ATen overload name, static arguments, output index). Loading
rebuilds one base per storage and replays each tensor's steps on it with PyTorch's
own view ops, so tensors that aliased when saved (views, ``detach``, ``.data``, tied
weights) alias after loading, on the device or on CPU, as in eager PyTorch. (torch_xla
refuses this case: "Tensor ID 2 is sharing a view with tensor ID 1".)

Three users: ``XlaTensor.__reduce_ex__`` (``torch.save``, ``pickle``, ``copy.copy``),
``xm.save`` (every device tensor becomes a CPU tensor, aliasing kept) and ``xser``
(each storage streamed to its own file). Files are written by ``atomic_write``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import secrets
import types
import weakref
import zipfile

import torch

from xlatorch.runtime.execute.materialize import _base_to_cpu
from xlatorch.runtime.execute.sync import sync
from xlatorch.runtime.ir.values import Out, Scalar
from xlatorch.runtime.trace import tensor
from xlatorch.runtime.trace.tensor import DEVICE, LOAD_TARGET, PENDING, XlaTensor, _rebuild_xla

__all__ = [
    "encode_view", "replay", "reduce_tensor", "tensor_pickle_module", "cpu_pickle_module",
    "atomic_write", "temp_name", "fsync_dir", "RecordingFile", "write_error", "CheckpointCorruptError",
    "verify_checkpoint",
]  # fmt: skip


# --- view steps as data ------------------------------------------------------------


def encode_view(vw) -> tuple:
    """A tensor's view chain as plain data: ``((overload name, args, kwargs, index), ...)``.

    Arguments are the static ones the step recorded (``Scalar`` leaves become numbers),
    passed positionally or by keyword as the ATen schema says.
    """
    if not vw:
        return ()
    steps = []
    for spec, rest, idx in vw:
        args, kwargs = [], {}
        for name, a, kwarg_only in zip(spec.arg_names[1:], rest, spec.kwarg_only[1:]):
            if kwarg_only:
                kwargs[name] = _plain(a)
            else:
                args.append(_plain(a))
        steps.append((spec.overload.name(), tuple(args), kwargs, idx))
    return tuple(steps)


def _plain(a):
    if type(a) is Scalar:
        return a.value
    if type(a) is tuple:
        return tuple(_plain(x) for x in a)
    return a


def _view_op(name):
    # Steps come from files: only ATen view ops may be named (a checkpoint must not
    # be able to call anything else, even with torch.load(weights_only=True)).
    op = None
    if isinstance(name, str):
        ns, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        overload = overload or "default"
        if ns == "aten" and op_name.isidentifier() and overload.isidentifier():
            packet = getattr(torch.ops.aten, op_name, None)
            if isinstance(packet, torch._ops.OpOverloadPacket):
                op = getattr(packet, overload, None)
    if not isinstance(op, torch._ops.OpOverload) or not op.is_view:
        raise RuntimeError(f"xlatorch: a saved tensor names {name!r} as a view step, which is not an ATen view op")
    return op


def replay(base: torch.Tensor, steps: tuple, requires_grad: bool = False, param: bool = False) -> torch.Tensor:
    """A new tensor aliasing ``base`` through view ``steps`` (from ``encode_view``).

    Works on device and CPU bases alike: the steps run as ordinary ATen view ops. The
    result is a leaf; ``param`` makes it an ``nn.Parameter``.
    """
    t = base.detach()
    for step in steps:
        name, args, kwargs, idx = step
        if type(args) is not tuple or type(kwargs) is not dict or type(idx) is not int:
            raise RuntimeError(f"xlatorch: malformed saved view step {step!r}")
        res = _view_op(name)(t, *args, **kwargs)
        t = res if isinstance(res, torch.Tensor) else res[idx]
    if param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_() if requires_grad else t


# --- torch.save / pickle of device tensors -----------------------------------------


class _StorageRef:
    """One storage's value within one pickle.

    Every tensor of the storage refers to the same ``_StorageRef`` (see ``_REFS``), so
    pickle's memo writes the value once and loading builds one base for all of them.
    It pickles as the base's CPU data, which loads back onto the device.
    """

    __slots__ = ("st", "__weakref__")

    def __init__(self, st):
        self.st = st

    def __reduce_ex__(self, proto):
        return (_rebuild_xla, (_base_to_cpu(self.st), False))

    def materialize(self) -> XlaTensor:
        return _rebuild_xla(_base_to_cpu(self.st), False)


# (storage id, generation) -> its _StorageRef while a pickle holds it in its memo.
# The generation keeps a ref from outliving a change of the storage's value.
_REFS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def reduce_tensor(t: XlaTensor):
    """``XlaTensor.__reduce_ex__``: (storage ref, view steps, requires_grad, is parameter).

    Syncs if the storage's value is pending, so that every tensor of one pickle sees
    the storage at one generation.
    """
    st = t._st
    if type(st.value) is Out and st.sid in PENDING:
        sync("save")
    key = (st.sid, st.gen)
    ref = _REFS.get(key)
    if ref is None:
        ref = _REFS[key] = _StorageRef(st)
    return (_rebuild, (ref, encode_view(t._vw), t.requires_grad, isinstance(t, torch.nn.Parameter)))


def _rebuild(base, steps, requires_grad, param=False):
    if type(base) is _StorageRef:  # copy.copy: the arguments were not pickled
        base = base.materialize()
    if type(base) is not XlaTensor and getattr(LOAD_TARGET, "device", None) is None:
        raise RuntimeError(f"xlatorch: a saved xla tensor's base loaded as {type(base).__name__}, not a device tensor")
    return replay(base, steps, requires_grad, param)


# Files name the functions that rebuild device tensors by module path; files saved before the
# runtime's stages were folders name them by their old paths.
_SAVED_AS = {
    ("xlatorch.runtime.serialization", "_rebuild"): _rebuild,
    ("xlatorch.runtime.tensor", "_rebuild_xla"): _rebuild_xla,
}
# torch.load's default (weights_only=True) may rebuild device tensors: both functions
# only build tensors (view steps are checked to be ATen view ops).
torch.serialization.add_safe_globals([_rebuild_xla, _rebuild] + [(f, f"{m}.{n}") for (m, n), f in _SAVED_AS.items()])


class _Unpickler(pickle.Unpickler):
    """pickle's, finding the rebuild functions under the paths older files name them by."""

    def find_class(self, module, name):
        found = _SAVED_AS.get((module, name))
        return found if found is not None else super().find_class(module, name)


_PICKLE = types.ModuleType(f"{__name__}.unpickle")  # torch.load(weights_only=False)'s pickle_module
_PICKLE.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
_PICKLE.Unpickler = _Unpickler


def load_target(map_location) -> torch.device | None:
    """Where ``torch.load(..., map_location=...)`` puts a tensor saved from ``xla:0``: None
    for the device (no map_location, or one naming the xla device), else that device.
    ``map_location`` may be a device, a string, a dict of saved location -> location, or
    a callable ``(storage, location) -> storage``, as PyTorch documents."""
    if map_location is None:
        return None
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        probe = map_location(torch.empty(0).untyped_storage(), "xla:0")
        return None if probe is None else torch.device(probe.device)
    if isinstance(map_location, dict):
        map_location = map_location.get("xla:0", map_location.get("xla"))
        if map_location is None:
            return None
    return torch.device(map_location)


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is damaged or incomplete; the message names the file and what is wrong.

    Raised by ``torch.load`` (with xlatorch imported) and ``xser.load`` for any checkpoint
    xlatorch writes: empty, truncated, a damaged header or zip directory, a record whose
    bytes do not match its CRC-32, a missing tensor file. A ``RuntimeError``, as PyTorch's
    own reader raises for nearly every truncated or damaged zip checkpoint (the
    ``EOFError``, ``UnicodeDecodeError`` or ``UnpicklingError`` it raises otherwise depend
    on which byte was hit; ``UnpicklingError`` also means "weights_only refused an object",
    which a damaged file is not). ``xser.CheckpointError`` is this class.
    """


# The pickled magic number a legacy (pre-zip) torch.save file starts with: pickle protocols
# 2 and up write it as LONG1, 0 and 1 as text. Such files have no checksums.
_LEGACY_MAGIC = (
    pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[2:-1],
    b"L%dL\n" % torch.serialization.MAGIC_NUMBER,
)


def verify_checkpoint(f) -> None:
    """Check that ``f`` is a whole checkpoint before ``torch.load`` reads it; raise
    ``CheckpointCorruptError`` naming the file and what is wrong otherwise.

    A ``torch.save`` zip file must open in Python's zip reader and in PyTorch's, and every
    record must match the CRC-32 the zip format keeps for it (PyTorch's reader checks
    none). Empty files and files that are neither a zip archive nor a legacy ``torch.save``
    file are refused; legacy files pass unchecked. ``f``: a path or a seekable binary file
    (left where it was); anything else passes. Reads the file once (about as fast as the
    disk)."""
    if isinstance(f, (str, os.PathLike)):
        name = os.fspath(f)
        if not os.path.isfile(name):
            return
        with open(name, "rb") as fh:
            _verify(fh, name)
        return
    if not all(hasattr(f, a) for a in ("seek", "tell", "read")) or not getattr(f, "seekable", lambda: False)():
        return
    pos = f.tell()
    name = getattr(f, "name", None)
    try:
        if name is None and not isinstance(f, io.BytesIO) and not _has_fileno(f):
            # A view of part of a file (torch.distributed.checkpoint's reader hands torch.load
            # one whose SEEK_END is wrong): checked as a copy of its bytes.
            base = getattr(getattr(f, "base_stream", None), "name", None)
            where = f"{base} (bytes {getattr(f, 'offset', '?')}..)" if base else "the checkpoint"
            _verify(io.BytesIO(f.read()), where)
        else:
            _verify(f, name or "the checkpoint")
    finally:
        f.seek(pos)


def _has_fileno(f) -> bool:
    try:
        f.fileno()
        return True
    except Exception:
        return False


def _verify(fh, name) -> None:
    start = fh.tell()
    head = fh.read(512)
    fh.seek(start)
    if not head:
        raise CheckpointCorruptError(f"xlatorch: {name} is empty (0 bytes): not a checkpoint (its save did not "
                                     f"finish, or the file was truncated)")  # fmt: skip
    if not head.startswith(b"PK\x03\x04"):
        if any(m in head[:32] for m in _LEGACY_MAGIC) or head[257:262] == b"ustar":  # legacy or tar format
            return
        if not zipfile.is_zipfile(fh):  # else a zip archive whose first bytes are damaged
            raise CheckpointCorruptError(f"xlatorch: {name} is not a checkpoint: it starts with neither a zip "
                                         f"archive nor a legacy torch.save header (damaged, or not written by "
                                         f"torch.save)")  # fmt: skip
        fh.seek(start)
    # Damaged zip files make zipfile raise many kinds (BadZipFile, EOFError, OSError,
    # UnicodeDecodeError, NotImplementedError, ValueError) and PyTorch's reader RuntimeError.
    try:
        z = zipfile.ZipFile(fh)
    except Exception as e:
        raise _incomplete(name, e) from None
    with z:
        try:
            infos = z.infolist()
            first = min((i.header_offset for i in infos), default=start)
            if first != start:
                raise zipfile.BadZipFile(f"the zip archive starts {first - start} bytes into the file")
        except Exception as e:
            raise _incomplete(name, e) from None
        for info in infos:
            try:
                with z.open(info) as r:
                    while r.read(1 << 20):
                        pass
            except Exception as e:
                if isinstance(e, zipfile.BadZipFile) and str(e).startswith("Bad CRC-32"):
                    why = "does not match its CRC-32 (the file was damaged after it was written)"
                else:
                    why = f"is damaged ({type(e).__name__}: {e})"
                raise CheckpointCorruptError(f"xlatorch: {name} is corrupt: record '{info.filename}' {why}") from None
    fh.seek(start)
    try:
        torch._C.PyTorchFileReader(fh)  # the directory as torch.load's reader (miniz) sees it
    except Exception as e:
        raise _incomplete(name, e) from None


def _incomplete(name, e: Exception) -> CheckpointCorruptError:
    why = str(e).split(". This is an internal miniz error")[0]
    return CheckpointCorruptError(f"xlatorch: {name} is not a complete checkpoint (truncated or damaged: "
                                  f"{type(e).__name__}: {why})")  # fmt: skip


def install_load() -> None:
    """Wrap ``torch.load`` once so that device tensors honour ``map_location``."""
    if getattr(torch.load, "_xlatorch", False):
        return
    original = torch.load

    @functools.wraps(original)
    def load(*args, **kwargs):
        map_location = kwargs.get("map_location", args[1] if len(args) > 1 else None)
        target = load_target(map_location)
        to_device = target is not None and target.type == "xla"
        if to_device:
            # Storages cannot be restored onto the device itself: load them on CPU, then
            # move the CPU tensors there (tensors saved from the device go there anyway).
            if len(args) > 1:
                args = (args[0], "cpu") + tuple(args[2:])
            else:
                kwargs["map_location"] = "cpu"
            target = None
        verify_checkpoint(kwargs.get("f", args[0] if args else None))
        if kwargs.get("weights_only") is False and len(args) < 3 and kwargs.get("pickle_module") is None:
            kwargs["pickle_module"] = _PICKLE  # files saved by older layouts load too
        prev = getattr(LOAD_TARGET, "device", None)
        LOAD_TARGET.device = target
        try:
            res = original(*args, **kwargs)
        finally:
            LOAD_TARGET.device = prev
        if to_device:
            from torch.utils._pytree import tree_map

            res = tree_map(lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, res)
        return res

    load._xlatorch = True
    torch.load = load


install_load()


# --- picklers for torch.save(..., pickle_module=...) --------------------------------


def tensor_pickle_module(reduce) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.save`` whose pickler hands every tensor to ``reduce``.

    ``reduce(t)`` returns a reduce tuple, or ``NotImplemented`` to pickle ``t`` as
    usual. Tensors are found wherever pickle finds them (any container or object);
    pickle's memo makes a tensor reached twice one object after loading.
    """

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                return reduce(obj)
            return NotImplemented

    mod = types.ModuleType(f"{__name__}.pickle")
    mod.Pickler = Pickler
    return mod


def cpu_pickle_module() -> types.ModuleType:
    """A ``pickle_module`` that writes device tensors as CPU tensors.

    Each storage is downloaded once; a tensor is its view steps replayed on that CPU
    base, so aliasing survives (the file loads with CPU tensors that alias as the
    device tensors did). Non-device tensors pickle as usual.
    """
    bases: dict[int, torch.Tensor] = {}

    def reduce(t):
        if type(t) is not XlaTensor:
            return NotImplemented
        st = t._st
        base = bases.get(st.sid)
        if base is None:
            base = bases[st.sid] = _base_to_cpu(st)
        cpu = replay(base, encode_view(t._vw), t.requires_grad, isinstance(t, torch.nn.Parameter))
        return cpu.__reduce_ex__(2)

    return tensor_pickle_module(reduce)


# --- atomic files --------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    """Make a rename in directory ``path`` durable (where the OS can open directories)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    """A fresh hidden name beside ``path`` (``.<name>.<pid>.<random>.tmp``), for ``atomic_write``."""
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def _remove_stale_temporaries(path: str) -> None:
    """Temporaries of ``path`` left by writers that died (SIGKILL during a save): the pid in
    the name is no longer a live process. Another live writer's temporary stays."""
    d, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}."
    try:
        entries = os.listdir(d)
    except OSError:
        return
    for e in entries:
        if not (e.startswith(prefix) and e.endswith(".tmp")):
            continue
        parts = e[len(prefix) : -len(".tmp")].split(".")
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(d, e))


class RecordingFile:
    """A binary file that remembers the first ``OSError`` a write raised: torch's zip writer
    turns it into ``RuntimeError: ... unexpected pos``, and ``write_error`` finds the real one
    (ENOSPC, EFBIG, EIO) here."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, b):
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name):
        return getattr(self.f, name)


def write_error(path: str, exc: BaseException, rec: RecordingFile | None = None) -> OSError | None:
    """The error to raise when saving to ``path`` failed with ``exc``: the ``OSError`` behind
    it (the one ``rec`` recorded, else ``exc`` itself), with its errno and naming ``path``, the
    file the user named (not a temporary or tensor file beside it); None when no ``OSError``
    with an errno caused the failure."""
    err = rec.error if rec is not None and rec.error is not None else exc if isinstance(exc, OSError) else None
    if err is None or err.errno is None:
        return None
    return OSError(err.errno, f"{os.strerror(err.errno)}: writing {path} (the previous file, if any, is unchanged)",
                   path)  # fmt: skip


def atomic_write(path, write) -> None:
    """Create or replace file ``path`` all at once: ``write(f)`` fills a temporary file.

    The temporary file sits beside ``path``; it is flushed, fsynced and renamed over
    ``path``, then the directory is fsynced. A crash at any point leaves either the old
    file or the new one at ``path``, never a partial one (at worst an orphaned
    ``.<name>.*.tmp``). Permissions follow the umask, as for a plain ``open``. A failure
    the OS reports (a missing directory, a full disk) raises its ``OSError`` subclass
    naming ``path``, never the temporary file, which is removed.
    """
    path = os.fspath(path)
    _remove_stale_temporaries(path)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:  # as open(path) would say it: the temporary file is ours, not the user's
        raise OSError(e.errno, e.strerror, path) from None
    rec = None
    try:
        with os.fdopen(fd, "wb") as f:
            rec = RecordingFile(f)
            write(rec)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        err = write_error(path, e, rec)
        if err is not None:
            raise err from e
        raise
    fsync_dir(os.path.dirname(tmp))


tensor.REDUCE = reduce_tensor  # pickling a device tensor (torch.save, copy, multiprocessing)
