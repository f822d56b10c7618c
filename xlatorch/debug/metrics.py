"""Counters and metrics with torch_xla's names and report format.

Counters are plain integers (``CachedCompile``, ``MarkStep``, ``aten::nonzero`` ...).
Metrics are lists of samples: times in nanoseconds (``CompileTime``, ``ExecuteTime``,
``TransferToDeviceTime`` ...), sizes in bytes, or plain numbers (``TensorsGraphSize``). The
runtime records both in ``xlatorch.runtime.base.record``; this module reports them.

Each compile adds one sample, in bytes, from XLA's memory analysis of the graph (names of
xlatorch's own; torch_xla has none): ``CompiledGraphMemory`` (what one run holds at most:
arguments + outputs not aliased to donated inputs + temporaries), ``CompiledGraphArgumentBytes``,
``CompiledGraphOutputBytes``, ``CompiledGraphAliasBytes``, ``CompiledGraphTempBytes`` and
``CompiledGraphCodeBytes``; ``xlatorch.debug.graph_memory()`` lists them per graph.
"""

from __future__ import annotations

import time

from xlatorch.runtime.base import config, record
from xlatorch.runtime.base.record import COUNTERS, add_sample, timed
from xlatorch.runtime.base.record import METRICS as _METRICS

__all__ = ["COUNTERS", "add_sample", "timed", "counter_names", "counter_value", "metric_names", "metric_data",
           "clear_counters", "clear_metrics", "clear_all", "executed_fallback_ops", "metrics_report",
           "short_metrics_report", "write_step_metrics"]  # fmt: skip

_TIME_METRICS = {
    "CompileTime",
    "ExecuteTime",
    "TransferToDeviceTime",
    "TransferFromDeviceTime",
    "LazyTracing",
}
_BYTE_METRICS = {"CompiledGraphMemory", "CompiledGraphArgumentBytes", "CompiledGraphOutputBytes",
                 "CompiledGraphAliasBytes", "CompiledGraphTempBytes", "CompiledGraphCodeBytes"}  # fmt: skip
_START = time.time()


def counter_names() -> list[str]:
    """Names of the counters that are non-zero."""
    return [k for k, v in COUNTERS.items() if v]


def counter_value(name: str) -> int | None:
    """The value of counter ``name``, or None if it never counted."""
    v = COUNTERS.get(name)
    return v if v else None


def metric_names() -> list[str]:
    """Names of the metrics that have samples."""
    record.flush()
    return [k for k, v in _METRICS.items() if v]


def metric_data(name: str):
    """``(total_samples, accumulator, [(timestamp, value), ...])`` as torch_xla returns, or None."""
    record.flush()
    samples = _METRICS.get(name)
    if not samples:
        return None
    return len(samples), sum(samples), [(0.0, v) for v in samples[-1000:]]


def clear_counters() -> None:
    COUNTERS.clear()


def clear_metrics() -> None:
    record.flush()
    _METRICS.clear()


def clear_all() -> None:
    clear_counters()
    clear_metrics()


def executed_fallback_ops() -> list[str]:
    """The ``aten::`` ops that ran on CPU because they have no lowering."""
    return [k for k, v in COUNTERS.items() if v and k.startswith("aten::")]


def _fmt_time(ns: float) -> str:
    parts, rest = [], ns
    for unit, size in (("d", 86400e9), ("h", 3600e9), ("m", 60e9), ("s", 1e9)):
        if rest >= size:
            parts.append(f"{int(rest // size)}{unit}")
            rest %= size
    parts.append(f"{rest / 1e6:.3f}ms")
    return "".join(parts) if len(parts) < 3 else "".join(parts[:-1])


def _fmt_bytes(n: float) -> str:
    """torch_xla's byte format: ``12.00KB``."""
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.2f}B"


def _fmt_number(v: float) -> str:
    return f"{v:.2f}" if v != int(v) else str(int(v))


def _metric_text(name: str, samples: list[float]) -> str:
    if name in _TIME_METRICS:
        fmt = _fmt_time
    elif name in _BYTE_METRICS:
        fmt = _fmt_bytes
    else:
        fmt = _fmt_number
    srt = sorted(samples)
    elapsed = max(time.time() - _START, 1e-9)
    pct = "; ".join(
        f"{p}%={fmt(srt[min(len(srt) - 1, int(len(srt) * p / 100))])}" for p in (1, 5, 10, 20, 50, 80, 90, 95, 99)
    )
    total = sum(samples)
    rate = f"{total / elapsed:.3f}" if name not in _TIME_METRICS else f"{total / 1e9 / elapsed:.6f}"
    return (
        f"Metric: {name}\n  TotalSamples: {len(samples)}\n  Accumulator: {fmt(total)}\n"
        f"  ValueRate: {rate} / second\n  Rate: {len(samples) / elapsed:.6f} / second\n  Percentiles: {pct}\n"
    )


def metrics_report() -> str:
    """Every metric and counter in torch_xla's text format."""
    record.flush()
    out = [_metric_text(k, v) for k, v in _METRICS.items() if v]
    out += [f"Counter: {k}\n  Value: {v}\n" for k, v in COUNTERS.items() if v]
    return "".join(out)


def short_metrics_report(counter_names: list[str] | None = None, metric_names: list[str] | None = None) -> str:
    """The metrics and counters that matter most: compiles, executions, transfers, fallbacks."""
    record.flush()
    metric_names = metric_names or ["CompileTime", "ExecuteTime", "TransferFromDeviceTime", "TransferToDeviceTime"]
    counter_names = counter_names or ["CachedCompile", "MarkStep"]
    out = [_metric_text(k, _METRICS[k]) for k in metric_names if _METRICS.get(k)]
    names = list(counter_names) + [k for k in executed_fallback_ops() if k not in counter_names]
    out += [f"Counter: {k}\n  Value: {COUNTERS[k]}\n" for k in names if COUNTERS.get(k)]
    return "".join(out)


def write_step_metrics() -> None:
    """Append the report to ``$XLA_METRICS_FILE`` (called at each step when it is set)."""
    path = config.env("XLA_METRICS_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"[MetricsData; step={COUNTERS['MarkStep']}]\n{metrics_report()}\n")


record.STEP_HOOKS.append(write_step_metrics)
