"""Step closures (``xm.add_step_closure``): code that reads a step's tensors after it ran.

A closure queued during a step runs at the step's end, after ``mark_step`` has run the
step's graph: the tensors it was given are device data by then, so reading them (``.item()``,
``print``) is a transfer, never another execution, however many closures a step queues.
Closures run in the order they were queued, each thread's at its own ``mark_step``.
Asynchronous ones (``run_async=True``) run on one background thread, in order, so the
training loop does not wait for them; an exception there is raised in the training thread
at its next ``add_step_closure`` or ``mark_step``. At exit the ones still queued run, before
the device closes; an exception there is the process's exit status.
"""

from __future__ import annotations

import queue
import threading

from xlatorch.runtime.execute import settle

__all__ = ["add", "run", "wait"]

_local = threading.local()
_async_queue: queue.Queue | None = None
_async_errors: list[BaseException] = []
_lock = threading.Lock()


def _pending() -> list:
    q = getattr(_local, "closures", None)
    if q is None:
        q = _local.closures = []
    return q


def add(closure, args=(), run_async: bool = False) -> None:
    """Queue ``closure(*args)`` to run at the end of this step, after its execution.

    Args:
      closure: the function to call.
      args: its arguments (tensors among them are materialised by the step).
      run_async: run it on a background thread (in order with the other asynchronous ones).
    """
    _raise_async_error()
    _pending().append((closure, tuple(args), run_async))


def run() -> None:
    """Run the closures queued by this thread (called by ``mark_step`` after the step ran)."""
    _raise_async_error()
    q = _pending()
    while q:
        closure, args, run_async = q.pop(0)
        if run_async:
            _async().put((closure, args))
        else:
            closure(*args)


def _async() -> queue.Queue:
    global _async_queue
    with _lock:
        if _async_queue is None:
            _async_queue = queue.Queue()
            threading.Thread(target=_worker, args=(_async_queue,), name="xlatorch-step-closures", daemon=True).start()
    return _async_queue


def _worker(q: queue.Queue) -> None:
    while True:
        closure, args = q.get()
        try:
            closure(*args)
        except BaseException as e:  # raised in the training thread at its next step
            _async_errors.append(e)
        finally:
            q.task_done()


def wait() -> None:
    """Block until every asynchronous closure queued so far has run."""
    if _async_queue is not None:
        _async_queue.join()
    _raise_async_error()


def _raise_async_error() -> None:
    if _async_errors:
        raise _async_errors.pop(0)


settle.EXIT_HOOKS.append(wait)  # the last steps' closures still run, and their errors are reported
