"""Neural-network ops in use, against CPU eager: what the OpInfo suite cannot express.

A training step of a small CNN (batch norm updating its running statistics, reflection
padding, average/adaptive pooling, group norm, bilinear upsampling, cross entropy) and
scaled dot-product attention without dropout (its OpInfo samples include dropout, so
the conformance suite compares only shapes there).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests.cpu_twin import refused_as_on_cpu, runs_as_on_cpu


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8, momentum=0.3)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8 * 3 * 3, 4)

    def forward(self, x):
        x = F.avg_pool2d(F.relu(self.bn(self.conv1(x))), 2, ceil_mode=True, count_include_pad=False)
        x = self.gn(self.conv2(x))
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        x = F.adaptive_avg_pool2d(x, (3, 3))
        return self.head(x.flatten(1))


def _fallbacks():
    return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}


def _step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_cnn_training_step_matches_cpu():
    torch.manual_seed(0)
    cpu = _Net()
    dev = _Net()
    dev.load_state_dict(cpu.state_dict())
    dev.to("xla")
    x, y = torch.randn(4, 3, 9, 9), torch.randint(0, 4, (4,))
    want = [_step(cpu, x, y) for _ in range(2)]
    got = [_step(dev, x.to("xla"), y.to("xla")) for _ in range(2)]
    xm.mark_step()
    fell = _fallbacks()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)
    for (name, w), g in zip(cpu.state_dict().items(), dev.state_dict().values()):
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert not fell, f"CPU fallbacks: {fell}"


def test_batch_norm_eval_uses_running_stats():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.eval()
    x = torch.randn(6, 5)
    want = bn(x)
    got = bn.to("xla")(x.to("xla"))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert not _fallbacks()


@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (False, True)])
def test_scaled_dot_product_attention(causal, masked):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    mask = None
    if masked:  # a boolean mask with one fully masked query row: _safe_softmax gives 0 there
        mask = torch.rand(5, 5) > 0.3
        mask[1] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    cot = torch.randn(out.shape)
    want = torch.autograd.grad(out, (q, k, v), cot)
    xq, xk, xv = (t.detach().to("xla").requires_grad_() for t in (q, k, v))
    xmask = None if mask is None else mask.to("xla")
    xout = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=xmask, is_causal=causal)
    got = torch.autograd.grad(xout, (xq, xk, xv), cot.to("xla"))
    xm.mark_step()
    torch.testing.assert_close(xout.cpu(), out.detach(), atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-4)
    assert not _fallbacks()


# (spatial dims, in, out, kernel, stride, padding, output_padding, dilation, groups, bias, batched)
_CONV_T = [
    (1, 4, 6, 3, 2, 1, 1, 1, 2, True, True),
    (1, 3, 2, 4, 3, 0, 2, 2, 1, False, False),  # unbatched input, output_padding < stride
    (2, 4, 6, 3, 2, 1, 1, 2, 2, True, True),  # groups > 1, dilation > 1, output_padding > 0
    (2, 2, 3, (2, 3), (1, 2), (0, 3), (0, 1), 1, 1, True, True),  # padding > dilation * (kernel - 1): crops
    (2, 6, 6, 1, 1, 0, 0, 1, 3, True, True),  # 1x1, depthwise-like groups
    (3, 4, 2, 2, 2, (1, 0, 1), (1, 0, 0), (1, 2, 1), 2, True, True),
]


@pytest.mark.parametrize("nd, cin, cout, k, stride, pad, opad, dil, groups, bias, batched", _CONV_T)
def test_conv_transpose_forward_backward(nd, cin, cout, k, stride, pad, opad, dil, groups, bias, batched):
    """ConvTranspose1d/2d/3d against CPU eager: output and gradients w.r.t. input, weight and bias."""
    torch.manual_seed(0)
    cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[nd]
    cpu = cls(cin, cout, k, stride, pad, opad, groups, bias, dil)
    dev = cls(cin, cout, k, stride, pad, opad, groups, bias, dil)
    dev.load_state_dict(cpu.state_dict())
    dev.to("xla")
    x = torch.randn(((2,) if batched else ()) + (cin,) + (5, 4, 3)[:nd], requires_grad=True)
    out = cpu(x)
    cot = torch.randn(out.shape)
    want = torch.autograd.grad(out, [x, *cpu.parameters()], cot)
    xx = x.detach().to("xla").requires_grad_()
    xout = dev(xx)
    got = torch.autograd.grad(xout, [xx, *dev.parameters()], cot.to("xla"))
    xm.mark_step()
    assert xout.shape == out.shape
    torch.testing.assert_close(xout.cpu(), out.detach(), atol=1e-5, rtol=1e-5)
    for name, g, w in zip(["input", "weight", "bias"], got, want):
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"grad {n}: {m}")
    assert not _fallbacks()


@pytest.mark.parametrize("cls", ["GRU", "LSTM", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_layers_equal_cpu_forward_and_backward(cls, bias):
    # On the xla device ATen's recurrent layers call the fused cells it uses on accelerators
    # (_thnn_fused_lstm_cell / _thnn_fused_gru_cell and their backward ops): lowered, not CPU.
    import xlatorch.debug.metrics as met

    torch.manual_seed(0)
    layer = getattr(torch.nn, cls)(4, 8, bias=bias, **({"num_layers": 2} if not cls.endswith("Cell") else {}))
    x = torch.randn(5, 3, 4) if not cls.endswith("Cell") else torch.randn(3, 4)
    outs = []
    for device in ("cpu", "xla"):
        m = layer.to(device)
        for p in m.parameters():
            p.grad = None
        xi = x.detach().clone().to(device).requires_grad_()
        y = m(xi)
        y = y[0] if isinstance(y, tuple) else y
        (y * torch.arange(y.numel(), device=device).reshape(y.shape).sin()).sum().backward()
        outs.append([t.detach().cpu() for t in [y, xi.grad, *(p.grad for p in m.parameters())]])
    # Sigmoids and tanhs over 5 steps of 8 features: float32 rounding, not amplified.
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not [op for op in met.executed_fallback_ops() if "thnn" in op or "rnn" in op]


# (spatial dims, kernel, stride, padding, dilation, ceil_mode): the window geometries of max pools,
# overlapping or not, padded, dilated, with ceil_mode's partial last window.
_MAX_POOLS = [
    (1, 3, 2, 1, 1, True),
    (2, 2, 2, 0, 1, False),
    (2, 3, 2, 1, 1, False),
    (2, (3, 2), (1, 2), (1, 0), (2, 1), True),
    (2, 5, 5, 2, 1, False),  # 25 taps
    (2, 6, 6, 3, 1, True),  # 36 taps: a (value, index) window reduction
    (3, 2, 2, 1, 1, True),
    (3, 3, 2, 1, (1, 2, 1), False),
]


@pytest.mark.parametrize("nd, k, stride, pad, dil, ceil", _MAX_POOLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool_values_indices_and_gradient_equal_cpu(nd, k, stride, pad, dil, ceil, dtype):
    """max_pool1d/2d/3d with indices against CPU eager, exactly: values (signed zeros too) and
    indices where windows hold ties, -inf, NaNs (the last NaN wins) and negative zeros, and
    the input's gradient."""
    torch.manual_seed(0)
    shape = (2, 3) + (9, 8, 7)[:nd]
    x = torch.randint(-2, 3, shape).to(dtype)  # few distinct values: many ties
    flat = x.view(-1)
    n = flat.numel()
    flat[torch.randperm(n)[: n // 6]] = float("nan")  # windows with several NaNs
    flat[torch.randperm(n)[: n // 8]] = float("-inf")
    flat[torch.randperm(n)[: n // 8]] = -0.0
    flat[: (9, 8, 7)[nd - 1]] = float("-inf")  # a whole row of -inf: windows with padding and -inf only
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    xc = x.clone().requires_grad_()
    out, idx = pool(xc, k, stride, pad, dil, ceil_mode=ceil, return_indices=True)
    cot = torch.randn(out.shape).to(dtype)
    (want,) = torch.autograd.grad(out, xc, cot)
    xx = x.to("xla").requires_grad_()
    xout, xidx = pool(xx, k, stride, pad, dil, ceil_mode=ceil, return_indices=True)
    (got,) = torch.autograd.grad(xout, xx, cot.to("xla"))
    xm.mark_step()
    torch.testing.assert_close(xidx.cpu(), idx, atol=0, rtol=0)
    torch.testing.assert_close(xout.cpu(), out.detach(), atol=0, rtol=0, equal_nan=True)
    assert torch.equal(torch.signbit(xout.cpu()), torch.signbit(out.detach()))
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0, equal_nan=True)
    assert not _fallbacks()


def _t(*shape, dtype=torch.float32):
    return lambda d: torch.ones(*shape, dtype=dtype, device=d)


_F64, _BF16 = torch.float64, torch.bfloat16

# Programs CPU refuses whose shapes and dtypes PyTorch's meta kernels (the device's avals)
# take: matrices of two dtypes (the device promoted them), a convolution's negative padding or
# too-large output padding (the device padded by it), norm parameters of another dtype.
_REFUSED_NN = {
    "bucketize(2-d boundaries)": lambda d: torch.bucketize(_t(3)(d), _t(2, 2)(d)),
    "as_strided_scatter past the storage": lambda d: torch.as_strided_scatter(_t(4)(d), _t(3)(d), (3,), (2,)),
    "mm(float, double)": lambda d: torch.mm(_t(2, 3)(d), _t(3, 2, dtype=_F64)(d)),
    "mm(float, bfloat16)": lambda d: torch.mm(_t(2, 3)(d), _t(3, 2, dtype=_BF16)(d)),
    "mm(long, float)": lambda d: torch.mm(_t(2, 3, dtype=torch.long)(d), _t(3, 2)(d)),
    "matmul(float, double)": lambda d: torch.matmul(_t(4, 2, 3)(d), _t(3, 2, dtype=_F64)(d)),
    "linear(double weight)": lambda d: F.linear(_t(2, 3)(d), _t(4, 3, dtype=_F64)(d)),
    "linear(double bias)": lambda d: F.linear(_t(5, 2, 3)(d), _t(4, 3)(d), _t(4, dtype=_F64)(d)),
    "addmm(double self)": lambda d: torch.addmm(_t(2, 2, dtype=_F64)(d), _t(2, 3)(d), _t(3, 2)(d)),
    "addmm(double mat1)": lambda d: torch.addmm(_t(2, 2)(d), _t(2, 3, dtype=_F64)(d), _t(3, 2)(d)),
    "mv(float, double)": lambda d: torch.mv(_t(2, 3)(d), _t(3, dtype=_F64)(d)),
    "addmv(double vec)": lambda d: torch.addmv(_t(2)(d), _t(2, 3)(d), _t(3, dtype=_F64)(d)),
    "conv2d(double input)": lambda d: F.conv2d(_t(1, 2, 5, 5, dtype=_F64)(d), _t(2, 2, 2, 2)(d)),
    "conv1d(double weight)": lambda d: F.conv1d(_t(1, 2, 5)(d), _t(2, 2, 2, dtype=_F64)(d)),
    "conv_transpose2d(double input)": lambda d: F.conv_transpose2d(_t(1, 2, 5, 5, dtype=_F64)(d), _t(2, 2, 2, 2)(d)),
    "conv2d(padding=-1)": lambda d: F.conv2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), padding=-1),
    "conv3d(padding=-1)": lambda d: F.conv3d(_t(1, 1, 4, 4, 4)(d), _t(1, 1, 2, 2, 2)(d), padding=-1),
    "conv2d(stride=0)": lambda d: F.conv2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), stride=0),
    "conv2d(dilation=0)": lambda d: F.conv2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), dilation=0),
    "conv1d(dilation=0)": lambda d: F.conv1d(_t(1, 2, 5)(d), _t(2, 2, 2)(d), dilation=0),
    "conv2d(dilation=-1)": lambda d: F.conv2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), dilation=-1),
    "conv_transpose2d(dilation=0)": lambda d: F.conv_transpose2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), dilation=0),
    "conv2d(groups=3)": lambda d: F.conv2d(_t(1, 6, 5, 5)(d), _t(4, 2, 2, 2)(d), groups=3),
    "conv2d(bias of 3)": lambda d: F.conv2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), _t(3)(d)),
    "conv_transpose2d(padding=-1)": lambda d: F.conv_transpose2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), padding=-1),
    "conv_transpose2d(output_padding=-1)": lambda d: F.conv_transpose2d(
        _t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), stride=2, output_padding=-1
    ),
    "conv_transpose2d(output_padding=stride)": lambda d: F.conv_transpose2d(
        _t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), stride=2, output_padding=2
    ),
    "conv_transpose1d(output_padding=stride)": lambda d: F.conv_transpose1d(
        _t(1, 2, 5)(d), _t(2, 2, 2)(d), stride=2, output_padding=2
    ),
    "conv_transpose3d(output_padding=stride)": lambda d: F.conv_transpose3d(
        _t(1, 2, 3, 3, 3)(d), _t(2, 2, 2, 2, 2)(d), stride=2, output_padding=2
    ),
    "conv_transpose2d(bias of 3)": lambda d: F.conv_transpose2d(_t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), _t(3)(d)),
    "layer_norm(double weight)": lambda d: F.layer_norm(_t(2, 3)(d), (3,), _t(3, dtype=_F64)(d)),
    "layer_norm(double input)": lambda d: F.layer_norm(_t(2, 3, dtype=_F64)(d), (3,), _t(3)(d), _t(3)(d)),
    "layer_norm(float weight, double bias)": lambda d: F.layer_norm(_t(2, 3)(d), (3,), _t(3)(d), _t(3, dtype=_F64)(d)),
    "group_norm(double weight)": lambda d: F.group_norm(_t(2, 4, 3)(d), 2, _t(4, dtype=_F64)(d)),
    "batch_norm eval(double stats)": lambda d: F.batch_norm(
        _t(2, 3)(d), _t(3, dtype=_F64)(d), _t(3, dtype=_F64)(d), training=False
    ),
    "batch_norm train(double stats)": lambda d: F.batch_norm(
        _t(2, 3)(d), _t(3, dtype=_F64)(d), _t(3, dtype=_F64)(d), training=True
    ),
    "batch_norm train(double weight)": lambda d: F.batch_norm(
        _t(2, 3)(d), None, None, _t(3, dtype=_F64)(d), training=True
    ),
}

# ... and the ones CPU takes, with CPU's values: a bfloat16 input beside float32 norm
# parameters (CPU's "mixed" kernels), an output padding below the dilation
_TAKEN_NN = {
    "layer_norm(bfloat16, float32 weight)": lambda d: F.layer_norm(
        torch.arange(6.0, device=d).reshape(2, 3).to(_BF16), (3,), _t(3)(d), _t(3)(d)
    ),
    "group_norm(bfloat16, float32 weight)": lambda d: F.group_norm(
        torch.arange(24.0, device=d).reshape(2, 4, 3).to(_BF16), 2, _t(4)(d)
    ),
    "batch_norm eval(bfloat16, float32 stats)": lambda d: F.batch_norm(
        torch.arange(6.0, device=d).reshape(2, 3).to(_BF16), _t(3)(d), _t(3)(d), training=False
    ),
    "conv_transpose2d(output_padding < dilation)": lambda d: F.conv_transpose2d(
        _t(1, 2, 5, 5)(d), _t(2, 2, 2, 2)(d), dilation=3, output_padding=2
    ),
    "linear(bias)": lambda d: F.linear(torch.arange(6.0, device=d).reshape(2, 3), _t(4, 3)(d), _t(4)(d)),
    "conv2d(bfloat16)": lambda d: F.conv2d(_t(1, 2, 5, 5, dtype=_BF16)(d), _t(2, 2, 2, 2, dtype=_BF16)(d)),
}


@pytest.mark.parametrize("name", sorted(_REFUSED_NN))
def test_what_cpu_refuses_raises_on_the_device_with_its_message(name):
    refused_as_on_cpu(_REFUSED_NN[name], at_call=True)


@pytest.mark.parametrize("name", sorted(_TAKEN_NN))
def test_what_cpu_takes_runs_on_the_device_as_on_cpu(name):
    runs_as_on_cpu(_TAKEN_NN[name], atol=1e-2, rtol=1e-2)  # bfloat16 results: one rounding apart
    assert met.executed_fallback_ops() == []


# Dtypes CPU's kernels have no implementation for (ops.yaml refuse_dtypes): the device gave
# integer values of float math (softmax of int64: zeros), or compared complex numbers.
_NO_KERNEL = {
    "softmax(int64)": lambda d: F.softmax(torch.arange(3, device=d), 0),
    "log_softmax(int32)": lambda d: F.log_softmax(torch.arange(3, dtype=torch.int32, device=d), 0),
    "gelu(int64)": lambda d: F.gelu(torch.arange(3, device=d)),
    "silu(uint8)": lambda d: F.silu(torch.arange(3, dtype=torch.uint8, device=d)),
    "std(int64)": lambda d: torch.arange(3, device=d).std(),
    "relu(bool)": lambda d: F.relu(torch.ones(3, dtype=torch.bool, device=d)),
    "abs(bool)": lambda d: torch.ones(3, dtype=torch.bool, device=d).abs(),
    "mm(bool)": lambda d: torch.ones(2, 2, dtype=torch.bool, device=d).mm(torch.ones(2, 2, dtype=torch.bool, device=d)),
    "maximum(complex)": lambda d: torch.maximum(
        torch.ones(2, dtype=torch.cfloat, device=d), torch.ones(2, dtype=torch.cfloat, device=d)
    ),
    "complex >= 0": lambda d: torch.ones(2, dtype=torch.cfloat, device=d) >= 0,
    "clamp_min(complex, 0)": lambda d: torch.clamp_min(torch.ones(2, dtype=torch.cfloat, device=d), 0),
    "topk(complex)": lambda d: torch.ones(3, dtype=torch.cfloat, device=d).topk(1),
    "interpolate(int64)": lambda d: F.interpolate(
        torch.ones(1, 1, 2, 2, dtype=torch.long, device=d), scale_factor=2, mode="bilinear"
    ),
    "hypot(int64, int64)": lambda d: torch.hypot(torch.arange(3, device=d), torch.arange(3, device=d)),
    "randint_like(int8, 1000)": lambda d: torch.randint_like(torch.ones(3, dtype=torch.int8, device=d), 1000),
    "arange(bool)": lambda d: torch.arange(3, dtype=torch.bool, device=d),
}

# ... and the mixed-dtype calls CPU takes: the kernel runs in the promoted dtype
_KERNEL = {
    "hypot(int64, float32)": lambda d: torch.hypot(torch.arange(3, device=d), torch.ones(3, device=d)),
    "hypot(int64, 2.5)": lambda d: torch.hypot(torch.arange(3, device=d), torch.tensor(2.5, device=d)),
    "maximum(int64, float32)": lambda d: torch.maximum(torch.arange(3, device=d), torch.ones(3, device=d)),
    "softmax(int64, dtype=float32)": lambda d: F.softmax(torch.arange(3, device=d), 0, dtype=torch.float32),
    "randint_like(int16, 1000) shape": lambda d: torch.randint_like(torch.ones(3, dtype=torch.int16, device=d), 1000)
    < 1000,
    "cumsum(bool) gives int64": lambda d: torch.cumsum(torch.tensor([True, False, True], device=d), 0),
    "lerp(float16)": lambda d: torch.lerp(
        torch.zeros(3, dtype=torch.half, device=d), torch.ones(3, dtype=torch.half, device=d), 0.5
    ),
}


# Where CPU's kernel for a dtype depends on the arguments (a dilated or transposed convolution
# of int32 has none, an undilated one has), or where CPU runs no kernel at all (an empty result,
# a 0-d input it returns): the device refuses exactly what CPU refuses.
_I32 = torch.int32


def _ints(*shape, dtype=_I32):
    return lambda d: torch.arange(math.prod(shape), device=d).reshape(shape).remainder(5).to(dtype)


def _index_reduce(dtype, reduce, include_self):
    def program(d):
        x = torch.arange(25, device=d).reshape(5, 5).remainder(3).to(dtype)
        src = torch.arange(50, device=d).reshape(5, 10).remainder(4).to(dtype)
        return x.index_reduce(1, torch.arange(10, device=d).remainder(5), src, reduce, include_self=include_self)

    return program


_B = torch.bool
_NO_KERNEL |= {
    "conv2d(int32, dilation=2)": lambda d: F.conv2d(_ints(1, 2, 6, 6)(d), _ints(2, 2, 2, 2)(d), dilation=2),
    "conv_transpose2d(int32)": lambda d: F.conv_transpose2d(_ints(1, 2, 6, 6)(d), _ints(2, 2, 2, 2)(d)),
    "conv1d(bool)": lambda d: F.conv1d(_ints(1, 2, 6, dtype=_B)(d), _ints(2, 2, 2, dtype=_B)(d)),
    "conv3d(int16)": lambda d: F.conv3d(
        _ints(1, 2, 4, 4, 4, dtype=torch.int16)(d), _ints(2, 2, 2, 2, 2, dtype=torch.int16)(d), dilation=2
    ),
    "clamp(bool, bool min, bool max)": lambda d: torch.clamp(
        _ints(3, dtype=_B)(d), _ints(3, dtype=_B)(d), _ints(3, dtype=_B)(d)
    ),
    "clamp(complex, complex min)": lambda d: torch.clamp(
        _ints(3, dtype=torch.cfloat)(d), min=_ints(3, dtype=torch.cfloat)(d)
    ),
    "index_reduce(bool, mean)": _index_reduce(_B, "mean", True),
    "index_reduce(bool, amax, include_self=False)": _index_reduce(_B, "amax", False),
    "index_reduce(complex, amin)": _index_reduce(torch.cfloat, "amin", True),
    "index_reduce(1-d bool, amax)": lambda d: torch.ones(5, dtype=_B, device=d).index_reduce(
        0, torch.zeros(1, dtype=torch.long, device=d), torch.ones(1, dtype=_B, device=d), "amax"
    ),
    "kthvalue(bool 1-d)": lambda d: torch.ones(1, dtype=_B, device=d).kthvalue(1)[0],
    "linspace(bool, 3 steps)": lambda d: torch.linspace(0, 1, 3, dtype=_B, device=d),
    "bucketize(bool, empty boundaries)": lambda d: torch.bucketize(_ints(3, dtype=_B)(d), _ints(0, dtype=_B)(d)),
    # sibling kernels a first sample does not reach (a 2-d pad, a tensor weight, nearest in 2-d)
    "interpolate(int64, nearest, 2-d)": lambda d: F.interpolate(_ints(1, 1, 2, 2, dtype=torch.long)(d), scale_factor=2),
    "pad(bool, reflect, 2-d)": lambda d: F.pad(_ints(1, 1, 3, 3, dtype=_B)(d), (1, 1, 1, 1), mode="reflect"),
    "pad(bool, replicate, 1-d)": lambda d: F.pad(_ints(1, 1, 3, dtype=_B)(d), (1, 1), mode="replicate"),
    "searchsorted(bool, True)": lambda d: torch.searchsorted(_ints(3, dtype=_B)(d), True),
    "cumprod(bool, dtype=bool)": lambda d: torch.cumprod(_ints(3, dtype=_B)(d), 0, dtype=_B),
    "lerp(int64, int64 weight)": lambda d: torch.lerp(
        _ints(3, dtype=torch.long)(d), _ints(3, dtype=torch.long)(d), _ints(3, dtype=torch.long)(d)
    ),
    "nll_loss(int64, 2-d)": lambda d: F.nll_loss(
        _ints(2, 3, 2, 2, dtype=torch.long)(d), _ints(2, 2, 2, dtype=torch.long)(d) % 3
    ),
    "embedding(int64 weight, max_norm)": lambda d: F.embedding(
        _ints(2, dtype=torch.long)(d), _ints(5, 3, dtype=torch.long)(d), max_norm=1.0
    ),
    "linspace(tensor ends, bool)": lambda d: torch.linspace(
        torch.tensor(0, device=d), torch.tensor(1, device=d), 3, dtype=_B
    ),
}
_KERNEL |= {
    "conv2d(int32)": lambda d: F.conv2d(_ints(1, 2, 6, 6)(d), _ints(2, 2, 2, 2)(d), stride=2),
    "conv1d(uint8, groups=2)": lambda d: F.conv1d(
        _ints(1, 2, 6, dtype=torch.uint8)(d), _ints(2, 1, 2, dtype=torch.uint8)(d), groups=2
    ),
    "conv3d(int64, dilation=2)": lambda d: F.conv3d(
        _ints(1, 2, 5, 5, 5, dtype=torch.long)(d), _ints(2, 2, 2, 2, 2, dtype=torch.long)(d), dilation=2
    ),
    "conv2d(bool, empty batch)": lambda d: F.conv2d(_ints(0, 2, 6, 6, dtype=_B)(d), _ints(2, 2, 2, 2, dtype=_B)(d)),
    "clamp(bool, bool min)": lambda d: torch.clamp(_ints(3, dtype=_B)(d), min=_ints(3, dtype=_B)(d)),
    "clamp(bool, float min, float max)": lambda d: torch.clamp(_ints(3, dtype=_B)(d), _t(3)(d), _t(3)(d)),
    "index_reduce(bool, amax)": _index_reduce(_B, "amax", True),
    "index_reduce(bool, prod)": _index_reduce(_B, "prod", True),
    "index_reduce(complex, mean)": _index_reduce(torch.cfloat, "mean", True),
    "kthvalue(0-d bool)": lambda d: torch.tensor(True, device=d).kthvalue(1)[0],
    "mode(0-d complex)": lambda d: torch.tensor(1 + 2j, device=d).mode()[0],
    "cummax(0-d complex)": lambda d: torch.tensor(1 + 2j, device=d).cummax(0)[0],
    "softmax(int64, empty)": lambda d: F.softmax(_ints(2, 0, dtype=torch.long)(d), -1),
    "mm(bool, no rows)": lambda d: torch.mm(_ints(0, 5, dtype=_B)(d), _ints(5, 10, dtype=_B)(d)),
    "linspace(bool, 1 step)": lambda d: torch.linspace(0, 1, 1, dtype=_B, device=d),
    "bucketize(bool, empty input)": lambda d: torch.bucketize(_ints(0, dtype=_B)(d), _ints(3, dtype=_B)(d)),
    "lu_factor_ex(int64, empty batch)": lambda d: torch.linalg.lu_factor_ex(_ints(0, 3, 3, dtype=torch.long)(d))[0],
    "interpolate(uint8, nearest, 2-d)": lambda d: F.interpolate(
        _ints(1, 1, 2, 2, dtype=torch.uint8)(d), scale_factor=2
    ),
    "searchsorted(bool, no values)": lambda d: torch.searchsorted(_ints(3, dtype=_B)(d), _ints(0, dtype=_B)(d)),
    "cumprod(bool) gives int64": lambda d: torch.cumprod(_ints(3, dtype=_B)(d), 0),
    "embedding(complex weight, max_norm)": lambda d: F.embedding(
        _ints(2, dtype=torch.long)(d), _ints(5, 3, dtype=torch.cfloat)(d), max_norm=10.0
    ),
}


# Dtypes outside int64 / bool / complex64 (floats for bitwise ops) and complex special
# functions: JAX refused them at the sync, in its own words.
_NO_KERNEL |= {
    "bitwise_and(float64)": lambda d: torch.bitwise_and(_t(3, dtype=_F64)(d), _t(3, dtype=_F64)(d)),
    "bitwise_left_shift(bool)": lambda d: torch.bitwise_left_shift(_ints(3, dtype=_B)(d), _ints(3, dtype=_B)(d)),
    "erf(complex)": lambda d: torch.erf(_ints(3, dtype=torch.cfloat)(d)),
    "polygamma(2, complex)": lambda d: torch.polygamma(2, _ints(3, dtype=torch.cfloat)(d)),
    "max_pool3d(bool)": lambda d: F.max_pool3d(_ints(1, 1, 2, 2, 2, dtype=_B)(d), 2),
    "cross(bool)": lambda d: torch.linalg.cross(_ints(2, 3, dtype=_B)(d), _ints(2, 3, dtype=_B)(d)),
    "bernoulli(int32)": lambda d: torch.bernoulli(_ints(3)(d)),
}
_KERNEL |= {
    "bernoulli(int64, empty)": lambda d: torch.bernoulli(_ints(0, 3, dtype=torch.long)(d)),
    "polygamma(1, bool)": lambda d: torch.polygamma(1, _ints(3, dtype=_B)(d) | True),
}


@pytest.mark.parametrize("name", sorted(_NO_KERNEL))
def test_a_dtype_cpu_has_no_kernel_for_is_refused_at_the_call(name):
    refused_as_on_cpu(_NO_KERNEL[name], at_call=True)


@pytest.mark.parametrize("name", sorted(_KERNEL))
def test_a_dtype_cpu_runs_in_is_not_refused(name):
    runs_as_on_cpu(_KERNEL[name], atol=1e-5, rtol=1.3e-6)


# out= tensors of a dtype CPU refuses, which the out= overloads' meta kernels take (ops.yaml
# validate_out): the device wrote converted values.
_OUT = {
    "all(out=float)": lambda d: torch.all(_t(3)(d), out=torch.empty((), device=d)),
    "any(dim, out=long)": lambda d: torch.any(_t(3, 1)(d), 0, out=torch.empty(1, dtype=torch.long, device=d)),
    "isin(out=uint8)": lambda d: torch.isin(_t(3)(d), _t(3)(d), out=torch.empty(3, dtype=torch.uint8, device=d)),
    "aminmax(out=double)": lambda d: torch.aminmax(_t(3)(d), out=(_t((), dtype=_F64)(d), _t((), dtype=_F64)(d))),
    "bucketize(out=int32)": lambda d: torch.bucketize(
        _t(3)(d), _t(3)(d), out=torch.empty(3, dtype=torch.int32, device=d)
    ),
    "solve_triangular(out=double)": lambda d: torch.linalg.solve_triangular(
        torch.eye(2, device=d), _t(2, 2)(d), upper=True, out=_t(2, 2, dtype=_F64)(d)
    ),
    "normal(out=long)": lambda d: torch.normal(_t(3)(d), _t(3)(d), out=torch.empty(3, dtype=torch.long, device=d)),
    # Valid probabilities: only the out= dtype is wrong (the check of the values passes).
    "multinomial(out=double)": lambda d: torch.multinomial(
        torch.ones(1, 2, dtype=_F64, device=d), 2, out=_t(1, 2, dtype=_F64)(d)
    ),
}


@pytest.mark.parametrize("name", sorted(_OUT))
def test_an_out_of_a_dtype_cpu_refuses_raises_at_the_call(name):
    refused_as_on_cpu(_OUT[name], at_call=True)


_OUT_TAKEN = {
    "all(out=uint8)": lambda d: torch.all(_t(3)(d), out=torch.empty((), dtype=torch.uint8, device=d)),
    "bucketize(out_int32, out=int32)": lambda d: torch.bucketize(
        _t(3)(d), _t(3)(d), out_int32=True, out=torch.empty(3, dtype=torch.int32, device=d)
    ),
    "isin(out=bool)": lambda d: torch.isin(_t(3)(d), _t(3)(d), out=torch.empty(3, dtype=torch.bool, device=d)),
}


# No dtype given: CPU computes in the out='s dtype (each float cast to int64 first: the sum of
# [1.5, 2.5, 3.7] into an int64 out= is 6, where the device summed in float32 and gave 7).
_F = lambda d: torch.tensor([1.5, 2.5, 3.7, -0.6], device=d)  # noqa: E731
_OUT_COMPUTES = {
    "sum(float, out=long)": lambda d: torch.sum(_F(d), 0, out=torch.empty((), dtype=torch.long, device=d)),
    "cumsum(float, out=long)": lambda d: torch.cumsum(_F(d), 0, out=torch.empty(4, dtype=torch.long, device=d)),
    "prod(float, out=long)": lambda d: torch.prod(_F(d), 0, out=torch.empty((), dtype=torch.long, device=d)),
    "sum(float, out=bool)": lambda d: torch.sum(  # each element cast to bool first: 0.5 - 0.5 is True
        torch.tensor([0.5, -0.5], device=d), 0, out=torch.empty((), dtype=torch.bool, device=d)
    ),
    "cumprod(float, out=int32)": lambda d: torch.cumprod(_F(d), 0, out=torch.empty(4, dtype=torch.int32, device=d)),
    # float32 values averaged in float64: within float64's rounding of CPU's, not float32's
    "mean(float, out=double)": lambda d: torch.mean(
        torch.tensor([0.1, 0.2, 0.7, 1 / 3], device=d), 0, out=torch.empty((), dtype=_F64, device=d)
    ),
}


@pytest.mark.parametrize("name", sorted(_OUT_COMPUTES))
def test_an_out_of_another_dtype_is_computed_in_its_dtype(name):
    runs_as_on_cpu(_OUT_COMPUTES[name], atol=0, rtol=1e-15)


@pytest.mark.parametrize("name", sorted(_OUT_TAKEN))
def test_an_out_of_a_dtype_cpu_takes_still_runs(name):
    runs_as_on_cpu(_OUT_TAKEN[name])
    assert torch.normal(_t(3)("xla"), 1.0, out=torch.empty(3, dtype=_F64, device="xla")).dtype == _F64
