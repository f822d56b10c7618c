"""Which user thread the device's work is for, one thread at a time, and the clock of writes.

A backward pass started from a device tensor runs in the thread that called ``backward``
(runtime/trace/modules.py); one started elsewhere runs its device ops on autograd's own
device thread: what they make belongs to the thread that called ``backward`` (``owner``),
and errors found for another thread wait for it (``DEFERRED``). ``LOCK`` lets one thread at
a time record ops or sync; ``TICKS`` orders every storage write and checked op (a failed
check undoes what was traced after it).
"""

from __future__ import annotations

import itertools
import threading

import torch

__all__ = ["TICKS", "LOCK", "DEFERRED", "CALLERS", "CHECKED_SINCE_SYNC", "BODIES", "owner", "defer_to_owners"]

# One clock for every storage write and checked op: a storage's ``gen`` is the tick of its
# last write, so a failed check can tell which updates of a step were traced after it.
TICKS = itertools.count(1)
# One thread at a time records ops or syncs. A sync donates the buffers no storage holds any
# more; another thread in the middle of an op may hold such a buffer in a node it has not
# yet stored, and would later read a deleted array. Re-entrant: ops decompose into ops, and
# a CPU fallback syncs. Not taken under dp.DataParallel (``ir._multi``), whose threads
# each record and sync their own device's graphs and meet inside replicated executions.
LOCK = threading.RLock()
_in_backward = torch._C._current_graph_task_id  # -1 unless this thread runs a backward pass
_get_ident = threading.get_ident
# Errors of values that other threads made, found by this thread's sync: thread id -> error,
# raised at that thread's next op or sync (an error stays in the thread that caused it).
DEFERRED: dict[int, BaseException] = {}
# The user thread whose device backward pass is running (one at a time: runtime/trace/modules.py).
# Autograd runs device ops on its own thread, for the thread that called backward: what
# they make belongs to that thread, and their errors are raised there, never on the device
# thread (an exception there aborts the process, see __torch_dispatch__).
CALLERS: dict[int, int] = {}


def owner() -> int | None:
    """The user thread this thread's ops work for: itself or, on autograd's device thread,
    the thread that called ``backward`` (None if unknown: a backward pass that does not
    start from a device tensor, or dp.DataParallel's concurrent ones)."""
    if _in_backward() == -1:
        return _get_ident()
    if len(CALLERS) == 1:
        for caller in CALLERS:
            return caller
    return None


def defer_to_owners(error: BaseException, owners) -> None:
    """Leave ``error`` for the user threads in ``owners`` (None: the one in a backward pass,
    if any) to raise at their next op, sync or the end of their backward pass. The error
    keeps the tick it was deferred at (``_xlatorch_tick``): a backward pass that runs on after
    it undoes what it made since (runtime/trace/modules.py)."""
    if not hasattr(error, "_xlatorch_tick"):
        error._xlatorch_tick = next(TICKS)
    for o in owners:
        for t in CALLERS if o is None else (o,):
            DEFERRED.setdefault(t, error)


# Threads that traced an op with an on-device check since the last sync ran everything: data
# they write into a tensor (``copy_`` of ready device or host data) becomes a pending value,
# so that the sync can undo the write if that op fails, as CPU would never have made it.
CHECKED_SINCE_SYNC: set = set()

# The bodies being traced (runtime/trace/bodies.py), innermost last: what they compute exists
# only inside their loop, so a sync meanwhile (a host read, a CPU fallback) is an error that
# names the body. Empty otherwise: one truth test per sync.
BODIES: list[str] = []
