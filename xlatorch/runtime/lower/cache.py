"""The in-memory executable cache: compiled graphs by key, the least recently used dropped.

At most ``CACHE_SIZE`` executables stay in memory (``XLATORCH_EXECUTABLE_CACHE_SIZE``): the
least recently used is dropped (counter ``CompileCacheEviction``) and, if met again,
compiled anew, which the persistent compilation cache (``compile_cache.py``) turns into a
load from disk. A steady-state program uses a handful; a program sweeping input shapes would
otherwise keep every one (0.5 MB for a small graph, more for a large one).

A loop over more graphs than that (a dynamic-cache ``generate()`` of 600 tokens compiles a
stage per length) would drop each graph just before it comes back, and compile all of them
at every call. So, unless the user set the limit, each graph met again after it was dropped
raises it by one, up to ``CACHE_SIZE_MAX`` (counter ``CompileCacheGrown``), while the host
has a quarter of its memory available (executables live in host memory): a sweep that never
comes back stays within the limit; a loop gets room for exactly what it reuses.
"""

from __future__ import annotations

import itertools

from xlatorch.runtime.base import config, memory
from xlatorch.runtime.base.record import COUNTERS

__all__ = ["CACHE", "set_cache_size", "missed", "add", "touch"]

CACHE: dict = {}  # graph key -> Executable
_USER_SIZE = config.env("XLATORCH_EXECUTABLE_CACHE_SIZE")
CACHE_SIZE = _USER_SIZE or 512
CACHE_SIZE_MAX = 8 * CACHE_SIZE
_fixed = [_USER_SIZE is not None]  # the user's limit is kept as given
_dropped: dict = {}  # hash of a dropped graph's key -> None, oldest first (bounded)
_uses = itertools.count()


def set_cache_size(n: int) -> None:
    """Keep at most ``n`` compiled graphs in memory (evicting the least recently used now);
    the limit is then fixed (it no longer grows for a loop that needs more)."""
    global CACHE_SIZE
    CACHE_SIZE = max(1, int(n))
    _fixed[0] = True
    _evict()


def touch(exe) -> None:
    """``exe`` runs now (the least recently run is dropped first)."""
    exe.used = next(_uses)


def add(key, exe) -> None:
    """Keep ``exe``, just compiled for ``key`` (after ``missed(key)``)."""
    touch(exe)
    CACHE[key] = exe
    if len(CACHE) > CACHE_SIZE:
        _evict()


def _evict() -> None:
    while len(CACHE) > CACHE_SIZE:
        oldest = min(CACHE, key=lambda k: CACHE[k].used)
        if CACHE.pop(oldest, None) is None:  # another device's thread dropped it (ir._multi syncs unlocked)
            continue
        COUNTERS["CompileCacheEviction"] += 1
        if not _fixed[0]:
            _dropped[hash(oldest)] = None
            if len(_dropped) > CACHE_SIZE_MAX:
                _dropped.pop(next(iter(_dropped)), None)


def missed(key) -> None:
    """At a miss: a graph dropped from memory and met again means the program loops over
    more graphs than the limit: one more place, for it (not past ``CACHE_SIZE_MAX``)."""
    global CACHE_SIZE
    if _dropped and _dropped.pop(hash(key), 0) is None and CACHE_SIZE < CACHE_SIZE_MAX and _host_room():
        CACHE_SIZE += 1
        COUNTERS["CompileCacheGrown"] += 1


def _host_room() -> bool:
    """Whether a quarter of the host's memory (a container's, where limited) is still
    available (True where unknown)."""
    free, total = memory.host_memory()
    return free is None or free * 4 >= total
