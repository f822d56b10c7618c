"""A process forked after the device's runtime started cannot use the device.

JAX's runtime runs threads (XLA's executors, its transfer threads) and ``fork()`` copies only
the thread that called it: in the child the runtime waits for work nothing will ever do (an
execution in a forked DataLoader worker hung for good). CUDA refuses the same ("Cannot
re-initialize CUDA in forked subprocess"), and so does xlatorch, with what to do instead, at
each entry that reaches the runtime: an op on an xla tensor (runtime/device.py), a sync, an
upload, a download. A process forked before the runtime started (``import xlatorch`` and
``xm.xla_device()`` start nothing) starts its own, and may use the device.
"""

from __future__ import annotations

import os

from xlatorch.runtime.base import threads

__all__ = ["FORKED", "HOOKS", "check"]

# In a child forked after the runtime started: the parent's pid; else None.
FORKED: list = [None]
# Called in such a child, once, as it starts (runtime/device.py: ops on xla tensors refuse at once).
HOOKS: list = []


def _runtime_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # JAX moved it: assume started, the safe answer
        return True
    return bool(getattr(xla_bridge, "_backends", True))


def _after_fork_in_child() -> None:
    # The device lock may have been held by a thread of the parent (an MpDeviceLoader's loader
    # thread uploading): that thread does not exist here, and the lock would never be free.
    threads.LOCK._at_fork_reinit()
    if not _runtime_started():
        return
    FORKED[0] = os.getppid()
    _forget_the_runtime_at_exit()
    for hook in HOOKS:
        hook()


def _forget_the_runtime_at_exit() -> None:
    """Let this child exit without tearing down the parent's runtime: its client's destructor
    joins thread pools whose threads do not exist here, and the child hung or crashed (SIGSEGV)
    as it exited, whenever the client was collected before the process ended (seen on a busy
    machine: ``~PjRtClient`` in ``~ThreadPool`` from the exit's garbage collection). So the
    clients are kept alive for good (one reference nobody releases), and JAX's exit hooks, which
    clear its backends and wait for its runtime's tokens, are not run. Nothing in this child
    used the runtime, so nothing is left undone."""
    import atexit
    import ctypes

    try:
        from jax._src import api, dispatch, xla_bridge
    except ImportError:  # JAX moved them: its exit does what it did before
        return

    for client in list(getattr(xla_bridge, "_backends", {}).values()):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))
    for hook in (getattr(api, "clean_up", None), getattr(dispatch, "wait_for_tokens", None)):
        if hook is not None:
            atexit.unregister(hook)


os.register_at_fork(after_in_child=_after_fork_in_child)


def check(what: str) -> None:
    """Raise, naming ``what`` the program asked for, in a child forked after the runtime started."""
    parent = FORKED[0]
    if parent is not None:
        raise RuntimeError(
            f"xlatorch: {what} in a process forked (os.fork, multiprocessing's 'fork' start method) from "
            f"process {parent} after that process started the xla device: the device's runtime does not survive "
            f"fork() and would hang here. In a DataLoader worker, have the Dataset return CPU tensors and move "
            f"each batch to the device in the main process (pl.MpDeviceLoader(loader, device) does); to use the "
            f"device in other processes, start them with the 'spawn' method (xmp.spawn's default, "
            f"torch.multiprocessing.spawn, multiprocessing.get_context('spawn')), or fork before the first "
            f"device operation"
        )
