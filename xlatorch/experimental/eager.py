"""Eager mode (``torch_xla.experimental.eager_mode``): each op runs as soon as it is called.

A sync policy of the runtime (``runtime/execute/eager.py``): every op's outputs are computed
at once by a graph of that op alone, compiled once per signature and cached like any graph,
and launched asynchronously where the platform allows. ``torch_xla.compile`` regions
(``xlatorch.compile``) still trace lazily and run as one graph. Checks, CPU fallbacks, faults
and counters behave as in lazy mode; an op's compiles and executions are timed as
``EagerOpCompileTime`` and ``EagerOpExecuteTime`` (torch_xla's names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from xlatorch.runtime.execute import eager as _eager

__all__ = ["eager_mode", "is_eager_mode", "eager_mode_context"]


def eager_mode(enable: bool) -> None:
    """Turn eager mode on or off for the process (the default is off: lazy tracing).

    On: each op is compiled (once per signature) and run when it is called; only functions
    under ``torch_xla.compile`` are traced into graphs.
    """
    _eager.enable(enable)


def is_eager_mode() -> bool:
    """Whether eager mode is on."""
    return _eager.ON


@contextlib.contextmanager
def eager_mode_context(enable: bool) -> Iterator[bool]:
    """Eager mode on (or off) inside the block; the previous mode, which the block yields, after it."""
    saved = _eager.ON
    _eager.enable(enable)
    try:
        yield saved
    finally:
        _eager.enable(saved)
