"""torch_xla names added for issue 29 §4: behaviour, not just existence."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch import backends
from xlatorch import runtime as xr
from xlatorch.compat import xlac
from xlatorch.debug import dump
from xlatorch.utils import utils as xu
from xlatorch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rate_tracker_counts_items_per_second():
    r = xm.RateTracker(smooth_factor=0.0)
    r.add(50)
    time.sleep(0.1)
    rate = r.rate()
    assert 200 < rate <= 500
    assert 200 < r.global_rate() <= 500


def test_get_stablehlo_and_bytecode_describe_the_pending_graph():
    a = torch.randn(3, 3, device=xm.xla_device())
    b = a @ a
    text = xm.get_stablehlo([b])
    assert "stablehlo.dot_general" in text and "module" in text
    code = xm.get_stablehlo_bytecode([b])
    assert isinstance(code, bytes) and code.startswith(b"ML\xefR")
    assert torch.allclose(b.cpu(), a.cpu() @ a.cpu(), atol=1e-5)


def test_send_cpu_data_to_device_keeps_the_structure():
    out = xm.send_cpu_data_to_device({"x": [torch.ones(2)], "n": 3}, xm.xla_device())
    assert out["n"] == 3 and out["x"][0].device.type == "xla"
    assert out["x"][0].cpu().tolist() == [1.0, 1.0]


def test_check_view_sharing_and_unlazy():
    a = torch.randn(4, 4, device=xm.xla_device())
    with pytest.raises(RuntimeError, match="share storage"):
        xm.check_view_sharing([a, a[0]])
    b = a + 1
    xm.check_view_sharing({"a": a, "b": b})
    xm.unlazy([b])
    assert xlac._check_tensor_need_materialization([b]) == [False]


def test_optimization_barrier_is_in_the_graph_and_keeps_values():
    a = torch.randn(4, device=xm.xla_device())
    b = a * 2
    xm.optimization_barrier_([b])
    assert "optimization_barrier" in dump.hlo_text([b + 1])
    assert torch.allclose((b + 1).cpu(), a.cpu() * 2 + 1)


def test_mat_mul_precision_changes_the_dot_precision():
    before = backends.get_mat_mul_precision()
    a = torch.randn(64, 64, device=xm.xla_device())
    try:
        backends.set_mat_mul_precision("highest")
        assert backends.get_mat_mul_precision() == "highest"
        assert "HIGHEST" in dump.hlo_text([a @ a])
        assert torch.allclose((a @ a).cpu(), a.cpu() @ a.cpu(), rtol=1e-5, atol=1e-5)
        backends.set_mat_mul_precision("default")
        assert "HIGHEST" not in dump.hlo_text([a @ a])
        with pytest.raises(ValueError):
            backends.set_mat_mul_precision("fast")
    finally:
        backends.set_mat_mul_precision(before)


def test_num_cached_compilation_graph_counts_compiled_graphs():
    n = xr.get_num_cached_compilation_graph()
    a = torch.randn(5, 7, device=xm.xla_device())
    (a.sin() * 3.25 - a.cos()).cpu()
    assert xr.get_num_cached_compilation_graph() >= min(n + 1, 1)


def test_device_counts_and_attributes():
    assert xr.global_device_count() >= 1 and xr.process_count() == 1 and xr.host_index() == 0
    attrs = xr.global_runtime_device_attributes()
    assert len(attrs) == xr.global_device_count() and "device_kind" in attrs[0]
    assert xm.xla_real_devices()[0].endswith(":0")


@pytest.mark.parametrize("readonly", [False, True])
def test_initialize_cache_writes_to_the_path_unless_readonly(tmp_path, readonly):
    code = (f"import torch, xlatorch.core.xla_model as xm, xlatorch.runtime as xr\n"
            f"xr.initialize_cache({str(tmp_path)!r}, readonly={readonly})\n"
            "a = torch.ones(3, device=xm.xla_device()); print((a * 2 + 1).cpu().tolist())\n"
            "try:\n    xr.initialize_cache('/nonexistent/x')\nexcept RuntimeError:\n    print('late')\n")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[3.0, 3.0, 3.0]" in out.stdout and "late" in out.stdout
    assert bool(os.listdir(tmp_path)) is not readonly


def test_checkpoint_recomputes_and_matches_plain_backward():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Tanh()).to(xm.xla_device())
    x = torch.randn(4, 8)
    grads = []
    for use in (False, True):
        m.zero_grad()
        xd = x.to(xm.xla_device()).requires_grad_()
        xm.set_rng_state(123)
        y = checkpoint(m, xd) if use else m(xd)
        before = met.counter_value("xla::optimization_barrier") or 0
        y.sum().backward()
        if use:
            assert (met.counter_value("xla::optimization_barrier") or 0) == before + 1
        grads.append((xd.grad.cpu(), m[0].weight.grad.cpu()))
    for g, h in zip(*grads):
        assert torch.allclose(g, h, atol=1e-6)


def test_utils_helpers():
    seen = []
    xu.for_each_instance({"a": [1, "x", (2,)]}, lambda v: isinstance(v, int), seen.append)
    assert sorted(seen) == [1, 2]
    out = xu.for_each_instance_rewrite([1, (2, "y")], lambda v: isinstance(v, int), lambda v: v * 10)
    assert out == [10, (20, "y")]
    assert xu.flatten_nested_tuple((1, (2, (3,)))) == (1, 2, 3)
    assert xu.shape([torch.ones(2, 3), [torch.ones(1)]]) == [[2, 3], [[1]]]
    assert xu.parallel_work(2, lambda a, b: a + b, [1, 2], [3, 4]) == [4, 6]
    assert len(set(xu.get_free_tcp_ports(2))) == 2
    folder = xu.TmpFolder()
    assert os.path.isdir(folder.name)
    name = folder.name
    del folder
    assert not os.path.exists(name)
    assert list(xu.FnDataGenerator(lambda d: d.sum(), 2, torch.ones, dims=[3], count=2))[1][1].item() == 6


def test_xlac_functions():
    a = torch.randn(3, device=xm.xla_device())
    b, c = a * 2, a * 2
    assert xlac._get_graph_hash([b]) == xlac._get_graph_hash([c]) != xlac._get_graph_hash([a + 1])
    assert "XLAData: None" in xlac._get_xla_tensor_debug_info(b)
    xlac._xla_sync_multi([b], [])
    assert "ValueNode: None" in xlac._get_xla_tensor_debug_info(b)
    xlac._xla_increment_counter("TorchXlaNamesTest", 3)
    assert met.counter_value("TorchXlaNamesTest") == 3
    assert xlac._xla_get_default_device() == "xla:0"


def test_callback_runs_after_the_step():
    from xlatorch.experimental.callback import on_ready_event

    t = torch.randn(2, device=xm.xla_device()) + 1
    event = on_ready_event(t)
    xm.mark_step()
    assert event.wait(30)


def test_deprecation_warns_once(caplog):
    import types

    from xlatorch.experimental.deprecation import deprecated

    mod = types.ModuleType("oldmod")
    f = deprecated(mod, xu.as_list, "old_as_list")
    with caplog.at_level("WARNING"):
        assert f((1,)) == [1] and f(2) == [2]
    assert sum("oldmod.old_as_list is deprecated" in r.message for r in caplog.records) == 1


def test_the_counting_tool_on_two_modules():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import torch_xla_names as tool

    if not os.path.isdir(tool.MIRROR):
        pytest.skip("no torch_xla mirror here")
    mods, uses = tool.collect(tool.Repo(tool.MIRROR), ["torch_xla.backends", "torch_xla.experimental.deprecation"])
    assert mods["torch_xla.backends"].names == {"set_mat_mul_precision", "get_mat_mul_precision"}
    assert uses["torch_xla.backends"]["set_mat_mul_precision"] >= 5
    assert all(tool.xlatorch_has("torch_xla.backends", n) for n in mods["torch_xla.backends"].names)


def test_collective_broadcast_bucketized_all_reduce_and_xla_rendezvous_on_two_replicas(tmp_path):
    import mp_workers

    import xlatorch.distributed.xla_multiprocessing as xmp

    xmp.spawn(mp_workers.broadcast_from_root, args=(str(tmp_path),), nprocs=2)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert got["a"].tolist() == (torch.arange(6.0) + 10).tolist()
        assert got["b"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
        assert got["g"].tolist() == [1.5, 1.5, 1.5]  # (1 + 2) * 0.5
        assert got["payloads"] == [b"rank0", b"rank1"]


def test_custom_compile_options_reach_every_compile_and_key_the_cache(tmp_path):
    import xlatorch

    x = torch.randn(8, device="xla")
    xm.mark_step()
    (x * 3).cpu()  # compiled once without options
    before = met.metric_data("CompileTime")[0]
    xlatorch.set_custom_compile_options({"xla_dump_to": str(tmp_path)})
    try:
        (x * 3).cpu()  # the same graph with options: another executable, dumped where asked
        assert met.metric_data("CompileTime")[0] == before + 1
        assert any(tmp_path.iterdir())
    finally:
        xlatorch.set_custom_compile_options({})
    (x * 3).cpu()  # without them again: the first executable
    assert met.metric_data("CompileTime")[0] == before + 1


def test_trace_me_wraps_a_function_in_a_span():
    from xlatorch.debug import profiler as xp

    @xp.trace_me("my_scope")
    def f(a, b=1):
        return a + b

    assert f(1, b=2) == 3 and f.__name__ == "f"
    xp.set_tracer_marked_step(True)
    assert xp.get_tracer_marked_step() is True
    xp.set_tracer_marked_step(False)
    assert xr.R is not None and xr.FN is not None


def test_visualize_sharding_draws_the_tiles_and_their_devices(capsys):
    from xlatorch.distributed.spmd import debugging

    grid = debugging.visualize_sharding("{devices=[2,2]0,1,2,3}")
    rows = [line for line in grid.splitlines() if line.startswith("|")]
    assert [r.split("|")[1:3] for r in rows] == [["  CPU 0  ", "  CPU 1  "], ["  CPU 2  ", "  CPU 3  "]]
    assert capsys.readouterr().out.strip() == grid
    # XLA's iota form with a transpose: devices 0 2 / 1 3
    assert debugging.tiles("{devices=[2,2]<=[2,2]T(1,0)}") == ((2, 2), [["0"], ["2"], ["1"], ["3"]])
    assert debugging.tiles("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}") == ((2, 1), [["0", "1"], ["2", "3"]])
    assert debugging.tiles("{maximal device=3}") == ((1, 1), [["3"]])
    with pytest.raises(ValueError, match="1-D and 2-D"):
        debugging.tiles("{devices=[2,1,2]0,1,2,3}")
    assert "CPU all" in debugging.visualize_tensor_sharding(torch.ones(4, device="xla"))  # not sharded
