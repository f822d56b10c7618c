"""``torch_xla._XLAC``: the C extension's functions that
guides call directly, on xlatorch's Python runtime. Only these exist here; any other
name raises ``AttributeError``."""

from __future__ import annotations

from xlatorch.debug import dump
from xlatorch.debug import metrics as _met


def _xla_metrics_report() -> str:
    """The metrics report, as ``met.metrics_report()`` (no sync)."""
    return _met.metrics_report()


def _get_xla_tensors_text(tensors) -> str:
    """The IR of the pending graph behind ``tensors`` (``xd.ir_text``; no sync, no compile)."""
    return dump.ir_text(tensors)


def _get_xla_tensors_hlo(tensors) -> str:
    """The HLO text a sync of ``tensors`` would compile (``xd.hlo_text``; no sync)."""
    return dump.hlo_text(tensors, dialect="hlo")
