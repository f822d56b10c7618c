"""The debug knob: one level, from the environment or set at run time.

Levels (each includes the ones below):

- **0** (default): nothing is logged; tracing pays one flag check per node. Compile reasons and
  graph cuts are still recorded (they are rare and each already costs far more than
  recording it): ``compile_reasons()`` and ``sync_report()`` work, without op source lines.
- **1**: every IR node records the user's source line (a few microseconds per op);
  each compile logs its reason ("Compilation Analysis") and each graph cut that
  ``mark_step`` did not ask for logs its cause and line ("Execution Analysis"); at exit,
  a summary of both ("Run summary").
- **2**: also each compile's buffer sizes, and at each ``mark_step`` the step's table of
  graph cuts (when it had any besides the step's own).
- **3**: also the IR of every compiled graph.

Environment (read at import): ``XLATORCH_DEBUG=0..3``; torch_xla's ``PT_XLA_DEBUG=1``
is an alias for level 1 (``PT_XLA_DEBUG_LEVEL=n`` chooses the level, as in torch_xla).
``XLA_IR_DEBUG=1`` records source lines at any level; ``XLA_HLO_DEBUG=1`` additionally
names each lowered op ``aten::<op>(file.py:12)`` in the HLO metadata (``op_name``).
Output goes to the ``logging`` logger ``"xlatorch"``; at level >= 1 it writes to stderr
unless the program configured handlers of its own.
"""

from __future__ import annotations

import logging
import sys

from xlatorch.runtime.base import config, record

__all__ = ["get_level", "set_level", "level", "LOG", "source_lines", "hlo_debug", "sources"]

LOG = logging.getLogger("xlatorch")


def _env_level() -> int:
    level = config.env("XLATORCH_DEBUG")
    if level is not None:
        return level
    return config.env("PT_XLA_DEBUG_LEVEL") if config.env("PT_XLA_DEBUG") else 0


LEVEL = _env_level()
_IR_DEBUG = config.env("XLA_IR_DEBUG")
_HLO_DEBUG = config.env("XLA_HLO_DEBUG")


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (pytest's capture swaps it)."""

    def emit(self, record):
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


_handler: _Stderr | None = None


def source_lines() -> bool:
    """Whether new IR nodes should record the user's source line (``ir.DEBUG_SOURCE``)."""
    return LEVEL >= 1 or _IR_DEBUG or _HLO_DEBUG


def _configure() -> None:
    """Point the runtime's recording flags and the logger at the current level."""
    global _handler
    record.SOURCE_LINES = source_lines()
    record.HLO_DEBUG = _HLO_DEBUG
    ir = sys.modules.get("xlatorch.runtime.ir.values")
    if ir is not None:  # else ir reads record.SOURCE_LINES when it is imported
        ir.DEBUG_SOURCE = record.SOURCE_LINES
    if LEVEL >= 1:
        LOG.setLevel(logging.INFO)
        if _handler is None and not LOG.handlers:
            _handler = _Stderr()
            _handler.setFormatter(logging.Formatter("xlatorch: %(message)s"))
            LOG.addHandler(_handler)
            LOG.propagate = False


_configure()


def get_level() -> int:
    """The current debug level (0..3)."""
    return LEVEL


def set_level(n: int) -> None:
    """Set the debug level (0..3) from now on; see this module's docstring for each level."""
    global LEVEL
    LEVEL = int(n)
    _configure()


def hlo_debug() -> bool:
    """True when lowered ops carry ``aten::<op>(file.py:12)`` in their HLO metadata (``XLA_HLO_DEBUG``)."""
    return record.HLO_DEBUG


class level:
    """``with xlatorch.debug.level(2): ...`` runs the block at debug level 2, then restores
    the previous level."""

    def __init__(self, n: int):
        self.n = int(n)
        self.prev = LEVEL

    def __enter__(self):
        self.prev = LEVEL
        set_level(self.n)
        return self

    def __exit__(self, *exc):
        set_level(self.prev)


class sources:
    """``with sources(): ...``: IR nodes record the user's source line in the block (as
    ``XLA_IR_DEBUG=1``), whatever the level; nothing more is logged."""

    def __enter__(self):
        global _IR_DEBUG
        self.prev = _IR_DEBUG
        _IR_DEBUG = True
        _configure()
        return self

    def __exit__(self, *exc):
        global _IR_DEBUG
        _IR_DEBUG = self.prev
        _configure()
