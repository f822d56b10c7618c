"""Debug tools: why a program recompiles, why it waits for the device, what its graphs are.

- ``compile_reasons()``: one ``CompileRecord`` per compile, naming what changed.
- ``sync_report()`` / ``sync_counts()``: graph cuts besides ``mark_step``, with causes and lines.
- ``graph_memory()``: the device memory each compiled graph needs (XLA's memory analysis).
- ``summary()``: both in a few lines (logged at exit at level >= 1).
- ``ir_text`` / ``hlo_text`` / ``dot_text``: dumps of pending tensors' graphs (no sync).
- ``set_level`` / ``get_level`` / ``level(n)``: the ``XLATORCH_DEBUG`` knob (levels in ``knob``).
- ``metrics``: counters and metrics (``met``).
- ``compare(fn, *args)``: the first op whose device result diverges from CPU's (``XLATORCH_COMPARE=1``: every step).
"""

from xlatorch.debug.compare import CompareReport, compare
from xlatorch.debug.dump import dot_text, hlo_text, ir_text
from xlatorch.debug.explain import (
    CompileRecord,
    GraphMemory,
    clear,
    compile_reasons,
    graph_memory,
    summary,
    sync_counts,
    sync_report,
)
from xlatorch.debug.knob import get_level, level, set_level

__all__ = ["CompileRecord", "GraphMemory", "graph_memory", "compile_reasons", "sync_report", "sync_counts", "summary",
           "clear", "ir_text", "hlo_text", "dot_text", "get_level", "set_level", "level", "compare",
           "CompareReport"]  # fmt: skip
