"""The persistent compilation cache: XLA compilations kept on disk across runs.

This is JAX's own persistent compilation cache, pointed into xlatorch's cache directory
and enabled for every graph (no minimum compile time or size). A graph seen in an
earlier run (same HLO, same compiler and device) skips XLA's compile, which is most
of a first step. JAX keys entries by the lowered module and writes them atomically,
so processes may share the directory.

(Serializing whole executables would also skip lowering, but reloading a CPU
executable proved unsafe here: one calling LAPACK crashed the loading process, and
one JAX had itself loaded from its cache came back missing a kernel.)

``XLATORCH_CACHE_DIR`` sets the directory (default ``$XDG_CACHE_HOME/xlatorch``, i.e.
``~/.cache/xlatorch``); ``XLATORCH_CACHE_DIR=`` (empty) turns it off. Counters:
``PersistentCacheHit`` and ``PersistentCacheMiss``.
"""

from __future__ import annotations

import os

import jax

from xlatorch.runtime.base import config
from xlatorch.runtime.base.record import COUNTERS

__all__ = ["directory", "configure", "use"]

_EVENTS = {
    "/jax/compilation_cache/cache_hits": "PersistentCacheHit",
    "/jax/compilation_cache/cache_misses": "PersistentCacheMiss",
}


_listening = [False]  # our counters listen to JAX's cache events


def directory() -> str | None:
    """The cache directory, or None when the cache is off."""
    d = config.env("XLATORCH_CACHE_DIR")
    if d is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "xlatorch")
    return d or None


def _count(event: str, **kwargs) -> None:
    name = _EVENTS.get(event)
    if name is not None:
        COUNTERS[name] += 1


def configure() -> None:
    """Enable JAX's persistent cache in ours (at import, before anything compiles)."""
    d = directory()
    if d is None:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.join(d, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.monitoring.register_event_listener(_count)
    _listening[0] = True


def use(path: str, readonly: bool = False) -> None:
    """Keep the persistent cache in ``path`` instead (``xr.initialize_cache``); ``readonly``:
    read entries there but write none (every compile is then below the minimum compile
    time a write needs). Before anything compiles.

    Raises:
      RuntimeError: a computation has already been compiled (the cache is in use).
    """
    from jax._src import compilation_cache

    if COUNTERS["UncachedCompile"]:  # an xlatorch graph was compiled: entries went to the old place
        raise RuntimeError("xlatorch: the computation cache has already been initialized: call "
                           "initialize_cache() before the first computation")  # fmt: skip
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf") if readonly else 0)
    compilation_cache.reset_cache()  # JAX opened the old directory already (at import): reopen
    if not _listening[0]:
        jax.monitoring.register_event_listener(_count)
        _listening[0] = True
