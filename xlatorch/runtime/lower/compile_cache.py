"""The persistent compilation cache: XLA compilations kept on disk across runs.

This is JAX's persistent compilation cache, pointed into xlatorch's cache directory and
enabled for every graph (no minimum compile time or size). A graph seen in an earlier run
(same HLO, same compiler and device) skips XLA's compile, which is most of a first step.
JAX's key is the lowered module, so the graph would still be traced and lowered to
StableHLO first: ``program_cache.py`` keeps each graph's lowered program in the same
directory, keyed by xlatorch's own graph key, and a graph found there is not traced at all
(GPT's first step: compile time warm/cold 0.12 -> 0.05, ``bench.compile_cache``).

What xlatorch changes in it:

- **Relocatable.** JAX's default ``jax_persistent_cache_enable_xla_caches`` writes the
  cache's own path into the compile options (XLA:GPU's per-fusion autotune cache directory),
  and the options are part of the key: a cache copied or moved elsewhere (a CI cache
  restored under another home) never hit. Those XLA caches are off here; they only serve
  XLA:GPU (autotuning results of fusions shared between graphs that each miss), while a
  graph found in this cache skips autotuning with the rest of its compile.
- **Bounded**, at ``XLATORCH_CACHE_MAX_BYTES`` (default 1 GiB; ``512M``, ``2G`` ...), by
  ``_DiskCache`` in place of JAX's ``LRUCache``. Same files (``<key>-cache``, so earlier
  caches stay valid), but a hit only reads its file: JAX's own bound takes a file lock and
  writes an access-time file on every hit, and reads every entry's access-time file on
  every write. Eviction runs once when the process first compiles (a background thread
  scans the directory) and after a write takes the directory past the bound (bytes written
  by this process are counted, no scan per write), deleting least recently used entries
  first, down to 90% of the bound. Recency is the file's atime or mtime, whichever is newer:
  the kernel sets atime on the first read after a write (``relatime``) at no cost to us;
  on a ``noatime`` mount it is the time of writing. Entries are written to a temporary file
  and renamed, so no reader or eviction ever sees half an entry, and processes may share
  the directory (one evicting what another is about to read only makes that a miss).

(Serializing whole executables, keyed by xlatorch's graph, would also skip tracing and
lowering, but reloading a CPU executable proved unsafe here: one calling LAPACK crashed
the loading process, and one JAX had itself loaded from its cache came back missing a
kernel. The program cache stores StableHLO instead, and XLA's executable still comes
through JAX's cache, keyed by that module.)

``XLATORCH_CACHE_DIR`` sets the directory (default ``$XDG_CACHE_HOME/xlatorch``, i.e.
``~/.cache/xlatorch``; entries in its ``jax/``); ``XLATORCH_CACHE_DIR=`` (empty) turns it
off. Counters: ``PersistentCacheHit``, ``PersistentCacheMiss``, ``PersistentCacheEviction``
(entries deleted, the program cache's among them); the program cache counts its own
(``ProgramCache*``). ``python -m bench.compile_cache`` times a warm first step against a cold one.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time

import jax
from jax._src import compilation_cache
from jax._src.compilation_cache_interface import CacheInterface

from xlatorch.runtime.base import config
from xlatorch.runtime.base.record import COUNTERS

__all__ = ["directory", "configure", "use", "disk", "readonly"]

_EVENTS = {
    "/jax/compilation_cache/cache_hits": "PersistentCacheHit",
    "/jax/compilation_cache/cache_misses": "PersistentCacheMiss",
}


_listening = [False]  # our counters listen to JAX's cache events
_SUFFIX = "-cache"  # JAX's LRUCache names its entries so: caches it wrote stay valid
_LOW_WATER = 0.9  # eviction goes down to this share of the bound, so writes don't each evict
_STALE_TMP_S = 3600  # a temporary file this old was left by a writer that died
_DISKS: dict = {}  # directory -> its _DiskCache: JAX's entries and program_cache.py's share one bound


class _DiskCache(CacheInterface):
    """Entries ``<dir>/<key>-cache``: read with no bookkeeping, written atomically, the
    directory kept within ``max_bytes`` by deleting least recently used entries."""

    def __init__(self, path: str, max_bytes: int):
        self._path = pathlib.Path(path)
        self._path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one eviction at a time; guards _size
        self._size: int | None = None  # bytes on disk at the last scan, plus this process's writes since
        os.register_at_fork(after_in_child=self._forked)
        threading.Thread(target=self.evict, name="xlatorch-cache-evict", daemon=True).start()

    def _forked(self) -> None:
        # A child forked while the scan held the lock would wait for it forever at its
        # first write; without the scan's total it does not evict (the next process does).
        self._lock = threading.Lock()
        self._size = None

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path / f"{key}{_SUFFIX}", "rb") as f:
                return f.read()
        except FileNotFoundError:  # never written, or evicted (maybe by another process just now)
            return None

    def remove(self, key: str) -> None:
        """Delete entry ``key`` (one found corrupt: written again at the next miss)."""
        _unlink(os.path.join(self._path, f"{key}{_SUFFIX}"))

    def put(self, key: str, value: bytes) -> None:
        dest = self._path / f"{key}{_SUFFIX}"
        if len(value) > self.max_bytes or dest.exists():
            return
        # A unique temporary name, renamed into place: readers, other writers of the same key
        # and eviction only ever see whole entries.
        tmp = self._path / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_bytes(value)
            os.replace(tmp, dest)
        except OSError:  # a full or read-only disk: the entry is only not kept
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            if self._size is None:  # the first scan is still running: it will count this entry
                return
            self._size += len(value)
            over = self._size > self.max_bytes
        if over:
            self.evict(keep=dest.name)

    def evict(self, keep: str | None = None) -> None:
        """Scan the directory and delete least recently used entries (never ``keep``) until
        it holds at most ``_LOW_WATER`` of the bound, if it holds more than the bound."""
        with self._lock:
            entries, total, now = [], 0, time.time()
            try:
                scan = list(os.scandir(self._path))
            except OSError:
                return
            for e in scan:
                try:
                    st = e.stat()
                except OSError:  # deleted meanwhile
                    continue
                if e.name.endswith(_SUFFIX):
                    entries.append((max(st.st_atime, st.st_mtime), e.name, st.st_size))
                    total += st.st_size
                elif e.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    _unlink(e.path)
            if total > self.max_bytes:
                entries.sort()
                target = int(self.max_bytes * _LOW_WATER)
                for _, name, size in entries:
                    if total <= target:
                        break
                    if name == keep:
                        continue
                    _unlink(os.path.join(self._path, name))
                    _unlink(os.path.join(self._path, name[: -len(_SUFFIX)] + "-atime"))  # JAX's LRU's
                    total -= size
                    COUNTERS["PersistentCacheEviction"] += 1
            self._size = total


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already (another process evicted it too)
        pass


def _file_cache(path: str) -> tuple[CacheInterface, str]:
    """In place of JAX's ``compilation_cache.get_file_cache``, which its cache calls once
    (lazily, at the first compile)."""
    cache: CacheInterface = _disk(path)
    if jax.config.jax_compilation_cache_check_contents:
        cache = compilation_cache.VerificationCache(cache)
    return cache, path


def _disk(path: str) -> _DiskCache:
    d = _DISKS.get(path)
    if d is None:
        d = _DISKS[path] = _DiskCache(path, config.env("XLATORCH_CACHE_MAX_BYTES"))
    return d


def disk() -> _DiskCache | None:
    """The persistent cache's directory as a ``_DiskCache`` (``program_cache.py`` keeps its
    entries there too), or None when the cache is off."""
    path = jax.config.jax_compilation_cache_dir
    if not path or not jax.config.jax_enable_compilation_cache or compilation_cache.get_file_cache is not _file_cache:
        return None
    return _disk(path)


def readonly() -> bool:
    """Whether entries are only read (``use(path, readonly=True)``)."""
    return jax.config.jax_persistent_cache_min_compile_time_secs == float("inf")


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


def _setup() -> None:
    # Not JAX's XLA caches: they put the cache's path into the key (module docstring).
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    compilation_cache.get_file_cache = _file_cache
    if not _listening[0]:
        jax.monitoring.register_event_listener(_count)
        _listening[0] = True


def configure() -> None:
    """Enable JAX's persistent cache in ours (at import, before anything compiles)."""
    d = directory()
    if d is None:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.join(d, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _setup()


def use(path: str, readonly: bool = False) -> None:
    """Keep the persistent cache in ``path`` instead (``xr.initialize_cache``); ``readonly``:
    read entries there but write none (every compile is then below the minimum compile
    time a write needs). Before anything compiles.

    Raises:
      RuntimeError: a computation has already been compiled (the cache is in use).
    """
    if COUNTERS["UncachedCompile"]:  # an xlatorch graph was compiled: entries went to the old place
        raise RuntimeError("xlatorch: the computation cache has already been initialized: call "
                           "initialize_cache() before the first computation")  # fmt: skip
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf") if readonly else 0)
    _setup()
    compilation_cache.reset_cache()  # JAX opened the old directory already (at import): reopen
