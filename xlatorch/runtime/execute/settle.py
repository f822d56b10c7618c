"""Reading a step's on-device check rows, late, and undoing the step when one is set; the
device's end when the process exits.

A sync commits its results and returns; the rows of its checks (runtime/lower/checks.py) are
read when the program next needs the device's results (``settle``): at the next sync, at a
host read, at ``wait_device_ops``, at exit. A row that is set undoes the step (tensors get
their data from before it back, or carry the error) and raises CPU's exception.

At exit (``_at_exit``, before Python stops its threads) the work in flight ends before the
process does: see there.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from xlatorch.runtime.base import fork, topology
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.threads import LOCK
from xlatorch.runtime.execute import faults as failed
from xlatorch.runtime.execute.execution import EXECUTIONS, uninterrupted
from xlatorch.runtime.ir.values import Out
from xlatorch.runtime.lower.checks import failure

__all__ = ["Unsettled", "deferrable", "defer", "settle", "undo"]


class Unsettled:
    """A committed execution whose check rows are not read yet: what undoing it needs."""

    __slots__ = ("table", "flags", "names", "storages", "news", "prevs", "between")

    def __init__(self, table, flags, names, storages, news, prevs, between=()):
        self.table = table  # the executable's Table
        self.flags = flags  # the rows (a device array)
        self.names = names  # where(...)
        self.storages = storages  # the step's storages, in root order
        self.news = news  # the Data each was given by the commit
        # per storage: the Data that holds its data from before the step when the step failed
        # (the Data kept from before it, or its committed Data when the graph undid itself), or None
        self.prevs = prevs
        # per storage: the checked nodes traced between its first and last write in the step
        # (Keep.between): their failure leaves it no value to give back
        self.between = between


_UNSETTLED: list = []  # executions not read yet: each sync first settles those before it
_THREAD: list = [None]  # the one thread using the device (None: none yet; False: several have)
os.register_at_fork(after_in_child=lambda: _THREAD.__setitem__(0, None))  # a child's main thread is new


def deferrable(storages) -> bool:
    """Whether the rows of a step that computed ``storages`` may be read late: every thread
    that used the device so far, and every owner of the step's tensors, is this one."""
    me = threading.get_ident()
    t = _THREAD[0]
    if t is None:
        t = _THREAD[0] = me
    if t is not False and (t != me or any(st.owner != me for st in storages)):
        t = _THREAD[0] = False
    return t is not False


def defer(u: Unsettled) -> None:
    _UNSETTLED.append(u)


def settle() -> None:
    """Read the check rows of every execution not read yet, oldest first; when one is set,
    undo that step (see the module's docstring) and raise its error."""
    if topology.CLOSED[0]:  # every host read passes here first: none starts once the process exits
        topology.park()
    if not _UNSETTLED:
        return
    with LOCK:
        while _UNSETTLED:  # oldest first (a sync running parts apart may leave more than one)
            undo(_UNSETTLED.pop(0), late=True)


def undo(u: Unsettled, late: bool = False) -> None:
    """Read ``u``'s rows; when one fired: each root the failed op reaches (or traced after it)
    gets its data from before the step back, or carries the error; raise it."""
    COUNTERS["CheckRowsRead"] += 1
    try:
        found = failure(u.table.rows, u.flags, u.names)
    except Exception as e:  # the execution itself failed (reading its rows raises that): all of it
        found = e, -1
    if found is None:
        return
    error, fired = found
    with uninterrupted():  # an interrupt must not leave the step half undone
        hit, bad = [], {}  # the roots the failure reaches; id(Data) -> their results, not to be read
        for i, (st, mask, back) in enumerate(zip(u.storages, u.table.masks, u.table.undo)):
            if fired == -1:  # no results: what was kept goes back; what the graph was to undo is gone
                mask, back = -1, 0 if u.prevs[i] is u.news[i] else -1
            # Written before the failed op and after it: its value at that op is gone, it fails.
            lost = u.table.rows_of(u.between[i]) if u.between and u.between[i] else 0
            give = u.prevs[i] is not None and back & fired and (fired == -1 or not lost & fired)
            if give or (mask | back) & fired:
                hit.append((i, st, give))
                bad[id(u.news[i])] = u.news[i]
        tainted = set()
        if late:
            error.add_note(
                "xlatorch: found when the results of the step were next needed (on-device checks are read "
                "then; XLATORCH_CHECKS=sync reads them at each step's mark_step); the step's updates, and "
                "those traced from its results since, were undone"
            )
            tainted = failed.poison(bad, error)
        for i, st, give in hit:
            v = st.value
            if v is not u.news[i] and not (type(v) is Out and id(v.node) in tainted):
                if st.prev is u.news[i]:  # the program gave it a value of its own since: kept
                    st.prev = None if fired == -1 and u.prevs[i] is u.news[i] else u.prevs[i]
                continue
            if give:
                failed.give_back(st, u.prevs[i], error)
            else:
                failed.fail_storages([st], error)
    failed.raise_owned(error, [st for st, m in zip(u.storages, u.table.masks) if m & fired or fired == -1])


# What the program still owes when it exits, done first (xlatorch.core.step_closures: the
# asynchronous closures of its last steps). An exception there is the program's exit status.
EXIT_HOOKS: list = []


def _at_exit() -> None:
    """The process exits: what it owes runs, the device takes no more work from other threads,
    and what is in flight ends, before Python stops its threads.

    Python (before 3.14) ends a daemon thread that takes the GIL back while the interpreter
    finalizes with ``pthread_exit``, whose unwinding aborts the process (SIGABRT, "FATAL:
    exception not rethrown") when it crosses C++ that released the GIL: a jaxlib call
    (``ExecuteTime``'s thread waiting for the last step, execution.py; a program's thread
    syncing or reading), torch's bindings around every op (a program's thread; autograd's
    device thread between a backward pass's ops). So this ``atexit`` hook (registered after
    JAX's, it runs before them, the backend still up) takes the device lock for good (a
    thread inside an op or a sync finishes it first); from then on other threads that come
    for the device wait for the end of the process (at the lock, or ``topology.park``). It
    waits for every execution, gives threads coming back from such calls the GIL to get
    there, and reads the last step's checks: one that failed makes the exit status 1, as an
    exception in the work owed does. Device work after it (``atexit`` hooks registered
    before xlatorch was imported) runs in the main thread only.

    A child forked after the runtime started (base/fork.py) owes nothing: the device's work
    is its parent's, and its copy of the runtime cannot be waited on.
    """
    if fork.FORKED[0] is not None:
        return
    try:
        for hook in EXIT_HOOKS:
            hook()
        LOCK.acquire()  # never released: the process ends holding it
        topology.close()
        EXECUTIONS.flush()  # ExecuteTime's thread is back waiting for a next execution
        if any(t is not threading.main_thread() and not t.name.startswith("xlatorch-") for t in threading.enumerate()):
            # A thread whose call into torch or jaxlib returned (an op's binding, a wait for
            # the step) waits for the GIL; given it, it goes on to wait for the device. Nothing
            # tells when all have: a grace period, once (a thread still in such a call when the
            # interpreter finalizes aborts the process as above, as CPU PyTorch's threads do).
            time.sleep(_GRACE_S)
        settle()  # a program whose last step failed a check does not end as if it had succeeded
    except BaseException as e:  # noqa: BLE001 - reported, then the exit status says so
        import traceback

        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


_GRACE_S = 0.05  # ten GIL switch intervals


atexit.register(_at_exit)
