"""Around an executable's run: what a sync needs besides compiling and committing.

``uninterrupted`` holds the program's signal handlers while a step's donated buffers are
run and committed (an interrupt there would leave storages reading deleted buffers);
``EXECUTIONS`` measures ``ExecuteTime`` from each launch to its end, off the training thread.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from _signal import getsignal as _getsignal  # signal.getsignal's C function, without its enum conversion

from xlatorch.runtime.base import interrupts, record
from xlatorch.runtime.ir import values as ir

__all__ = ["EXECUTIONS", "uninterrupted"]


class _Executions:
    """``ExecuteTime``: from an execution's launch to its end. Executions run asynchronously
    (the launch returns at once on GPU/TPU), so one background thread waits for each in
    turn and records the sample; ``record.flush`` (before metrics are read) and ``wait``
    let it catch up."""

    def __init__(self):
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has no waiting thread

    def _reset(self) -> None:
        self.queue = None
        self.busy = 0
        self.cv = threading.Condition()

    def started(self, outs, t0: int, name: str = "ExecuteTime") -> None:
        # Already over (a small graph, on CPU, often is by its commit): measured here. Waking
        # the thread costs the training thread the GIL twice (on two cores, ~0.5 ms per step).
        # Not under dp.DataParallel, whose threads sync unlocked: another one could donate the
        # output meanwhile, and is_ready() of a deleted array crashes the process (jax 0.10).
        if not outs or (not ir._multi and not outs[-1].is_deleted() and outs[-1].is_ready()):
            record.add_sample(name, time.perf_counter_ns() - t0)
            return
        with self.cv:
            if self.queue is None:
                self.queue = queue.SimpleQueue()
                threading.Thread(target=self._wait_each, name="xlatorch-execute-time", daemon=True).start()
            self.busy += 1
        self.queue.put((outs, t0, name))

    def _wait_each(self) -> None:
        while True:
            outs, t0, name = self.queue.get()
            try:
                if outs:  # an execution's outputs are ready together: one says when it ended
                    outs[-1].block_until_ready()
            except Exception:  # donated to a later execution (so it had ended) or failed: it is over
                pass
            record.add_sample(name, time.perf_counter_ns() - t0)
            del outs
            with self.cv:
                self.busy -= 1
                self.cv.notify_all()

    def flush(self) -> None:
        with self.cv:
            while self.busy:
                self.cv.wait()


EXECUTIONS = _Executions()
record.FLUSH_HOOKS.append(EXECUTIONS.flush)


class uninterrupted:
    """``with uninterrupted():`` Python signal handlers (Ctrl-C's ``KeyboardInterrupt``, a
    ``SIGTERM`` handler) wait until the block has finished, then run.

    A sync donates the step's buffers to the executable: an exception between the
    execution and the commit would leave storages reading deleted buffers. Python runs
    signal handlers only in the main thread, so elsewhere this does nothing. Costs a few
    microseconds per sync when the program installed a handler of its own.
    """

    __slots__ = ("saved", "hits")

    _SIGNALS = (int(signal.SIGINT), int(signal.SIGTERM))

    def __enter__(self):
        self.saved = []
        self.hits = []
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self._SIGNALS:
            old = _getsignal(sig)  # 0.3 us, not signal.getsignal's 5: eager mode syncs once per op
            # A Python handler (SIG_DFL / SIG_IGN are ints); xlatorch's own SIGINT handler
            # already waits for the user's code (runtime/base/interrupts.py).
            if callable(old) and old is not interrupts.handler:
                self.saved.append((sig, old))
                signal.signal(sig, self._hold)
        return self

    def _hold(self, sig, frame):
        self.hits.append((sig, frame))

    def __exit__(self, *exc):
        for sig, old in self.saved:
            signal.signal(sig, old)
        for sig, frame in self.hits:  # deliver what arrived, now that the storages are consistent
            dict(self.saved)[sig](sig, frame)
