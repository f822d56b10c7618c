"""``torch_xla.debug.metrics_compare_utils``: metrics reports as numbers, and a check of one
report against the history of earlier ones.

A report is the text of ``met.metrics_report()`` (xlatorch's or torch_xla's). Each metric gives
data points ``<name>__TotalSamples``, ``<name>__Accumulator<unit>`` and
``<name>__Percentile_<p><unit>``; each counter gives ``<name>__Value``. Durations are read in
seconds (unit ``_sec``; both torch_xla's ``01m29s615ms`` and xlatorch's ``451.358ms`` forms),
sizes in megabytes (``_mb``), plain numbers without a unit.
"""

from __future__ import annotations

import collections
import re

import numpy as np

__all__ = ["compare_metrics", "get_data_points_from_metrics_reports", "parse_metrics_report"]

_METRIC = re.compile(
    r"Metric: (?P<name>\S+)\s+TotalSamples: (?P<samples>\d+)\s+Accumulator: (?P<acc>\S+)"
    r"[^P]+Percentiles: (?P<pct>[^\n]*)"
)
_COUNTER = re.compile(r"Counter: (\S+)\s+Value: (\d+)")
_PERCENTILE = re.compile(r"(\d+)%=(\S+?)(?:;|$)")
_NUMBER = r"\d+(?:\.\d*)?|\.\d+"
# Longest unit first where one is another's prefix (ms before m, s).
_SECONDS = {"d": 86400.0, "h": 3600.0, "ms": 1e-3, "m": 60.0, "s": 1.0, "us": 1e-6, "ns": 1e-9}
_MEGABYTES = {"PB": 1e9, "TB": 1e6, "GB": 1e3, "MB": 1.0, "KB": 1e-3, "B": 1e-6}
_TIME_PART = re.compile(rf"({_NUMBER})(ms|us|ns|d|h|m|s)")
_SIZE_PART = re.compile(rf"({_NUMBER})(PB|TB|GB|MB|KB|B)", re.IGNORECASE)


def _sum_parts(text: str, part: re.Pattern, scale: dict) -> float | None:
    total, end = 0.0, 0
    for m in part.finditer(text):
        if m.start() != end:
            return None
        total += float(m.group(1)) * scale[m.group(2) if m.group(2) in scale else m.group(2).upper()]
        end = m.end()
    return total if end == len(text) and end else None


def _number(text: str) -> tuple[float, str]:
    """A report's value as (number, unit): ``''`` plain, ``'sec'`` a duration, ``'mb'`` a size."""
    try:
        return float(text), ""
    except ValueError:
        pass
    for part, scale, unit in ((_TIME_PART, _SECONDS, "sec"), (_SIZE_PART, _MEGABYTES, "mb")):
        value = _sum_parts(text, part, scale)
        if value is not None:
            return value, unit
    raise ValueError(f"Unknown metric_str format: {text}")


def parse_metrics_report(report: str, dehumanize: bool = True) -> dict:
    """The data points of one metrics report: ``{'CompileTime__Accumulator_sec': 0.45, ...}``.

    Args:
      report: the text of ``met.metrics_report()``.
      dehumanize: values as numbers (True) or as ``(number, text as reported)`` pairs.
    """
    points = {}
    for m in _METRIC.finditer(report):
        fields = [("TotalSamples", m["samples"]), ("Accumulator", m["acc"])]
        fields += [(f"Percentile_{p}", v) for p, v in _PERCENTILE.findall(m["pct"].strip())]
        for field, text in fields:
            value, unit = _number(text)
            key = f"{m['name']}__{field}{'_' + unit if unit else ''}"
            points[key] = value if dehumanize else (value, text)
    for name, value in _COUNTER.findall(report):
        points[f"{name}__Value"] = int(value)
    return points


def get_data_points_from_metrics_reports(metrics_reports: list[str]) -> dict:
    """Each data point's values over several reports, in their order (None where a report
    lacks it): ``{'InboundData__TotalSamples': [11, None, 12], ...}``."""
    points = collections.defaultdict(lambda: [None] * len(metrics_reports))
    for i, report in enumerate(metrics_reports):
        for key, value in parse_metrics_report(report).items():
            points[key][i] = value
    return points


def compare_metrics(data_points: dict, metrics_report: str, config: dict | None = None) -> str:
    """Check ``metrics_report`` against the mean and standard deviation of ``data_points``.

    Args:
      data_points: ``get_data_points_from_metrics_reports`` of earlier reports.
      metrics_report: the report to check.
      config: ``'base_expression'``, a Python expression over ``v`` (this report's value),
        ``v_mean`` and ``v_stddev`` (of the history) that must hold for every data point
        (default ``'v <= v_mean + (v_stddev * 2.0)'``), and ``'<key>_expression'`` entries
        overriding it for one data point. The expressions are evaluated as Python code.

    Returns:
      One line per data point whose expression is false, and one per ``aten::`` counter (an op
      run on CPU) the history never had; ``''`` when nothing differs.
    """
    config = config or {"base_expression": "v <= v_mean + (v_stddev * 2.0)"}
    stats = {}
    for key, values in data_points.items():
        values = [v for v in values if v is not None]
        if values and min(values) == max(values):
            stats[key] = (values[0], 0.0)  # exactly: a mean of equal floats may round off them
        elif values:
            stats[key] = (np.mean(values), np.std(values))
    lines = []
    for key, v in sorted(parse_metrics_report(metrics_report).items()):
        if key not in stats:
            if key.startswith("aten::"):
                lines.append(f"Found new aten counter: {key}: {v}\n")
            continue
        v_mean, v_stddev = stats[key]
        expression = config.get(f"{key}_expression") or config["base_expression"]
        if not eval(expression, {}, {"v": v, "v_mean": v_mean, "v_stddev": v_stddev}):  # noqa: S307 (the user's expression)
            lines.append(f"{key} failed its expression check. Expression: {expression}.  "
                         f"Mean: {v_mean}.  Stddev: {v_stddev}.  Actual Value: {v}\n")  # fmt: skip
    return "".join(lines)
