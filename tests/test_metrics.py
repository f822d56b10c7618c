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


def test_torch_xla_vocabulary():
    met.clear_all()
    x = torch.ones(3, 11, 2).to("xla")  # one upload
    y = torch.ones(2, 3).to("xla")
    assert met.counter_value("TensorToData") == 2
    z = (x @ y).relu()  # recorded for the device, per op, as torch_xla's xla::<op>
    z = z @ y.t()
    assert met.counter_value("xla::matmul") is None  # counted as the ATen ops that reach the device
    assert met.counter_value("xla::bmm") or met.counter_value("xla::mm") or met.counter_value("xla::expand")
    assert met.counter_value("xla::relu") == 1
    z.sum().item()
    assert met.counter_value("CreateCompileHandles") == met.counter_value("UncachedCompile") == 1
    n, _, _ = met.metric_data("InputOutputAliasCount")
    assert n == 1
    assert met.executed_fallback_ops() == []
    short = met.short_metrics_report(counter_names=["TensorToData"], metric_names=["ExecuteTime"])
    assert "Counter: TensorToData" in short and "Metric: ExecuteTime" in short and "CompileTime" not in short


def test_execute_time_covers_the_execution_not_its_launch():
    import time

    a = torch.randn(1024, 1024).to("xla")
    xm.mark_step(wait=True)
    met.clear_metrics()
    for _ in range(12):
        a = torch.tanh(a @ a) * 0.5
    xm.mark_step()  # compiles (not timed below) ...
    xm.mark_step(wait=True)
    met.clear_metrics()
    t0 = time.perf_counter_ns()
    for _ in range(12):
        a = torch.tanh(a @ a) * 0.5
    xm.mark_step(wait=True)  # ... and runs once more, timed from outside
    wall = time.perf_counter_ns() - t0
    n, execute, _ = met.metric_data("ExecuteTime")
    assert n == 1
    # 12 products of 1024x1024 matrices take far longer than launching them: ExecuteTime
    # is most of the step's wall time, not the launch's few microseconds.
    assert execute > 0.5 * wall, (execute, wall)
