"""What the runtime records, for whoever reads it: counters, metric samples, graph-cut causes,
and hooks that the debug tools (``xlatorch/debug``) register.

The bottom of the package: this module imports nothing of xlatorch. The runtime writes here
(``COUNTERS["CachedCompile"] += 1``, ``with TIMED("ExecuteTime"):``, ``with cause("print"):``)
and calls the hook lists at compiles, syncs, steps and device start-up; ``xlatorch.debug``
reads the records and fills the hooks to build the metrics report, the compile explainer,
the sync report, dumps and profiler spans. An empty hook list costs one truth test.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

__all__ = [
    "COUNTERS", "METRICS", "add_sample", "timed", "TIMED", "PHASE", "cause", "current_cause",
    "SYNC_HOOKS", "COMPILE_HOOKS", "PRE_STEP_HOOKS", "STEP_HOOKS", "DEVICE_HOOKS", "SOURCE_LINES", "HLO_DEBUG",
    "GRAPH_DIFF",
]  # fmt: skip

COUNTERS: defaultdict[str, int] = defaultdict(int)  # CachedCompile, MarkStep, aten::<op> ...
METRICS: dict[str, list[float]] = {}  # samples: times in ns (CompileTime ...) or numbers


# Called before metrics are read: samples measured off the calling thread (``ExecuteTime``,
# taken when an execution ends) are all in once they return.
FLUSH_HOOKS: list = []


def flush() -> None:
    """Wait for the samples still being measured (see ``FLUSH_HOOKS``)."""
    for hook in FLUSH_HOOKS:
        hook()


def add_sample(name: str, value: float) -> None:
    """Record one sample of metric ``name``."""
    METRICS.setdefault(name, []).append(value)


class timed:
    """Context manager adding the elapsed nanoseconds as a sample of a time metric."""

    __slots__ = ("name", "t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        add_sample(self.name, time.perf_counter_ns() - self.t0)


# The runtime times its phases with ``TIMED(metric)``; while a profiler capture may run, the
# profiler swaps in a subclass that is also a span, and sets ``PHASE`` (a context-manager
# factory ``PHASE(name, **args)``) for the sync and step spans. None: no spans.
TIMED = timed
PHASE = None

# Hooks, each a list of callables (the debug tools append; a hook must not raise):
SYNC_HOOKS: list = []  # (reason, graph_nodes) at every sync that executes a graph
COMPILE_HOOKS: list = []  # (CompileRequest, executable, compile_ns) at every compile (runtime/lower/executable.py)
PRE_STEP_HOOKS: list = []  # () at every mark_step, before its sync (XLATORCH_COMPARE)
STEP_HOOKS: list = []  # () after every mark_step
DEVICE_HOOKS: list = []  # () once, when the runtime first uses the device
# Filled by xlatorch.debug.explain (one object): ``summary(key, nodes)`` says what a graph is
# without holding its tensors; ``difference(summary, summaries)`` names, one line each, how it
# differs from the closest of ``summaries`` (``torch_xla.compile``'s ``max_different_graphs``).
GRAPH_DIFF: list = []

# Set by xlatorch.debug.knob: IR nodes record the user's source line (``XLA_IR_DEBUG``, debug
# level >= 1); lowered ops carry ``aten::<op>(file.py:12)`` in their HLO metadata (``XLA_HLO_DEBUG``).
SOURCE_LINES = False
HLO_DEBUG = False

_tls = threading.local()


class cause:
    """``with cause("CPU fallback aten::foo"):`` names the graph cuts made inside the block
    (the outermost ``cause`` wins: a ``print`` inside a fallback reports the fallback)."""

    __slots__ = ("text", "prev")

    def __init__(self, text: str):
        self.text = text

    def __enter__(self):
        self.prev = getattr(_tls, "cause", None)
        if self.prev is None:
            _tls.cause = self.text
        return self

    def __exit__(self, *exc):
        _tls.cause = self.prev


def current_cause() -> str | None:
    """What this thread's outermost enclosing ``cause`` names, or None."""
    return getattr(_tls, "cause", None)
