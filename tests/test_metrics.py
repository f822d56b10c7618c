"""Metrics and counters with torch_xla's names and report format."""

import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met


def _step(k=1.0):
    x = torch.ones(3, 3).to("xla")
    (x @ x + 1).sum().item()


def _unique_graph():
    # A shape no other test uses, so the first step compiles even with a warm cache.
    x = torch.ones(3, 7, 5).to("xla")
    return (x * 2).sum().item()


def test_report_names_and_format():
    _unique_graph()
    _unique_graph()
    rep = met.metrics_report()
    for name in ["CompileTime", "ExecuteTime", "TransferToDeviceTime", "TransferFromDeviceTime", "TensorsGraphSize"]:
        assert f"Metric: {name}\n  TotalSamples: " in rep
    assert "Counter: CachedCompile\n  Value: " in rep and "Counter: UncachedCompile\n  Value: " in rep
    assert "Counter: CreateXlaTensor" in rep and "Percentiles: 1%=" in rep
    assert met.counter_value("UncachedCompile") == 1 and met.counter_value("CachedCompile") == 1
    n, acc, samples = met.metric_data("CompileTime")
    assert n == 1 and acc > 0 and len(samples) == 1
    assert met.metric_data("ExecuteTime")[0] == 2
    assert "CompileTime" in met.metric_names() and "CachedCompile" in met.counter_names()
    short = met.short_metrics_report()
    assert "CompileTime" in short and "TensorsGraphSize" not in short


def test_clear():
    _step()
    met.clear_counters()
    assert met.counter_value("CreateXlaTensor") is None and met.metric_data("ExecuteTime") is not None
    met.clear_metrics()
    assert met.metric_data("ExecuteTime") is None


def test_metrics_file_appends_each_step(tmp_path, monkeypatch):
    path = tmp_path / "metrics.txt"
    monkeypatch.setenv("XLA_METRICS_FILE", str(path))
    for _ in range(3):
        x = torch.ones(2, device="xla") * 2
        xm.mark_step()
    text = path.read_text()
    assert text.count("[MetricsData; step=") == 3 and "Counter: MarkStep" in text
    assert x.cpu().tolist() == [2.0, 2.0]
