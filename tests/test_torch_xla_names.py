"""torch_xla names added for issue 29 §4: behaviour, not just existence."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests import warm
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
    out = warm.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
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

    xmp.spawn(mp_workers.broadcast_from_root, args=(str(tmp_path),), nprocs=2, start_method="forkserver")
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
    torch.tanh(x * 3).cpu()  # compiled once without options (tanh: a tiny graph of exact ops would run on the host)
    before = met.metric_data("CompileTime")[0]
    xlatorch.set_custom_compile_options({"xla_dump_to": str(tmp_path)})
    try:
        torch.tanh(x * 3).cpu()  # the same graph with options: another executable, dumped where asked
        assert met.metric_data("CompileTime")[0] == before + 1
        assert any(tmp_path.iterdir())
    finally:
        xlatorch.set_custom_compile_options({})
    torch.tanh(x * 3).cpu()  # without them again: the first executable
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


# ---------------------------------------------------------------------------------------
# xm's point-to-point collectives, XLA_LIB, DeviceContext, ToXlaTensorArena, CoalescingBuckets;
# pl.PerDeviceQueue; xmp's replica groups; xser.TensorReference; torch_xla.eager_mode / dist;
# XLAPatchedLinear and apply_backward_optimization_barrier (no SPMD needed; the SPMD names are
# in tests/test_spmd_names.py).
# ---------------------------------------------------------------------------------------


def test_point_to_point_collectives_between_two_processes(tmp_path):
    import mp_collective_workers as w

    import xlatorch.distributed.xla_multiprocessing as xmp

    xmp.spawn(w.permute_send_recv, args=(str(tmp_path),), nprocs=2, start_method="forkserver")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    x0, x1 = w.value(0), w.value(1)
    assert torch.equal(r0["ring"], x1 * 2) and torch.equal(r1["ring"], x0 * 2)
    assert torch.equal(r0["partial"], x1) and torch.equal(r1["partial"], torch.zeros(2, 3))
    assert r0["ints"].tolist() == [1, 1, 1] and r1["ints"].tolist() == [0, 0, 0]
    torch.testing.assert_close(r0["sent"], x0.exp())  # send gives back its input
    torch.testing.assert_close(r0["other"], (x0.exp() + 1).sum())
    torch.testing.assert_close(r1["got"], x0.exp())
    torch.testing.assert_close(r1["buf"], x0.exp())  # recv writes into its output
    torch.testing.assert_close(r1["twice"], x0.exp() * 2)
    assert r0["permutes"] == r1["permutes"] == 4


def test_point_to_point_collectives_in_one_process():
    d = xm.xla_device()
    x = torch.arange(4.0, device=d)
    assert torch.equal(xm.collective_permute(x, [[0, 0]]).cpu(), torch.arange(4.0))
    assert torch.equal(xm.collective_permute(x, []).cpu(), torch.zeros(4))  # nothing arrives: zeros
    assert torch.equal(xm.send(x, 0).cpu(), torch.arange(4.0))
    buf = torch.zeros(4, device=d)
    assert torch.equal(xm.recv(buf, 0).cpu(), torch.zeros(4))
    with pytest.raises(ValueError, match="ordinal 1"):
        xm.send(x, 1)
    with pytest.raises(ValueError, match="replica twice"):
        xm.collective_permute(x, [[0, 0], [0, 0]])
    with pytest.raises(RuntimeError, match="xla tensors"):
        xm.collective_permute(torch.ones(2), [[0, 0]])


def test_xla_lib_kernels_for_xla_tensors_run_lazily():
    from torch.library import impl

    name = "names_test_scale"
    xm.XLA_LIB.define(f"{name}(Tensor x, float s) -> Tensor")
    calls = []

    @impl(xm.XLA_LIB, name, "XLA")
    def on_xla(x, s):
        calls.append(x.device.type)
        return x * s + 1

    @impl(xm.XLA_LIB, name, "CompositeExplicitAutograd")
    def elsewhere(x, s):
        calls.append(x.device.type)
        return x * s + 1

    op = getattr(torch.ops.xla, name)
    met.clear_all()
    got = op(torch.arange(3.0, device=xm.xla_device()), 2.0)
    assert calls == ["xla"] and not [c for c in met.counter_names() if c.startswith("aten::")]
    assert got.cpu().tolist() == [1.0, 3.0, 5.0]
    assert op(torch.arange(3.0), 2.0).tolist() == [1.0, 3.0, 5.0] and calls == ["xla", "cpu"]


def test_device_context_is_one_object_per_device():
    ctx = xm._get_device_context()
    assert isinstance(ctx, xm.DeviceContext) and ctx.device == "xla:0"
    assert xm._get_device_context("xla:0") is ctx and xm._get_device_context(torch.device("xla", 0)) is ctx


def test_to_xla_tensor_arena_converts_all_selected_values_in_one_call():
    shared = torch.ones(2)
    data = {"a": [shared, torch.zeros(3)], "b": (shared, 4), "c": "text"}
    batches = []

    def convert(ts):
        batches.append(len(ts))
        return [t.to(xm.xla_device()) for t in ts]

    out = xm.ToXlaTensorArena(convert, lambda v: type(v) is torch.Tensor).transform(data)
    assert batches == [2]  # one call; the shared tensor once
    assert out["a"][0] is out["b"][0] and out["a"][0].device.type == "xla"
    assert out["a"][1].cpu().tolist() == [0.0, 0.0, 0.0] and out["b"][1] == 4 and out["c"] == "text"


def test_coalescing_buckets_follow_torch_xla_rule():
    mb = 1024 * 1024

    def t(mbytes):  # a float32 tensor of ``mbytes`` MB
        return torch.zeros(int(mbytes * mb) // 4)

    sizes = [0.25, 0.25, 0.75, 3.0, 0.25, 1.5, 0.5]
    calls = []

    def func(bucket, out):
        if isinstance(bucket, torch.Tensor):
            calls.append(round(bucket.numel() * 4 / mb, 2))
            return bucket
        calls.append([round(b.numel() * 4 / mb, 2) for b in bucket])
        return list(bucket)

    inputs = [t(s) for s in sizes]
    res = xm.CoalescingBuckets(func, inputs, bucket_cap_mb=1)()
    # 0.25+0.25 fill the bucket; 0.75 spills it; 3.0 alone (too big to join 0.75 within 2x cap);
    # 0.25; 1.5 joins the 0.25 (under half the cap, within 2x) and flushes; 0.5 last
    assert calls == [[0.25, 0.25], 0.75, 3.0, [0.25, 1.5], 0.5]
    assert all(r is i for r, i in zip(res, inputs))
    with pytest.raises(TypeError):
        xm.CoalescingBuckets(func, (torch.ones(1),))
    with pytest.raises(ValueError, match="length"):
        xm.CoalescingBuckets(func, [torch.ones(1)], [torch.ones(1), torch.ones(1)])


def test_bucketized_collectives_in_one_process_match_cpu():
    d = xm.xla_device()
    xs = [torch.arange(8.0).reshape(4, 2) + i for i in range(3)]
    got = xm.reduce_scatter_bucketized(xm.REDUCE_SUM, [x.to(d) for x in xs], 0.5, 0, 1, bucket_cap_mb=0)
    assert [g.cpu().tolist() for g in got] == [(x * 0.5).tolist() for x in xs]
    outs = [torch.zeros(4, 2, device=d) for _ in xs]
    gathered = xm.all_gather_bucketized([x.to(d) for x in xs], output=outs)
    assert gathered is outs and [o.cpu().tolist() for o in outs] == [x.tolist() for x in xs]


def test_parallel_loader_queues_are_per_device_queues():
    import xlatorch.distributed.parallel_loader as pl

    batches = [torch.full((2,), float(i)) for i in range(5)]
    loader = pl.ParallelLoader(batches, [xm.xla_device()], loader_prefetch_size=3, device_prefetch_size=2)
    q = loader._queues[0]
    assert isinstance(q, pl.PerDeviceQueue) and q.device == xm.xla_device()
    assert q.queue.maxsize == 2 and q.cpu_loader_queue.maxsize == 3 and next(q.close_queue_count) == 0
    got = [b.cpu().tolist() for b in loader.per_device_loader(xm.xla_device())]
    assert got == [[float(i)] * 2 for i in range(5)]


def test_optimized_replica_groups(monkeypatch):
    import xlatorch.distributed.xla_multiprocessing as xmp

    assert xmp.create_optimized_replica_groups() is None  # CPU: the default order
    monkeypatch.setattr(xmp, "_tpu_bounds", lambda: (2, 4, 1))
    assert xmp.device_kind_handler_dict["v6e"]() == [[0, 2, 4, 6, 7, 5, 3, 1]]
    assert xmp.device_kind_handler_dict["v5p"]() is None
    monkeypatch.setattr(xmp, "_tpu_bounds", lambda: (2, 2, 2))
    groups = xmp.device_kind_handler_dict["v5p"]()
    # a ring over the 2x2x2 torus (ids x-fastest): each step changes one coordinate
    ring = groups[0] + groups[0][:1]
    coords = [(i % 2, i // 2 % 2, i // 4) for i in ring]
    assert sorted(groups[0]) == list(range(8))
    assert all(sum(a != b for a, b in zip(p, q)) == 1 for p, q in zip(coords, coords[1:]))


def _torch_xla_layout_checkpoint(path):
    """A checkpoint as torch_xla's xser.save writes it: the structure holds
    ``torch_xla.utils.serialization.TensorReference`` objects; tensors are in path.tensors/."""
    import types

    fakes = {n: types.ModuleType(n) for n in ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")}

    class TensorReference:
        def __init__(self, tid):
            self.tid = tid

    TensorReference.__module__ = "torch_xla.utils.serialization"
    TensorReference.__qualname__ = "TensorReference"
    fakes["torch_xla.utils.serialization"].TensorReference = TensorReference
    saved = {n: sys.modules.get(n) for n in fakes}
    sys.modules.update(fakes)
    try:
        os.mkdir(str(path) + ".tensors")
        torch.save(torch.arange(6.0).reshape(2, 3), str(path) + ".tensors/tensor_0.pt")
        torch.save(torch.ones(4, dtype=torch.int64), str(path) + ".tensors/tensor_1.pt")
        w = TensorReference(0)  # a tensor saved twice is one reference, as torch_xla's arena makes it
        torch.save({"w": w, "rest": [TensorReference(1), 3], "again": w}, path)
    finally:
        for n, m in saved.items():
            if m is None:
                del sys.modules[n]
            else:
                sys.modules[n] = m


def test_xser_load_reads_torch_xla_tensor_references(tmp_path):
    import xlatorch.utils.serialization as xser

    path = tmp_path / "ck"
    _torch_xla_layout_checkpoint(path)
    got = xser.load(str(path))
    assert torch.equal(got["w"], torch.arange(6.0).reshape(2, 3)) and got["again"] is got["w"]
    assert torch.equal(got["rest"][0], torch.ones(4, dtype=torch.int64)) and got["rest"][1] == 3
    assert xser.TensorReference(5).tid == 5
    os.remove(str(path) + ".tensors/tensor_1.pt")
    with pytest.raises(xser.CheckpointError, match="tensor_1.pt"):
        xser.load(str(path))


def test_top_level_eager_mode_and_dist():
    import torch.distributed

    import xlatorch
    from xlatorch.experimental import eager_mode, is_eager_mode

    assert xlatorch.dist is torch.distributed and xlatorch.eager_mode is eager_mode
    xlatorch.eager_mode(True)
    try:
        assert is_eager_mode()
    finally:
        xlatorch.eager_mode(False)
    assert not is_eager_mode()


def test_patched_linear_matches_f_linear_with_autocast():
    import xlatorch.distributed.spmd as xs

    torch.manual_seed(0)
    m = torch.nn.Linear(6, 5)
    x = torch.randn(2, 3, 6)
    ref = torch.nn.functional.linear(x, m.weight, m.bias)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    d = xm.xla_device()
    md = torch.nn.Linear(6, 5).to(d)
    md.load_state_dict(m.state_dict())
    xd = x.to(d).requires_grad_()
    out = xs.xla_patched_nn_linear_forward(md, xd)
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    for p, g in zip(md.parameters(), ref_grads):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-5)
    # A sum of 5 products: CPU's BLAS and XLA may add them in other orders (each within 5 float32
    # roundings of the magnitudes' sum)
    w = m.weight.detach()
    err = (xd.grad.cpu() - torch.ones(2, 3, 5) @ w).abs()
    assert (err <= 5 * torch.finfo(torch.float32).eps * w.abs().sum(0)).all()
    with torch.autocast("xla"):
        low = xs.XLAPatchedLinear.apply(xd, md.weight, md.bias)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float().cpu(), ref.detach(), rtol=2e-2, atol=5e-2)


def test_backward_optimization_barrier_keeps_gradients():
    import xlatorch.distributed.spmd as xs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    d = xm.xla_device()
    md = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(d)
    md.load_state_dict(model.state_dict())
    xs.apply_backward_optimization_barrier(md[2])
    met.clear_all()
    md(x.to(d)).square().sum().backward()
    assert met.counter_value("xla::optimization_barrier") == 1
    text = xm.get_stablehlo([p.grad for p in md.parameters()])
    assert "optimization_barrier" in text
    for p, g in zip(md.parameters(), ref):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-5)


_DP_PERMUTE = r"""
import json, torch
import xlatorch.core.xla_model as xm
import xlatorch.distributed.data_parallel as dp
import xlatorch.runtime as xr

def loop(model, loader, device, context):
    r = xr.global_ordinal()
    x = torch.full((3,), float(r + 1), device=device)
    swapped = xm.collective_permute(x, [[0, 1], [1, 0]])
    one_way = xm.collective_permute(x, [[0, 1]])
    xm.mark_step()
    try:
        xm.send(x, 1 - r)
        error = None
    except NotImplementedError as e:
        error = str(e)
    return r, swapped.cpu().tolist(), one_way.cpu().tolist(), error

print(json.dumps(dp.DataParallel(torch.nn.Identity, device_ids=xm.get_xla_supported_devices())(loop, [1, 2])))
"""


def test_collective_permute_between_data_parallel_threads():
    import json

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=ROOT)
    r = warm.run([sys.executable, "-c", _DP_PERMUTE], capture_output=True, text=True, cwd=ROOT, env=env,
                 timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (r0, swap0, one0, err0), (r1, swap1, one1, err1) = json.loads(r.stdout.strip().splitlines()[-1])
    assert (r0, r1) == (0, 1)
    assert swap0 == [2.0] * 3 and swap1 == [1.0] * 3
    assert one0 == [0.0] * 3 and one1 == [1.0] * 3
    assert "collective_permute" in err0 and "collective_permute" in err1  # send/recv: a clear refusal


def test_apply_xla_patch_to_nn_linear_keeps_modules_and_values():
    from xlatorch.distributed.spmd import xla_sharding as xsh

    class Scaled(torch.nn.Linear):  # a subclass keeps its own forward
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), Scaled(6, 3))
    x = torch.randn(5, 4)
    ref = model(x)
    md = model.to(xm.xla_device())
    first, weight = md[0], md[0].weight
    assert xsh.apply_xla_patch_to_nn_linear(md) is md
    assert type(md[0]) is xsh.EinsumLinear and md[0] is first and md[0].weight is weight
    assert type(md[2]) is Scaled
    torch.testing.assert_close(md(x.to(xm.xla_device())).detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
