"""Eager mode: a sync policy that computes each op as soon as it is traced.

With eager mode on (``torch_xla.experimental.eager_mode(True)``), every ATen call the user's
code makes on device tensors ends with a sync of what it left pending (``sync.EAGER``): a graph
of that op alone (or of the ops its decomposition calls, which are not synced one by one),
keyed, cached and compiled like any other graph, so each op compiles once per signature and
later calls hit the cache. Launches are asynchronous where the platform runs them so (on CPU,
XLA runs a computation in the caller). Checks, fallbacks, faults and counters are those of any
sync; the compiles and executions are timed as torch_xla's ``EagerOpCompileTime`` and
``EagerOpExecuteTime``, and the debug tools do not report them as graph cuts.

Off (the default), nothing here runs: ``tensor.DISPATCH`` is the lazy dispatch itself, and the
factories test one module global. Turning it on puts ``_dispatch`` in that slot.
``torch_xla.compile`` regions turn it off while they trace, and a loop body (``trace/bodies.py``) is
traced lazily.
"""

from __future__ import annotations

import threading

from xlatorch.runtime.base.threads import BODIES
from xlatorch.runtime.base.topology import current_device, thread_replicas
from xlatorch.runtime.execute.sync import EAGER, sync
from xlatorch.runtime.trace import dispatch as _dispatch_module
from xlatorch.runtime.trace import tensor as _tensor_module
from xlatorch.runtime.trace.tensor import PENDING

__all__ = ["ON", "enable", "launch"]

ON = False  # read by every factory (runtime/device.py)
_lazy = _dispatch_module.dispatch
_tls = threading.local()  # ``depth``: inside an op being dispatched (its decomposition's ops are part of it)


def enable(on: bool) -> None:
    """Turn eager mode on or off for the whole process (as torch_xla's flag is)."""
    global ON
    ON = bool(on)
    _tensor_module.DISPATCH = _dispatch if ON else _lazy


def _dispatch(func, args, kwargs):
    """The lazy dispatch, then a sync of what the op left pending."""
    tls = _tls
    if getattr(tls, "depth", 0):
        return _lazy(func, args, kwargs)
    tls.depth = 1
    try:
        out = _lazy(func, args, kwargs)
    finally:
        tls.depth = 0
    if PENDING and not BODIES:  # a loop body being traced stays lazy (it runs inside its loop)
        _sync()
    return out


def _sync() -> None:
    # Under dp.DataParallel each thread computes its own device's values (as its mark_step does).
    sync(EAGER, current_device() if thread_replicas() else None)


def launch() -> None:
    """After a factory made a tensor outside dispatch: compute it now (eager mode only)."""
    if PENDING and not BODIES and not getattr(_tls, "depth", 0):
        _sync()
