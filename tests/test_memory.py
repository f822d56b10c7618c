"""Memory by graph: each compiled graph's memory (metrics, explainer, profiler, ``graph_memory``),
``get_memory_info``'s resettable peak, and out-of-memory errors that name the graph, what it
needs against what is free, and the lines that made its largest buffers."""

from __future__ import annotations

import collections
import gc
import gzip
import inspect
import json
import os
import re
import types

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug as xd
import xlatorch.debug.metrics as met
import xlatorch.debug.profiler as xp
from xlatorch.runtime.base import memory
from xlatorch.runtime.ir import ops
from xlatorch.runtime.ir.failed import FailedValueError
from xlatorch.runtime.lower import executable

HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def _level_0(debug_level_0):
    # Level 0 and no source flags, so each test sets what it checks (conftest.debug_level_0).
    yield


def _next_line() -> int:
    return inspect.currentframe().f_back.f_lineno + 1


def _matmul_graph(n):
    """One graph: an (n, n) @ (n, n) product plus a sum; returns the result tensors."""
    a = torch.randn(n, n).to("xla")
    b = torch.randn(n, n).to("xla")
    c = a @ b
    s = (c * 2).sum()
    xm.mark_step()
    return c, s


def test_every_compile_records_its_memory():
    _matmul_graph(129)  # a size no other test uses: compiles
    rec = xd.compile_reasons()[-1]
    mem = rec.memory
    assert mem is not None and set(mem) == {"argument", "output", "alias", "temp", "generated_code"}
    assert mem["argument"] >= 2 * 129 * 129 * 4 and mem["output"] >= 129 * 129 * 4 + 4
    g = xd.graph_memory()[-1]
    assert g.graph == rec.graph > 0 and g.step == rec.step and g.sync == "mark_step"
    assert (g.argument, g.output, g.alias, g.temp, g.generated_code) == tuple(mem.values())
    assert g.new == g.output - g.alias + g.temp and g.peak == g.argument + g.new
    assert re.match(rf"graph {g.graph} \(step \d+, mark_step at \S*{HERE}:\d+\): peak [\d.]+ KiB = arguments", str(g))


def test_metrics_have_one_memory_sample_per_compile():
    met.clear_all()
    _matmul_graph(131)
    _matmul_graph(131)  # cached: no new sample
    count, total, samples = met.metric_data("CompiledGraphMemory")
    assert count == 1 and total == xd.graph_memory()[-1].peak
    for name in ("CompiledGraphArgumentBytes", "CompiledGraphOutputBytes", "CompiledGraphTempBytes"):
        assert met.metric_data(name)[0] == 1
    report = met.metrics_report()
    assert re.search(r"Metric: CompiledGraphMemory\n  TotalSamples: 1\n  Accumulator: [\d.]+KB", report)
    assert "Metric: CompileTime" in report  # torch_xla's names as before


def test_explainer_logs_memory_at_level_2(capsys):
    with xd.level(2):
        _matmul_graph(133)
    err = capsys.readouterr().err
    assert re.search(r"memory: arguments [\d.]+ KiB, outputs .* temporaries .* generated code", err)


def test_profiler_spans_carry_the_graph_memory(tmp_path):
    with xp.trace(tmp_path) as cap:
        _matmul_graph(137)
    g = xd.graph_memory()[-1]
    with gzip.open(os.path.join(cap.path, "perfetto_trace.json.gz")) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    by = collections.defaultdict(list)
    for e in events:
        by[e["name"]].append(e.get("args", {}))
    for span in ("xlatorch.compile", "xlatorch.execute"):
        args = by[span][-1]
        assert int(args["graph"]) == g.graph, span
        assert int(args["argument_bytes"]) == g.argument and int(args["new_bytes"]) == g.new, span


def test_peak_counts_a_graph_temporaries_and_resets():
    gc.collect()
    xm.mark_step()
    xm.reset_peak_memory_stats(xm.xla_device())
    base = xm.get_memory_info()
    assert base["peak_bytes_used"] == base["bytes_used"]
    # A 16 MiB temporary that never outlives the graph (a matmul's operand): only the
    # per-execution tracking sees it.
    x = torch.ones(1024, device="xla")
    xm.mark_step()
    s = ((x[:, None] * torch.ones(4096, device="xla")).exp() @ torch.ones(4096, 1, device="xla")).sum()
    xm.mark_step()
    s.item()
    g = xd.graph_memory()[-1]
    assert g.temp >= 16 * 2**20
    info = xm.get_memory_info()
    assert info["bytes_used"] < base["bytes_used"] + 2**20
    assert info["peak_bytes_used"] >= g.new + 4096  # the new buffers besides x's data
    assert g.argument == 4096
    xm.reset_peak_memory_stats("xla:0")
    again = xm.get_memory_info()
    assert again["peak_bytes_used"] == again["bytes_used"] < info["peak_bytes_used"]
    with pytest.raises(ValueError, match="reset_peak_memory_stats needs an xla device"):
        xm.reset_peak_memory_stats(torch.device("cpu"))


def test_live_counter_follows_device_data():
    gc.collect()
    before = memory.LIVE.get(0, 0)
    t = torch.zeros(1000, device="xla")
    xm.mark_step()
    assert memory.LIVE[0] - before >= 4000
    del t
    gc.collect()
    xm.mark_step()
    assert memory.LIVE[0] - before < 4000


def test_large_outputs_record_their_line_at_level_0():
    t = torch.zeros(10, device="xla")
    small = t + 1
    big = torch.ones(4096, 4096, device="xla")  # 64 MiB: its node records the line
    from xlatorch.runtime.trace.tensor import value_of

    assert getattr(value_of(small).node, "src", None) is None
    assert value_of(big).node.src[1] == inspect.currentframe().f_lineno - 4
    assert ops.Info((((4096, 1024), torch.float32),), None).big
    assert not ops.Info((((4096, 1023), torch.float32),), None).big


def test_oom_names_graph_need_free_and_the_line_of_the_largest_buffer():
    w0 = torch.randn(4, 3)
    w = w0.to("xla")
    q = torch.ones(3, device="xla")
    xm.mark_step()
    w.mul_(2)
    line = _next_line()
    huge = torch.ones(200_000, 200_000, device="xla") * 2  # 160 GB: the check before the run fires
    q.add_(huge.sum())  # in the part that cannot run
    cut = _next_line() + 1
    with pytest.raises(torch.OutOfMemoryError) as e:
        xm.mark_step()
    msg = str(e.value)
    assert msg.startswith("RESOURCE_EXHAUSTED: graph ")
    assert re.search(rf"cut by mark_step at \S*{HERE}:{cut}\) needs 149\.01 GiB of new buffers on xla:0, "
                     r"and [\d.]+ [GMK]iB is free", msg)  # fmt: skip
    assert "needs: 149.01 GiB new = outputs 149.01 GiB" in msg
    largest = msg.split("largest buffers:\n")[1].splitlines()[0]
    assert re.fullmatch(rf"\s+149\.01 GiB  float32\[200000, 200000\] from aten::\w+(\.\w+)? at \S*{HERE}:{line}",
                        largest), largest  # fmt: skip
    # The step before survives; the part that could run did.
    torch.testing.assert_close(q.cpu(), torch.ones(3))
    torch.testing.assert_close(w.cpu(), w0 * 2)
    with pytest.raises(FailedValueError, match="RESOURCE_EXHAUSTED"):
        huge.cpu()
    assert xm.get_memory_info()["peak_bytes_used"] < 2**30  # the graph that did not run is not counted


def test_xla_resource_exhausted_becomes_the_same_report():
    """XLA's own error (at compile or run) is hard to raise on CPU: the conversion, with a fake one."""
    _matmul_graph(139)
    exe = executable.NEWEST[1]
    a = torch.ones(4096, 4096, device="xla") * 3  # 64 MiB, its line recorded
    from xlatorch.runtime.trace.tensor import value_of

    nodes = [value_of(a).node]
    err = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 67108864 bytes.")
    oom = executable.out_of_memory(err, exe, 0, nodes, "mark_step")
    assert isinstance(oom, torch.OutOfMemoryError) and oom.__cause__ is err
    msg = str(oom)
    assert msg.splitlines()[0] == str(err)
    assert f"graph {exe.gid} (step " in msg and "ran out of memory on xla:0" in msg and "needs: " in msg
    assert re.search(rf"64\.00 MiB  float32\[4096, 4096\] from aten::mul\.Tensor at \S*{HERE}:\d+", msg)
    other = ValueError("something else")
    assert executable.out_of_memory(other, exe, 0, nodes, "mark_step") is other
    assert "a graph (step" in str(executable.out_of_memory(err, None, 0, nodes, "mark_step"))
    xm.mark_step()


def test_a_synced_graph_and_its_device_arrays_are_freed_without_the_cycle_collector():
    # After a sync gives every pending tensor its data, the step's nodes must go as soon as the
    # last tensor lets go: left in cycles (a node and its outputs), they waited for a full
    # collection, holding their device arrays, and each full collection stalled the host.
    from xlatorch.runtime.ir.values import Node

    def nodes() -> int:
        return sum(type(o) is Node for o in gc.get_objects())

    dev = xm.xla_device()
    x = torch.randn(64, 64).to(dev)
    xm.mark_step()
    gc.collect()
    gc.disable()
    try:
        before = nodes()
        live = memory.LIVE.get(0, 0)
        y = x
        for _ in range(50):
            y = torch.tanh(y @ x) * 0.5 + 1
        z = y.sum()
        assert nodes() >= before + 200  # the traced step: its nodes are alive
        xm.mark_step()
        got = z.item()
        del y, z
        assert nodes() <= before
        assert memory.LIVE.get(0, 0) <= live  # the step's device arrays went with its nodes
    finally:
        gc.enable()
    want = x.cpu()
    for _ in range(50):
        want = torch.tanh(want @ x.cpu()) * 0.5 + 1
    assert got == pytest.approx(want.sum().item(), rel=1e-4)  # values in [0.5, 1.5]: float32 rounding


def test_dropped_values_views_kept_across_syncs_and_host_stages_leave_no_cycles():
    # Three ways a graph outlived its tensors in cycles (a node and its outputs, or a function
    # and its own cell), each until a collection: a value the program drops before any sync
    # reads it (its node keeps what it read linked), a view of device data whose cached value
    # a sync computed (still valid after it), and a graph read on the host (its converter
    # referred to itself). A generation loop does all three every token.
    from xlatorch.runtime.ir.values import Node

    def cycles() -> tuple[int, int]:
        # Only functions are asked their name: ``getattr`` on any object runs the ``__getattr__``
        # of whatever an earlier test left alive: an FX ``Proxy`` records a graph node per read
        # (under another test order this count ran for minutes), a lazy module may raise.
        objs = gc.get_objects()
        return (sum(type(o) is Node for o in objs),
                sum(type(o) is types.FunctionType and o.__qualname__ == "on_host.<locals>.value"
                    for o in objs))  # fmt: skip

    dev = xm.xla_device()
    w = torch.randn(4, 4).to(dev)
    pos = torch.arange(4, device=dev)
    xm.mark_step()
    gc.collect()
    gc.disable()
    try:
        before = cycles()
        got = []
        for _ in range(3):
            last = pos[-1:]  # a view of device data, read again after the sync
            unused = (w * 2).clone()  # dropped before anything reads it
            del unused
            y = (w @ w).sum() * last.float().sum()
            got.append((y.item(), bool((pos > 0).any().item())))  # the second: a graph read on the host
            got.append(int(last.sum().item()))
            pos = torch.cat([pos, last + 1])
            xm.mark_step()
        del last, y
        assert cycles() == before
    finally:
        gc.enable()
    want, p = [], torch.arange(4)
    for _ in range(3):
        want.append(((w.cpu() @ w.cpu()).sum().item() * p[-1:].float().sum().item(), bool((p > 0).any())))
        want.append(int(p[-1]))
        p = torch.cat([p, p[-1:] + 1])
    assert [g[1] for g in got[::2]] == [x[1] for x in want[::2]] and got[1::2] == want[1::2]
    for g, x in zip(got[::2], want[::2]):
        assert g[0] == pytest.approx(x[0], rel=1e-5, abs=1e-5)
    assert torch.equal(pos.cpu(), p)
