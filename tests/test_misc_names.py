"""torch_xla's less central modules and ``_XLAC`` functions: env var names, metrics report
parsing and comparison, the model comparator, the StableHLO test helpers without TensorFlow,
``_XLAC``'s buffer donation / dynamic marks / dot_general / device data nodes, the XLA op
builder, StableHLO composites and custom calls, and ``assume_pure_torch``. Values are checked
against PyTorch (or NumPy) on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

import xlatorch
import xlatorch.debug.metrics as met

DEV = xlatorch.device()


# --- xla_env_vars ---------------------------------------------------------------------------


def test_env_vars_are_torch_xla_names():
    from xlatorch.core import xla_env_vars as xenv

    names = [n for n in dir(xenv) if n.isupper()]
    assert len(names) >= 30
    for n in names:
        assert getattr(xenv, n) == n or (n, getattr(xenv, n)) in {
            ("TPU_MESH_CTLER_ADDR", "TPU_MESH_CONTROLLER_ADDRESS"),
            ("TPU_MESH_CTLER_PORT", "TPU_MESH_CONTROLLER_PORT"),
        }
    assert xenv.TPU_PROCESS_BOUNDS == "TPU_PROCESS_BOUNDS" and xenv.CLOUD_TPU_TASK_ID == "CLOUD_TPU_TASK_ID"


# --- metrics_compare_utils --------------------------------------------------------------------

_R1 = """Metric: InboundData
  TotalSamples: 1728
  Accumulator: 10GB
  Rate: 16.8665 / second
  Percentiles: 1%=393.00KB; 5%=393.00KB; 10%=786.00KB; 20%=1.54MB; 50%=1.54MB; 99%=1.54MB
Metric: TransferToDeviceTime
  TotalSamples: 2616
  Accumulator: 01m29s615ms
  ValueRate: 783ms426.227us / second
  Percentiles: 1%=05m003ms; 5%=05m004ms; 10%=05m010ms; 95%=05m108ms; 99%=05m129ms
Counter: CachedSyncTensors
  Value: 11336
"""
_R2 = """noise\n\nMetric: TransferToDeviceTime
  TotalSamples: 247016
  Accumulator: 04d17h11m07s495ms546.299us
  Percentiles: 1%=1s; 5%=1s; 10%=1s; 20%=1s; 50%=1s; 80%=1s; 90%=1s; 95%=1s; 99%=451.358ms
Counter: CachedSyncTensors
  Value: 1022168
Counter: UniqueCounter
  Value: 9000
"""


def test_data_points_from_reports():
    import xlatorch.debug.metrics_compare_utils as mcu

    pts = mcu.get_data_points_from_metrics_reports([_R1, _R2])
    assert pts["InboundData__Accumulator_mb"] == [10000.0, None]
    assert pts["InboundData__Percentile_1_mb"] == [pytest.approx(0.393), None]
    assert pts["TransferToDeviceTime__Accumulator_sec"] == [pytest.approx(89.615), pytest.approx(407467.495546299)]
    assert pts["TransferToDeviceTime__Percentile_1_sec"] == [pytest.approx(300.003), 1.0]
    assert pts["TransferToDeviceTime__Percentile_99_sec"][1] == pytest.approx(0.451358)
    assert pts["TransferToDeviceTime__TotalSamples"] == [2616.0, 247016.0]
    assert pts["CachedSyncTensors__Value"] == [11336, 1022168]
    assert pts["UniqueCounter__Value"] == [None, 9000]


def test_data_points_of_a_real_report():
    import xlatorch.debug.metrics_compare_utils as mcu

    x = torch.flip(torch.roll(torch.rand(3, 5, device=DEV), 1, 0), [0, 1])
    xlatorch.sync()
    assert x.device.type == "xla"
    pts = mcu.get_data_points_from_metrics_reports([met.metrics_report()])
    assert "CompileTime__Percentile_99_sec" in pts and "CompileTime__TotalSamples" in pts
    assert pts["CompileTime__Accumulator_sec"][0] > 0


def test_compare_metrics():
    import xlatorch.debug.metrics_compare_utils as mcu

    r3 = _R2.replace("9000", "9999")
    pts = mcu.get_data_points_from_metrics_reports([_R2, _R2, r3])
    same = mcu.get_data_points_from_metrics_reports([_R2] * 3)
    assert mcu.compare_metrics(same, _R2, {"base_expression": "v == v_mean"}) == ""
    assert mcu.compare_metrics(pts, r3) == ""  # within 2 stddev
    strict = mcu.compare_metrics(pts, r3, config={"base_expression": "v == v_mean"})
    assert strict == (
        "UniqueCounter__Value failed its expression check. Expression: v == v_mean.  Mean: 9333.0.  "
        "Stddev: 470.93311627024065.  Actual Value: 9999\n"
    )
    custom = {"base_expression": "v == v_mean", "UniqueCounter__Value_expression": "v > v_mean"}
    assert mcu.compare_metrics(pts, r3, config=custom) == ""
    new = r3 + "Counter: aten::_local_scalar_dense\n  Value: 7\nCounter: xla::mean\n  Value: 1\n"
    assert mcu.compare_metrics(pts, new) == "Found new aten counter: aten::_local_scalar_dense__Value: 7\n"


# --- model_comparator -------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)

    def forward(self, x, step=None):
        import xlatorch.debug.model_comparator as mc

        mc.save(None, x, step=step)
        x = mc.save("relu", torch.relu(self.fc1(x)), step=step)
        x = mc.save("relu", x * 2, step=step)
        return mc.save("out", self.fc2(x), step=step)


def test_model_comparator_cpu_and_device_runs_agree(tmp_path):
    import xlatorch.debug.model_comparator as mc

    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 6)
    mc.configure(str(tmp_path / "a"))
    os.makedirs(tmp_path / "a")
    net(x)
    net(x, step=1)
    mc.configure(str(tmp_path / "b"))
    os.makedirs(tmp_path / "b")
    dev_net = _Net()
    dev_net.load_state_dict(net.state_dict())
    dev_net.to(DEV)
    dev_net(x.to(DEV))
    dev_net(x.to(DEV), step=1)
    mc.configure(None)
    files = sorted(os.listdir(tmp_path / "a"))
    line = files[-1].removeprefix("test_misc_names.py.l").removesuffix(".0")
    assert files == ["out.0", "relu.0", "relu.1", "step-1", f"test_misc_names.py.l{line}.0"] and line.isdigit()
    assert sorted(os.listdir(tmp_path / "a" / "step-1")) == sorted(files[:3] + files[4:])
    assert mc.compare(str(tmp_path / "a"), str(tmp_path / "b"), rtol=1e-4, atol=1e-5) == ""
    # A changed tensor and a missing one are reported.
    t = torch.load(tmp_path / "b" / "relu.1")
    t[1, 2] += 1
    torch.save(t, tmp_path / "b" / "relu.1")
    os.remove(tmp_path / "b" / "step-1" / "relu.0")
    report = mc.compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert 'Changes in saved tensor "relu" with id=1' in report and "[1, 2]: " in report
    assert f"Mismatch: {os.path.join('step-1', 'relu.0')} not in {tmp_path / 'b'}" in report


def test_model_comparator_tensors_and_noop():
    import xlatorch.debug.model_comparator as mc

    a = torch.tensor([[1.0, 2.0], [float("nan"), 4.0]])
    assert mc.compare_tensors(a, a.clone()) == ""
    b = a.clone()
    b[1, 0] = 0.0
    assert mc.compare_tensors(a, b).startswith("[1, 0]: nan vs. 0.0")
    assert "different shape" in mc.compare_tensors(a, a[0])
    mc.configure(None)
    x = torch.ones(2, device=DEV)
    assert mc.save("x", x) is x  # no directory: nothing written


# --- stablehlo_test_utils ---------------------------------------------------------------------


def test_stablehlo_test_utils_without_tensorflow():
    from xlatorch.utils import stablehlo_test_utils as stu

    assert stu.has_tf_package() is False
    m = stu.wrap_func_as_nn_module(torch.add)
    assert isinstance(m, torch.nn.Module) and not m.training
    torch.testing.assert_close(m(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    ep = torch.export.export(m, (torch.ones(2), torch.ones(2)))
    with pytest.raises(ModuleNotFoundError, match="tensorflow"):
        stu.compare_exported_program_and_saved_model_result(ep, "/nonexistent", (torch.ones(2), torch.ones(2)))
    with pytest.raises(ModuleNotFoundError, match="tensorflow"):
        stu.load_save_model_and_inference("/nonexistent", ())


# --- _XLAC ------------------------------------------------------------------------------------


def _xlac():
    from xlatorch.compat import xlac

    return xlac


def test_buffer_donation_flag():
    xlac = _xlac()
    t0 = torch.randn(4, 2).to(DEV)
    t1 = torch.randn(4, 2).to(DEV)
    assert xlac._set_buffer_donation(t0, True) and xlac._get_buffer_donation(t0)
    assert not xlac._get_buffer_donation(t1)
    assert met.counter_value("XlaSetBufferDonation") == 1
    pending = t0 + 1
    assert not xlac._set_buffer_donation(pending, True) and not xlac._get_buffer_donation(pending)
    assert met.counter_value("XlaSetBufferDonation") == 1
    xlatorch.sync()  # t0 is not read by this step: it keeps its buffer and its mark
    assert xlac._get_buffer_donation(t0)
    assert xlac._set_buffer_donation(t0, False) and not xlac._get_buffer_donation(t0)
    assert not xlac._get_buffer_donation(torch.ones(2))


def test_buffer_donation_is_real():
    xlac = _xlac()
    t0 = torch.randn(4, 2).to(DEV)
    want = t0.cpu() * 2
    xlac._set_buffer_donation(t0, True)
    met.clear_all()
    t0 *= 2  # the step's output reuses t0's buffer
    xlatorch.sync()
    assert met.metric_data("InputOutputAliasCount")[1] == 1
    torch.testing.assert_close(t0.cpu(), want)
    assert not xlac._get_buffer_donation(t0)  # the mark stays with the old buffer
    # A marked buffer a live tensor still holds is donated too; that tensor is then unusable.
    a = torch.randn(3).to(DEV)
    xlac._set_buffer_donation(a, True)
    b = a + 1
    xlatorch.sync()
    assert b.cpu().shape == (3,)
    assert "Data Handle: Deleted" in xlac._get_xla_tensor_debug_info(a)
    assert "Data Handle: Live" in xlac._get_xla_tensor_debug_info(b)
    with pytest.raises(Exception, match="deleted|donated"):
        a.cpu()


def test_mark_dynamic_records_and_warns():
    xlac = _xlac()
    b = torch.randn(10, 5).to(DEV)
    with pytest.warns(UserWarning, match="static shapes"):
        xlac._xla_mark_dynamic(b, 1)
    assert b._xla_dynamic_dims == {1} and met.counter_value("XlaMarkDynamic") == 1
    torch.testing.assert_close((b * 2).cpu(), b.cpu() * 2)
    with pytest.raises(IndexError):
        xlac._xla_mark_dynamic(b, 2)
    with pytest.raises(RuntimeError, match="xla device"):
        xlac._xla_mark_dynamic(torch.ones(2), 0)


@pytest.mark.parametrize(
    "xs, ws, dims, pref",
    [
        ((10, 3, 4), (10, 4, 5), (([2], [1]), ([0], [0])), None),
        ((10, 3, 4), (10, 4, 5), (([-1], [-2]), ([0], [0])), None),
        ((10, 3, 4), (5, 4), (([2], [1]), ()), None),
        ((10, 3, 4), (10, 4, 5), (([2], [1]), ([0], [0])), torch.int32),
    ],
)
def test_xla_dot_general(xs, ws, dims, pref):
    xlac = _xlac()
    if pref is torch.int32:
        x, w = torch.randint(-15, 15, xs, dtype=torch.int32), torch.randint(-15, 15, ws, dtype=torch.int32)
        out = xlac._xla_dot_general(
            x.to(torch.int8).to(DEV), w.to(torch.int8).to(DEV), dims, preferred_element_type=pref
        )
        assert out.dtype == torch.int32
        torch.testing.assert_close(out.cpu(), torch.matmul(x, w))
        return
    x, w = torch.rand(xs), torch.rand(ws)
    want = torch.matmul(x, w if len(ws) == 3 else w.t())
    xd, wd = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    out = xlac._xla_dot_general(xd, wd, dims)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.matmul(xc, wc if len(ws) == 3 else wc.t()).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wd.grad.cpu(), wc.grad, rtol=1e-5, atol=1e-5)


def test_xla_dot_general_bf16_and_errors():
    xlac = _xlac()
    x, w = torch.rand(2, 3, 4).to(torch.bfloat16), torch.rand(2, 4, 5).to(torch.bfloat16)
    out = xlac._xla_dot_general(x.to(DEV), w.to(DEV), (([2], [1]), ([0], [0])))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.cpu(), torch.matmul(x, w))
    msg = (
        "Expected input tensor (first argument) to be an actual XLA tensor. Got: CPUBFloat16Type. "
        "Consider moving it (first argument) to XLA."
    )
    with pytest.raises(RuntimeError) as e:
        xlac._xla_dot_general(x, w.to(DEV), (([2], [1]), ([0], [0])))
    assert str(e.value) == msg
    with pytest.raises(RuntimeError, match="second argument"):
        xlac._xla_dot_general(x.to(DEV), w, (([2], [1]), ([0], [0])))


def test_tpu_custom_call_off_tpu_says_what_to_do():
    with pytest.raises(RuntimeError, match="only a TPU.*call_jax"):
        _xlac()._xla_tpu_custom_call([torch.ones(2, device=DEV)], "payload", [[2]], [torch.float32])


def test_tensors_device_data_node():
    xlac = _xlac()
    t1 = torch.randn(20, 5).to(DEV)
    t2 = torch.randn(20, 5).to(DEV)
    t4 = (t2 + t1) * t2
    ids, tensors = xlac._get_tensors_xla_device_data_node([t4])
    assert sorted(ids) == sorted([xlac._xla_get_tensor_id(t1), xlac._xla_get_tensor_id(t2)])
    assert {id(t) for t in tensors} == {id(t1), id(t2)}
    ids2, tensors2 = xlac._get_tensors_xla_device_data_node([t4], [t1])
    assert tensors2[ids2.index(xlac._xla_get_tensor_id(t1))] is t1
    # A buffer no tensor holds any more comes back as a new tensor on it.
    t5 = torch.randn(3).to(DEV)
    want = t5.cpu()
    t6 = t5 * 3
    del t5
    ids, tensors = xlac._get_tensors_xla_device_data_node([t6])
    assert len(tensors) == 1 and ids == [xlac._xla_get_tensor_id(tensors[0])]
    torch.testing.assert_close(tensors[0].cpu(), want)
    assert xlac._check_tensor_need_materialization([t4]) == [True]  # nothing synced


# --- assume_pure_torch ------------------------------------------------------------------------


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


def test_assume_pure_torch_values_and_one_node(no_grad):
    from xlatorch.debug.dump import ir_text
    from xlatorch.experimental import assume_pure as ap

    model = torch.nn.Sequential(torch.nn.Linear(9, 9), torch.nn.LayerNorm(9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    x = torch.randn(5, 9)
    want = model(x)
    model.to(DEV)

    @ap.assume_pure_torch
    def call(params, x):
        return torch.func.functional_call(model, params, x)

    out = call(dict(model.named_parameters()), x.to(DEV).requires_grad_())
    assert "addmm" not in ir_text([out])  # one node, not the traced ops
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)

    @ap.assume_pure_torch
    def inner(a, b):
        return a @ b

    @ap.assume_pure_torch
    def outer(a, b):
        return inner(a, b) + 1

    a, b = torch.randn(3, 3), torch.randn(3, 3)
    torch.testing.assert_close(outer(a.to(DEV), b.to(DEV)).cpu(), a @ b + 1, rtol=1e-5, atol=1e-5)


def test_assume_pure_torch_cache_traces_once(no_grad):
    from xlatorch.experimental import assume_pure as ap

    traces = 0

    def f(a, b):
        nonlocal traces
        traces += 1
        return torch.sin(a @ b)

    cached, uncached = ap.assume_pure_torch(f, use_cache=True), ap.assume_pure_torch(f)
    for _ in range(3):
        a = torch.ones(3, 3, device=DEV)
        torch.testing.assert_close(cached(a, a).cpu(), torch.sin(torch.ones(3, 3) @ torch.ones(3, 3)))
        xlatorch.sync()
    assert traces == 1
    uncached(a, a)
    uncached(a, a)
    assert traces == 3
    cached(torch.ones(2, 2, device=DEV), torch.ones(2, 2, device=DEV))  # a new signature: traced anew
    assert traces == 4
    ap._XLA_COMPUTATION_CACHE.clear()


def test_assume_pure_torch_is_forward_only():
    from xlatorch.experimental import assume_pure as ap

    with pytest.raises(RuntimeError, match="forward-only"):
        ap.assume_pure_torch(torch.sin)
    with torch.no_grad():
        f = ap.assume_pure_torch(torch.sin)
    with pytest.raises(RuntimeError, match="forward-only"):
        f(torch.ones(2, device=DEV, requires_grad=True))
    assert not f(torch.ones(2, device=DEV)).requires_grad


# --- xla_builder: Op, Type, create_placeholder_tensor -----------------------------------------


def _run_op(fn, tensors, **kwargs):
    from xlatorch.core import xla_op_registry as xor

    return xor.register(fn.__name__, fn)(*[t.to(DEV) for t in tensors], **kwargs)


def test_xla_builder_ops_against_torch():
    from xlatorch.core import xla_builder as xb

    a, b = torch.randn(2, 3), torch.randn(2, 3)

    def arith(a, b):
        return xb.Op.sin(a) + b * a - (a.max(b) - a.min(b)) / b.exp()

    torch.testing.assert_close(_run_op(arith, [a, b]).cpu(), a.sin() + b * a - (a.max(b) - a.min(b)) / b.exp())

    def mixed(a):
        return xb.Op.tuple((a, a.cast(xb.Type.BF16), a.reshape((3, 2)).transpose((1, 0)), (a > a.zeros_like())))

    x, x16, xt, pos = _run_op(mixed, [a])
    assert (x.dtype, x16.dtype, pos.dtype) == (torch.float32, torch.bfloat16, torch.bool)
    torch.testing.assert_close(x16.cpu(), a.bfloat16())
    torch.testing.assert_close(xt.cpu(), a.reshape(3, 2).t())
    assert torch.equal(pos.cpu(), a > 0)

    def scalar_mul(a, k=None):
        return a * xb.Op.scalar(a.builder(), k, dtype=a.shape().dtype)

    torch.testing.assert_close(_run_op(scalar_mul, [a], k=2.5).cpu(), a * 2.5)


@pytest.mark.parametrize("k0", [0.1, 0.9])
def test_xla_builder_conditional(k0):
    from xlatorch.core import xla_builder as xb

    def op_fn(k, a, b, k0=None):
        cond = k > xb.Op.scalar(k.builder(), k0, dtype=k.shape().dtype)
        return cond.mkconditional((a, b), lambda a, b: a + b, lambda a, b: a - b)

    k, a, b = torch.tensor(0.2), torch.randn(2, 2), torch.randn(2, 2)
    out = _run_op(op_fn, [k, a, b], k0=k0)
    torch.testing.assert_close(out.cpu(), a + b if 0.2 > k0 else a - b)


def test_xla_builder_while_and_solve():
    from xlatorch.core import xla_builder as xb

    def op_fn(a, b, limit=None):
        def cond(counter, a, b):
            return counter < xb.Op.scalar(counter.builder(), limit, dtype=xb.Type.S32)

        def body(counter, a, b):
            return xb.Op.tuple((counter + xb.Op.scalar(counter.builder(), 1, dtype=xb.Type.S32), a + b, b))

        zero = xb.Op.scalar(a.builder(), 0, dtype=xb.Type.S32)
        return xb.Op.mkwhile((zero, a, b), cond, body).get_tuple_element(1)

    a, b = torch.randn(2, 2), torch.randn(2, 2)
    torch.testing.assert_close(_run_op(op_fn, [a, b], limit=10).cpu(), a + 10 * b, rtol=1e-5, atol=1e-5)

    def solve(b, A):
        return A.triangualr_solve(b, True, False, False, False)

    b, A = torch.randn(2, 3), torch.randn(2, 2).triu() + 2 * torch.eye(2)
    want = torch.linalg.solve_triangular(A, b, upper=True)
    torch.testing.assert_close(_run_op(solve, [b, A]).cpu(), want, rtol=1e-5, atol=1e-5)


def test_xla_builder_types_and_computation():
    from xlatorch.core import xla_builder as xb

    for xla_type in xb._XLA_PT_TYPE_MAP:
        assert xla_type == xb.Op.from_torch_type(xb.Op.to_torch_type(xla_type))
    assert xb.Type.S32 == "s32" and xb.Op.to_torch_type(None) is torch.float32
    t = torch.randn(2, 3)
    shape = xb.tensor_shape(t)
    assert (shape.dtype, shape.sizes, shape.rank) == ("f32", (2, 3), 2)
    comp = xb.create_computation("c", lambda a, b: xb.Op.tuple([a.max(b) - a.min(b)]), [shape, shape])
    assert "maximum" in xb.get_computation_hlo(comp)
    (out,) = xb.xla_computation_as_func(comp)([t.to(DEV), (-t).to(DEV)])
    torch.testing.assert_close(out.cpu(), 2 * t.abs())


def test_create_placeholder_tensor():
    from xlatorch.compat import xlac
    from xlatorch.core.xla_builder import create_placeholder_tensor
    from xlatorch.debug.dump import hlo_text, ir_text

    for shape, dtype in (((1, 2), torch.float32), ((2, 3, 4), torch.bfloat16), ((3, 4, 5, 6), torch.int8)):
        p = create_placeholder_tensor(shape, dtype)
        assert p.device.type == "xla" and p.dtype == dtype and p.shape == shape
        assert xlac._is_placecholder(p)
    with pytest.raises(RuntimeError):
        create_placeholder_tensor((1,), torch.bfloat16).cpu()
    met.clear_all()
    p1 = create_placeholder_tensor((2, 3), torch.bfloat16)
    p2 = create_placeholder_tensor((3, 4), torch.bfloat16)
    b = (torch.sin(p1) @ p2) @ p2.T
    assert ir_text([b]).count("%i") >= 2
    assert "bf16[3,4]" in hlo_text([b], dialect="hlo") and "bf16[2,3]" in hlo_text([b], dialect="hlo")
    assert not met.metric_data("TransferToDeviceTime")
    assert not xlac._is_placecholder(torch.ones(2, device=DEV))


# --- stablehlo_custom_call --------------------------------------------------------------------


def test_place_to_host_and_device():
    from xlatorch.debug.dump import hlo_text
    from xlatorch.experimental.stablehlo_custom_call import place_to_device, place_to_host

    a = torch.arange(10.0, device=DEV)
    b = place_to_host(a)
    text = hlo_text([b])
    assert "@annotate_device_placement" in text and "has_side_effect = true" in text
    assert 'mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}}' in text
    c = place_to_device(b * 2)
    assert '_xla_buffer_placement = "device"' in hlo_text([c])
    torch.testing.assert_close(c.cpu(), torch.arange(10.0) * 2)
    torch.testing.assert_close((b + 1).cpu(), torch.arange(10.0) + 1)  # a committed placed value is usable
    x = torch.ones(10, device=DEV, requires_grad=True)
    (place_to_device(place_to_host(x)) * 3).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((10,), 3.0))
    torch.testing.assert_close(place_to_host(torch.ones(2)), torch.ones(2))  # CPU: the identity


def test_stablehlo_custom_call_text():
    from xlatorch.debug.dump import hlo_text
    from xlatorch.experimental.stablehlo_custom_call import stablehlo_custom_call

    x = torch.randn(3, 3, device=DEV)
    y = stablehlo_custom_call((torch.sin(x),), "custom_op3", [x.shape[1:]], [torch.int8], True, "backend_config", 1)
    assert y.shape == (3,) and y.dtype == torch.int8
    text = hlo_text([y])
    assert "stablehlo.custom_call @custom_op3" in text and 'backend_config = "backend_config"' in text
    assert "has_side_effect = true" in text and "-> tensor<3xi8>" in text
    a, b = stablehlo_custom_call([x, x], "two", [(3, 3), (2,)], [torch.float32, torch.int32])
    assert a.shape == (3, 3) and b.dtype == torch.int32


# --- mark_pattern_utils -----------------------------------------------------------------------


def test_composite_builder_outlines_a_composite():
    from xlatorch.debug.dump import hlo_text
    from xlatorch.experimental.mark_pattern_utils import StableHLOCompositeBuilder

    w = torch.randn(3)

    def f(x, y, w):
        b = StableHLOCompositeBuilder("test.scaled_add", {"scale": 2.0, "dims": [1, 2], "name": "s", "on": True})
        x, y = b.mark_inputs(x, y)
        z = x * 2.0 + y * w  # w: read from outside, not marked
        return b.mark_outputs(z, x.sin())

    x, y = torch.randn(3), torch.randn(3)
    want = (x * 2 + y * w, x.sin())
    for got, ref in zip(f(x, y, w), want):  # CPU: the marks are the identity
        torch.testing.assert_close(got, ref)
    xd = x.to(DEV).requires_grad_()
    z, s = f(xd, y.to(DEV), w.to(DEV))
    text = hlo_text([z, s])
    assert 'stablehlo.composite "test.scaled_add"' in text
    assert 'dims = dense<[1, 2]> : tensor<2xi64>, name = "s", on = true, scale = 2.000000e+00 : f32' in text
    assert "decomposition = @test.scaled_add" in text
    torch.testing.assert_close(z.cpu(), want[0])
    torch.testing.assert_close(s.cpu(), want[1])
    (z.sum() + s.sum()).backward()
    torch.testing.assert_close(xd.grad.cpu(), 2 + x.cos())
    ep = torch.export.export(_Fn(f), (x, y, w))
    assert str(ep.graph).count("xla.mark_tensor") == 4
    with pytest.raises(ValueError, match="attr value"):
        StableHLOCompositeBuilder("bad", {"a": [1, "x"]})
    with pytest.raises(ValueError, match="torch tensor"):
        StableHLOCompositeBuilder("p").mark_inputs(1.0)


class _Fn(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *args):
        return self.f(*args)


def test_composite_with_checked_ops_reports_a_bad_index():
    from xlatorch.debug.dump import hlo_text
    from xlatorch.experimental.mark_pattern_utils import StableHLOCompositeBuilder

    def update(cache, pos, val):
        b = StableHLOCompositeBuilder("test.update_kv_cache")
        cache, pos, val = b.mark_inputs(cache, pos, val)
        return b.mark_outputs(cache.index_copy_(1, pos, val))

    cache, val = torch.zeros(1, 4, 2), torch.ones(1, 1, 2)
    out = update(cache.to(DEV), torch.tensor([1], device=DEV), val.to(DEV))
    assert 'stablehlo.composite "test.update_kv_cache"' in hlo_text([out])
    torch.testing.assert_close(out.cpu(), cache.clone().index_copy_(1, torch.tensor([1]), val))
    bad = update(cache.to(DEV), torch.tensor([7], device=DEV), val.to(DEV))
    with pytest.raises(IndexError):
        bad.cpu()
