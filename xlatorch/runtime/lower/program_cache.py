"""The lowered-program cache: a graph's StableHLO kept on disk, keyed by xlatorch's own graph key.

JAX's persistent cache (``compile_cache.py``) is keyed by the lowered module, so a graph seen
by an earlier process still had its emitters traced by JAX and lowered to StableHLO before
XLA's compile was found on disk: over 80% of a warm first step (GPT). Here the program,
exported by ``jax.export``, is stored under a digest of the graph's key, and a process that
meets the same graph again rebuilds ``jax.jit(exported.call)`` from it without tracing
anything; JAX's cache then finds its XLA compile. Every graph this layer serves is compiled
through ``exported.call``, the first time too, so the module XLA compiles (and JAX's key) is
the same in every process, and so are the numbers. What this costs a graph seen for the
first time: exporting and serializing the module and lowering the call, 5-13 ms (80 graphs of
3 nodes: 32 -> 45 ms of compile each; GPT's step, 3-5 s, about the same). A graph of fewer than
``MIN_NODES`` nodes gains nothing from it and is left out.

The key text (stored whole in the entry and compared on load: a digest collision or a stale
entry is a miss, never the wrong program) is the executable cache's key with each op named
(an ``OpSpec`` registered under its name; anything else, such as an op made at run time,
keeps its graph out of this layer), the sharing pattern of equal scalars, the region's name,
and what else decides the lowering in a process: the xlatorch source (a digest of the
package's files), jax and jaxlib versions, the platform and device kind, JAX's settings (x64,
the matmul precision ...), xlatorch's environment variables (but where the cache is,
timeouts, ranks) and torch's and numpy's versions. A graph whose key holds
anything else (a Python object), compiled for another local device than the first, with
collectives, partitioned (SPMD) or under ``XLA_HLO_DEBUG`` (its metadata names the user's
lines) is not served; nor is one that ``jax.export`` refuses (host callbacks, effects).
On-device checks are: their table (rows, exception types by name, messages, masks) is stored
with the program.

Entries are files of the persistent cache's directory (``xlatorch-program-<digest>-cache``),
under its bound (``XLATORCH_CACHE_MAX_BYTES``) and least-recently-used eviction. An entry is
checked by a digest of its bytes; a corrupt or truncated one is deleted and counted a miss.
Counters: ``ProgramCacheHit``, ``ProgramCacheMiss``, ``ProgramCacheSkip`` (a graph not
served), ``ProgramCacheCorrupt``.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import json
import os
import pathlib
import struct
import sys
import threading
import zlib
from contextlib import contextmanager

import jax
import numpy as np
import torch

from xlatorch.runtime.base import config, record, regions
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.topology import jax_device
from xlatorch.runtime.ir.ops import SPECS, OpSpec
from xlatorch.runtime.lower import compile_cache
from xlatorch.runtime.plan.keep import Keep, Unchecked

__all__ = ["graph_key", "key_text", "load", "export", "calling"]

# Graphs of fewer nodes are not served: tracing and lowering them again costs about what
# loading them does, and exporting them costs a first run about 13 ms of a 45 ms compile.
MIN_NODES = 16
_MAGIC = b"xlatorch-program-2\n"
_PREFIX = "xlatorch-program-"
# Variables that cannot change a lowered program (where the cache is, timeouts, ranks ...):
# every other one of xlatorch's variables is part of the key.
_NOT_LOWERING = frozenset((
    "XLATORCH_CACHE_DIR", "XLATORCH_CACHE_MAX_BYTES", "XLATORCH_EXECUTABLE_CACHE_SIZE", "XLATORCH_PROFILE",
    "XLATORCH_PROFILE_STEPS", "XLA_METRICS_FILE", "XLATORCH_FALLBACK_REPORT", "XLATORCH_GC_FREEZE",
    "XLATORCH_DEFER_SIGINT", "XLATORCH_COORDINATOR", "XLATORCH_RANK", "XLATORCH_LOCAL_RANK",
    "XLATORCH_INIT_TIMEOUT", "XLATORCH_HEARTBEAT_TIMEOUT",
    "XLATORCH_RENDEZVOUS_TIMEOUT", "XLATORCH_HOST_INDEX",
))  # fmt: skip
# JAX settings whose names hold these do not change a lowered program either.
_JAX_NOT_LOWERING = ("cache", "log", "dump", "profil", "traceback", "transfer", "visible_devices", "timeout",
                     "explain", "pprint", "distributed", "preemption", "cross_host", "share_binary")  # fmt: skip
# Read at import, as config reads them (a variable set later changes nothing).
_ENV = tuple((n, os.environ.get(n)) for n in sorted(config.VARS) if n not in _NOT_LOWERING)
_process: list = []  # the process's part of every key, made at the first


class _Unstable(Exception):
    """A key part with no text that means the same in another process."""


def _enc(o, out: list) -> None:
    t = type(o)
    if t is tuple or t is list:
        out.append("(")
        for x in o:
            _enc(x, out)
        out.append(")")
    elif t is int:
        out.append(str(o))
    elif t is bool or o is None:
        out.append(repr(o))
    elif t is str:
        out.append(repr(o))
    elif t is float:
        out.append(o.hex())
    elif t is torch.dtype or t is torch.memory_format or t is torch.layout or t is torch.device:
        out.append(str(o))
    elif t is OpSpec:
        if SPECS.get(o.name) is not o or not _as_registered(o):  # its name may not say what it emits
            raise _Unstable
        out.append("op:" + o.name)
    elif t is type and o.__module__ == "builtins":
        out.append("type:" + o.__name__)
    elif t is Keep:
        out.append(f"keep:{o.in_graph}")
        _enc(tuple(o), out)
    elif t is Unchecked:  # checks decided before the step: lowered without them
        out.append("unchecked")
    else:
        raise _Unstable


_VERIFIED: dict = {}  # OpSpec -> (emit, check) found to be the module-level functions they name


def _as_registered(spec: OpSpec) -> bool:
    """Whether ``spec`` emits with the functions its modules define under their names (not one
    put in their place at run time, such as a test's or a debugging session's wrapper: its
    program would be stored under the op's name, or the op's served in its place)."""
    fns = (spec.emit, spec.check)
    if _VERIFIED.get(spec) == fns:
        return True
    for fn in fns:
        if fn is None:
            continue
        obj = sys.modules.get(getattr(fn, "__module__", None) or "")
        for part in getattr(fn, "__qualname__", "<>").split("."):
            obj = getattr(obj, part, None)
        if obj is not fn:
            return False
    _VERIFIED[spec] = fns
    return True


def _package_digest() -> str:
    """A digest of xlatorch's source: the package's files and the generated shims and
    emitters (``xlatorch._generated``, a folder of its own in a source checkout)."""
    root = pathlib.Path(__file__).resolve().parents[2]  # the xlatorch package
    gen = importlib.import_module("xlatorch._generated")
    tops = [root] + [g for g in (pathlib.Path(p).resolve() for p in gen.__path__) if not g.is_relative_to(root)]
    h = hashlib.sha256()
    for top in tops:
        for p in sorted(top.rglob("*")):
            if p.suffix in (".py", ".yaml", ".json") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(top)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _jax_settings() -> str:
    out = []
    for name, v in sorted(jax.config.values.items()):
        if any(s in name for s in _JAX_NOT_LOWERING):
            continue
        if isinstance(v, enum.Enum):
            v = f"{type(v).__name__}.{v.name}"
        elif not (v is None or type(v) in (bool, int, float, str)):
            raise _Unstable
        out.append(f"{name}={v!r}")
    return ";".join(out)


def graph_key(req) -> str | None:
    """The text of ``req``'s graph key that means the same in every process (``key_text``
    adds the scalars' sharing), or None when the graph is not served (counted)."""
    if compile_cache.disk() is None:
        return None
    try:
        if req.spmd is not None or req.dev != 0 or record.HLO_DEBUG:
            raise _Unstable
        if not _process:
            import jaxlib

            dev = jax_device(0)
            _process.append(f"xlatorch {_package_digest()} jax {jax.__version__} jaxlib {jaxlib.__version__} "
                            f"torch {torch.__version__} numpy {np.__version__} {dev.platform} "
                            f"{dev.device_kind!r} env {_ENV!r}")  # fmt: skip
        out = [_process[0], _jax_settings()]
        region = regions.current() if regions.ACTIVE else None
        out.append(f"region {region.name if region is not None else None!r}")
        _enc(req.key, out)
    except _Unstable:
        COUNTERS["ProgramCacheSkip"] += 1
        return None
    return " ".join(out)


def key_text(graph: str, share) -> str:
    """The whole key: ``graph`` (``graph_key``) and ``share`` (a ``function.Shared``, or None)."""
    return graph + " share " + repr(sorted(share.rep.items()) if share is not None else None)


def _name(text: str) -> str:
    return _PREFIX + hashlib.sha256(text.encode()).hexdigest()


def load(text: str, table):
    """The ``jax.export.Exported`` stored under ``text``, its checks put in ``table``; None on
    a miss (an entry for another key, corrupt or truncated, is a miss too)."""
    disk = compile_cache.disk()
    name = _name(text)
    blob = disk.get(name) if disk is not None else None
    if blob is None:
        COUNTERS["ProgramCacheMiss"] += 1
        return None
    try:
        head, module = _split(blob)
        if head["key"] != text:  # a digest collision, or an entry written by a bug: never run it
            COUNTERS["ProgramCacheMiss"] += 1
            return None
        exported = _exported(head["exported"], module)
        rows = [(k, _exception(exc), msg) for k, exc, msg in head["table"]["rows"]]
    except Exception:  # anything in the entry not as written: delete it, compile as if absent
        COUNTERS["ProgramCacheCorrupt"] += 1
        COUNTERS["ProgramCacheMiss"] += 1
        disk.remove(name)
        return None
    t = head["table"]
    table.clear()
    table.rows, table.masks, table.undo, table.in_graph = rows, t["masks"], t["undo"], t["in_graph"]
    table.node_rows = {k: m for k, m in t["node_rows"]}
    COUNTERS["ProgramCacheHit"] += 1
    return exported


def export(fn, args, text: str | None, table):
    """``fn`` (a jitted function) exported for ``args`` and stored under ``text`` (None: kept
    only in memory) with ``table``'s checks, filled by its trace; None if JAX cannot export it
    (counted: the caller lowers it as usual)."""
    try:
        exported = jax.export.export(fn)(*args)
        meta = _meta(exported)
    except Exception:
        COUNTERS["ProgramCacheSkip"] += 1
        return None
    disk = compile_cache.disk()
    if text is None or disk is None or compile_cache.readonly():
        return exported
    try:
        rows = [(k, _exception_name(exc), msg) for k, exc, msg in table.rows]
    except _Unstable:
        COUNTERS["ProgramCacheSkip"] += 1
        return exported
    t = dict(rows=rows, masks=table.masks, undo=table.undo, in_graph=table.in_graph,
             node_rows=sorted(table.node_rows.items()))  # fmt: skip
    head = zlib.compress(json.dumps(dict(key=text, table=t, exported=meta)).encode())
    body = _MAGIC + struct.pack(">Q", len(head)) + head + zlib.compress(exported.mlir_module_serialized)
    disk.put(_name(text), body + hashlib.sha256(body).digest())
    return exported


_no_lapack = threading.local()


def _ensure_backends(platforms) -> None:
    if not getattr(_no_lapack, "on", False):
        _ensure_backends_default(platforms)


try:  # lowering ``exported.call`` on CPU imports scipy for LAPACK (0.24 s): not for a program without it
    from jax._src.export import _export

    _ensure_backends_default = _export._ensure_backends_initialized
    _export._ensure_backends_initialized = _ensure_backends
except (ImportError, AttributeError):  # another jax: it initializes LAPACK at every load (slower only)
    pass


@contextmanager
def calling(exported):
    """Around lowering ``exported.call``: LAPACK's CPU handlers are registered only if the
    program calls LAPACK (JAX registers them for every CPU program)."""
    _no_lapack.on = b"lapack" not in exported.mlir_module_serialized
    try:
        yield
    finally:
        _no_lapack.on = False


def _split(blob: bytes) -> tuple[dict, bytes]:
    body, digest = blob[:-32], blob[-32:]
    if not body.startswith(_MAGIC) or hashlib.sha256(body).digest() != digest:
        raise ValueError("corrupt entry")
    n = struct.unpack_from(">Q", body, len(_MAGIC))[0]
    start = len(_MAGIC) + 8
    return json.loads(zlib.decompress(body[start : start + n])), zlib.decompress(body[start + n :])


def _avals(avals) -> list:
    return [(list(a.shape), str(a.dtype), bool(a.weak_type)) for a in avals]


def _in_tree(groups):
    return jax.tree_util.tree_structure((tuple([0] * n for n in groups), {}))


def _meta(e) -> dict:
    """What rebuilds ``e`` besides its module; raises for what this layer does not keep."""
    groups = [c.num_leaves for c in e.in_tree.children()[0].children()]
    shardings = (*e.in_shardings_hlo, *e.out_shardings_hlo, *e._in_named_shardings, *e._out_named_shardings)
    if (len(groups) != 3 or e.in_tree != _in_tree(groups)
            or e.out_tree != jax.tree_util.tree_structure((0,) * len(e.out_avals)) or e.nr_devices != 1
            or e.ordered_effects or e.unordered_effects or e.disabled_safety_checks
            or any(s is not None for s in shardings)):  # fmt: skip
        raise ValueError("not kept by this layer")
    return dict(fun_name=e.fun_name, groups=groups, in_avals=_avals(e.in_avals), out_avals=_avals(e.out_avals),
                platforms=list(e.platforms), version=e.calling_convention_version,
                kept=list(e.module_kept_var_idx), global_constants=e.uses_global_constants)  # fmt: skip


def _exported(m: dict, module: bytes):
    def avals(a):
        return tuple(jax.core.ShapedArray(tuple(s), np.dtype(d), weak_type=w) for s, d, w in a)

    d, k, p = m["groups"]
    out_avals = avals(m["out_avals"])
    return jax.export.Exported(
        fun_name=m["fun_name"], in_tree=_in_tree((d, k, p)),
        in_avals=avals(m["in_avals"]), out_tree=jax.tree_util.tree_structure((0,) * len(out_avals)),
        out_avals=out_avals, _has_named_shardings=True, _in_named_shardings=(None,) * (d + k + p),
        _out_named_shardings=(None,) * len(out_avals), in_shardings_hlo=(None,) * (d + k + p),
        out_shardings_hlo=(None,) * len(out_avals), nr_devices=1, platforms=tuple(m["platforms"]),
        ordered_effects=(), unordered_effects=(), disabled_safety_checks=(), mlir_module_serialized=module,
        calling_convention_version=m["version"], module_kept_var_idx=tuple(m["kept"]),
        uses_global_constants=m["global_constants"], _get_vjp=None,
    )  # fmt: skip


def _exception_name(exc) -> str:
    name = f"{exc.__module__}:{exc.__qualname__}"
    if _exception(name) is not exc:
        raise _Unstable
    return name


def _exception(name: str) -> type:
    mod, qual = name.split(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, BaseException)):
        raise ValueError(f"not an exception: {name}")
    return obj
