"""The persistent compilation cache: compiled graphs on disk, so a second run skips both the
lowering and XLA's compile of every graph it has seen before.

A graph's file name is a hash of its structural key (op names, static arguments,
avals: ``runtime/graph.py``) salted with everything else that decides the executable:
the xlatorch code that lowers ops, the JAX/jaxlib versions, the platform and device
kind, and the precision mode. Files are written to a temporary name and renamed, so
processes sharing the directory never read a partial file; an unreadable file is
recompiled and replaced.

``XLATORCH_CACHE_DIR`` sets the directory (default ``$XDG_CACHE_HOME/xlatorch/executables``,
i.e. ``~/.cache/xlatorch/executables``); ``XLATORCH_CACHE_DIR=`` (empty) turns it off.
"""

from __future__ import annotations

import hashlib
import os
import pickle

import jax

from xlatorch.debug.metrics import COUNTERS

__all__ = ["directory", "compile_cached"]

_salt: list = []


def directory() -> str | None:
    """The cache directory, or None when the cache is off."""
    d = os.environ.get("XLATORCH_CACHE_DIR")
    if d is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "xlatorch", "executables")
    return d or None


def _code_salt() -> bytes:
    """What decides a graph's executable besides its key: lowering code, compiler, device."""
    if not _salt:
        import jaxlib

        import xlatorch
        from xlatorch.runtime.dtypes import TORCH_TO_JAX
        from xlatorch.runtime.transfer import jax_device

        h = hashlib.sha256()
        dev = jax_device()
        storage = sorted((str(k), str(v)) for k, v in TORCH_TO_JAX.items())  # the precision mode
        h.update(repr((jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
                       jax.config.jax_enable_x64, storage)).encode())  # fmt: skip
        import xlatorch._generated as generated

        pkg = os.path.dirname(xlatorch.__file__)
        for folder in (os.path.join(pkg, "lowering"), os.path.join(pkg, "runtime"), generated.__path__[0]):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as f:
                        h.update(name.encode() + f.read())
        _salt.append(h.digest())
    return _salt[0]


def compile_cached(jitted, args, key):
    """``jitted.lower(*args).compile()``, from disk when this graph was compiled before."""
    d = directory()
    if d is None:
        return jitted.lower(*args).compile()
    from jax.experimental import serialize_executable

    name = hashlib.sha256(_code_salt() + repr(key).encode()).hexdigest()
    path = os.path.join(d, name[:2], name)
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        COUNTERS["PersistentCacheHit"] += 1
        return exe
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001 (a damaged or foreign file: compile and replace it)
        COUNTERS["PersistentCacheError"] += 1
    exe = jitted.lower(*args).compile()
    try:
        blob = pickle.dumps(serialize_executable.serialize(exe))
    except Exception:  # noqa: BLE001 (an executable that cannot be serialized is just not cached)
        return exe
    from xlatorch.runtime.serialization import atomic_write

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda f: f.write(blob))
        COUNTERS["PersistentCacheWrite"] += 1
    except OSError:  # a read-only or full disk must not fail the step
        COUNTERS["PersistentCacheError"] += 1
    return exe
