"""PyTorch's Transformer inference fast path on the device, against CPU eager.

In eval mode under ``torch.no_grad()``, ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` call fused ops (``_transformer_encoder_layer_fwd``,
``_native_multi_head_attention``) that fell back to CPU: each module here is built on CPU,
copied to the device, and must give CPU's results with no fallback. The small ops they reach
(``_masked_softmax`` and its backward, ``_transform_bias_rescale_qkv``, ``_addmm_activation``,
``_add_relu``) and ``unfold_backward``, ``_is_all_true`` / ``_is_any_true`` are checked directly.

Tolerances: float32 results of a few matmuls, softmax and layer norms over 16-32 features;
XLA's and CPU's accumulation orders differ by a few float32 roundings per dot product, which
layer norm (dividing by a standard deviation near 1) does not amplify: 1e-5. Half floats: one
rounding of the result (bfloat16: 2**-8 relative).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met

aten = torch.ops.aten
DEV = xm.xla_device()
TOL = dict(atol=1e-5, rtol=1e-5)


def _fallbacks():
    return [n for n in met.executed_fallback_ops() if n.startswith("aten::")]


def _dev(a):
    return a.to(DEV) if isinstance(a, torch.Tensor) else a


def _on_device(fn, *args, **kwargs):
    """``fn`` of ``args`` moved to the device, results back on CPU, with no fallback."""
    met.clear_counters()
    res = fn(*[_dev(a) for a in args], **{k: _dev(v) for k, v in kwargs.items()})
    res = tuple(r.cpu() for r in res) if isinstance(res, tuple) else res.cpu()
    assert _fallbacks() == []
    return res


def _padding_mask():
    # batch 0 unpadded, 1 and 2 right-padded (left-aligned: what the nested path accepts)
    return torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])


# each value of each option at least once (every combination costs a compile of its own)
@pytest.mark.parametrize(
    "batch_first,norm_first,activation",
    [(True, False, "relu"), (True, True, "gelu"), (False, False, "gelu"), (False, True, "relu")],
)
def test_encoder_matches_cpu(batch_first, norm_first, activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=batch_first, norm_first=norm_first,
                                       activation=activation)  # fmt: skip
    cpu = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    dev = copy.deepcopy(cpu).to(DEV)
    x = torch.randn(3, 5, 16) if batch_first else torch.randn(5, 3, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        for kwargs in ({}, {"src_key_padding_mask": _padding_mask()}, {"mask": causal}):
            want = cpu(x, **kwargs)
            met.clear_counters()
            got = dev(x.to(DEV), **{k: v.to(DEV) for k, v in kwargs.items()}).cpu()
            assert _fallbacks() == []
            torch.testing.assert_close(got, want, **TOL)


def test_encoder_layer_calls_the_fused_op():
    """The fast path is taken (the op is lowered, not merely avoided)."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval().to(DEV)
    seen = []
    orig = torch._transformer_encoder_layer_fwd

    def spy(*args):
        seen.append(1)
        return orig(*args)

    torch._transformer_encoder_layer_fwd = spy
    try:
        with torch.no_grad():
            layer(torch.randn(2, 3, 16).to(DEV)).cpu()
    finally:
        torch._transformer_encoder_layer_fwd = orig
    assert seen


def test_encoder_bfloat16_matches_cpu():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, activation="gelu")
    cpu = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval().bfloat16()
    dev = copy.deepcopy(cpu).to(DEV)
    x = torch.randn(3, 5, 16).bfloat16()
    with torch.no_grad():
        want = cpu(x, src_key_padding_mask=_padding_mask())
        got = _on_device(dev, x, src_key_padding_mask=_padding_mask())
    # A bfloat16 rounding (2**-8) of an intermediate can move a layer norm's output by a few of
    # them: outputs are of magnitude ~2.
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_nested_tensor_path_refused_with_advice():
    """enable_nested_tensor=True (the default) with a padding mask makes a nested tensor on
    CPU; the device refuses it, naming enable_nested_tensor=False, whose output is CPU's nested
    path's with the padded positions zeroed."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    cpu = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    dense = copy.deepcopy(cpu)
    dense.use_nested_tensor = False  # what enable_nested_tensor=False sets
    dev = copy.deepcopy(dense).to(DEV)
    nested_dev = copy.deepcopy(cpu).to(DEV)
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="enable_nested_tensor=False"):
            nested_dev(x.to(DEV), src_key_padding_mask=mask.to(DEV))
        want = cpu(x, src_key_padding_mask=mask)
        got = dev(x.to(DEV), src_key_padding_mask=mask.to(DEV)).cpu()
        # without a mask the nested path is not taken: the default encoder runs here
        torch.testing.assert_close(_on_device(nested_dev, x), cpu(x), **TOL)
    torch.testing.assert_close(got.masked_fill(mask.unsqueeze(-1), 0), want, **TOL)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("average", [True, False])
def test_multihead_attention_matches_cpu(need_weights, average):
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    dev = copy.deepcopy(cpu).to(DEV)
    x = torch.randn(3, 5, 16)
    attn_mask = torch.rand(5, 5) > 0.6
    attn_mask[:, 0] = False  # every query sees a key (a row all masked is NaN on CPU: below)
    with torch.no_grad():
        for kpm, am in ((None, None), (_padding_mask(), None), (None, attn_mask), (_padding_mask(), attn_mask)):
            want = cpu(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights,
                       average_attn_weights=average)  # fmt: skip
            xd = x.to(DEV)  # query, key and value the same tensor: the fast path's condition
            met.clear_counters()
            got = dev(xd, xd, xd, key_padding_mask=None if kpm is None else kpm.to(DEV),
                      attn_mask=None if am is None else am.to(DEV), need_weights=need_weights,
                      average_attn_weights=average)  # fmt: skip
            assert _fallbacks() == []
            torch.testing.assert_close(got[0].cpu(), want[0], **TOL)
            if need_weights:
                torch.testing.assert_close(got[1].cpu(), want[1], **TOL)
            else:  # CPU's kernel returns no weights (runtime/device.py; the meta kernel says empty)
                assert want[1] is None and got[1] is None


def test_multihead_attention_fully_masked_rows_are_nan_as_on_cpu():
    cpu = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    dev = copy.deepcopy(cpu).to(DEV)
    x = torch.randn(2, 3, 8)
    kpm = torch.tensor([[True, True, True], [False, True, False]])  # batch 0: every key padded
    with torch.no_grad():
        want = cpu(x, x, x, key_padding_mask=kpm)
        xd = x.to(DEV)
        got = _on_device(lambda *a, **k: dev(*a, **k), xd, xd, xd, key_padding_mask=kpm)
    assert want[0][0].isnan().all() and not want[0][1].isnan().any()
    torch.testing.assert_close(got[0], want[0], equal_nan=True, **TOL)
    torch.testing.assert_close(got[1], want[1], equal_nan=True, **TOL)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_cpu(norm_first):
    """nn.TransformerDecoderLayer has no fused fast path: its eager ops, no fallback."""
    torch.manual_seed(0)
    cpu = nn.TransformerDecoderLayer(16, 4, 32, batch_first=True, norm_first=norm_first).eval()
    dev = copy.deepcopy(cpu).to(DEV)
    tgt, memory = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    with torch.no_grad():
        want = cpu(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
        got = _on_device(lambda t, m, c: dev(t, m, tgt_mask=c, tgt_is_causal=True), tgt, memory, causal)
    torch.testing.assert_close(got, want, **TOL)


# --- the ops they reach -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "mask_shape,dim,mask_type",
    [((2, 4), -1, 1), ((2, 4), 2, 1), ((4, 4), 3, 0), ((4, 4), None, 0), ((2, 3, 4, 4), 1, 2), ((2, 3, 4, 4), 3, None)],
)
def test_masked_softmax_matches_cpu(dtype, mask_shape, dim, mask_type):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4, dtype=dtype)
    mask = torch.rand(mask_shape) > 0.5
    if len(mask_shape) == 2:
        mask[0] = True  # a row all masked (a batch's keys, or a query's): NaN on CPU
    else:
        mask.movedim(-1 if dim is None else dim, -1)[0, 0, 0] = True
    want = aten._masked_softmax(x, mask, dim, mask_type)
    got = _on_device(aten._masked_softmax, x, mask, dim, mask_type)
    assert want.isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True, **({} if dtype == torch.bfloat16 else TOL))
    g = torch.randn(x.shape, dtype=dtype)
    full = mask if mask.shape == x.shape else torch.rand(x.shape) > 0.5
    y = aten._masked_softmax(x, full, dim, 2)
    d = -1 if dim is None else dim
    want_g = aten._masked_softmax_backward(g, y, full, d)
    got_g = _on_device(aten._masked_softmax_backward, g, y, full, d)
    torch.testing.assert_close(got_g, want_g, equal_nan=True, **({} if dtype == torch.bfloat16 else TOL))


def test_masked_softmax_errors_as_on_cpu():
    x = torch.randn(2, 3, 4, 4)
    for args in ((x, torch.zeros(2, 4), -1, 1), (x, torch.zeros(3, 4, dtype=torch.bool), -1, 2),
                 (x.long(), torch.zeros(2, 4, dtype=torch.bool), -1, 1)):  # fmt: skip
        with pytest.raises((RuntimeError, NotImplementedError)) as cpu_err:
            aten._masked_softmax(*args)
        with pytest.raises(type(cpu_err.value), match=str(cpu_err.value)[:30]):
            aten._masked_softmax(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transform_bias_rescale_qkv_matches_cpu(dtype):
    qkv, bias = torch.randn(2, 5, 36, dtype=dtype), torch.randn(36, dtype=dtype)
    want = aten._transform_bias_rescale_qkv(qkv, bias, 3)
    got = _on_device(aten._transform_bias_rescale_qkv, qkv, bias, 3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)  # one add and one multiply, both exact as on CPU
    with pytest.raises(RuntimeError, match="D % num_head == 0"):
        aten._transform_bias_rescale_qkv(qkv.to(DEV), bias.to(DEV), 5)


@pytest.mark.parametrize("use_gelu", [False, True])
def test_addmm_activation_matches_cpu(use_gelu):
    args = (torch.randn(3, 4), torch.randn(3, 5), torch.randn(5, 4))
    want = aten._addmm_activation(*args, beta=0.5, alpha=2, use_gelu=use_gelu)
    torch.testing.assert_close(_on_device(aten._addmm_activation, *args, beta=0.5, alpha=2, use_gelu=use_gelu),
                               want, **TOL)  # fmt: skip


@pytest.mark.parametrize(
    "a,b,alpha",
    [
        (torch.randn(40), torch.randn(40), 2),
        (torch.randn(40, dtype=torch.float64), 1.5, 1),
        (
            torch.tensor([1, 100, -3], dtype=torch.int8),
            torch.tensor([100, 200, 1], dtype=torch.int16),
            1,
        ),  # clamps to 127
        (torch.tensor([2**30, 5], dtype=torch.int32), torch.tensor([2**30, -9], dtype=torch.int32), 2),  # wraps, then 0
        (torch.tensor([1, -5]), 2.5, 1),  # an integer tensor and a float number: float32
        (torch.tensor([float("inf"), -1.0]), torch.zeros(2), 1),  # inf clamps to float32's largest
    ],
)
def test_add_relu_matches_cpu(a, b, alpha):
    want = aten._add_relu(a, b, alpha=alpha)
    torch.testing.assert_close(_on_device(aten._add_relu, a, b, alpha=alpha), want, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="Unsupported datatype for add_relu:unsigned char"):
        aten._add_relu(torch.ones(2, dtype=torch.uint8).to(DEV), torch.ones(2).to(DEV))


def test_is_all_any_true_and_distribution_validation():
    for t in (torch.tensor([True, False]), torch.tensor([True, True]), torch.zeros(0, dtype=torch.bool)):
        assert _on_device(aten._is_all_true, t).item() == aten._is_all_true(t).item()
        assert _on_device(aten._is_any_true, t).item() == aten._is_any_true(t).item()
    with pytest.raises(RuntimeError, match="kBool"):
        aten._is_all_true(torch.ones(2).to(DEV))
    met.clear_counters()
    d = torch.distributions.Normal(torch.zeros(3).to(DEV), torch.ones(3).to(DEV), validate_args=True)
    d.log_prob(torch.randn(3).to(DEV)).cpu()
    assert _fallbacks() == []
    with pytest.raises(ValueError):
        torch.distributions.Normal(torch.zeros(3).to(DEV), -torch.ones(3).to(DEV), validate_args=True)


@pytest.mark.parametrize("shape,dim,size,step", [((7,), 0, 3, 2), ((4, 9), 1, 2, 4), ((5, 6, 3), 0, 2, 1)])
def test_unfold_backward_matches_cpu(shape, dim, size, step):
    x = torch.randn(shape)
    g = torch.randn(x.unfold(dim, size, step).shape)
    want = aten.unfold_backward(g, list(shape), dim, size, step)
    torch.testing.assert_close(_on_device(aten.unfold_backward, g, list(shape), dim, size, step), want, **TOL)
    xd = x.to(DEV).requires_grad_()
    met.clear_counters()
    (xd.unfold(dim, size, step) * g.to(DEV)).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), want, **TOL)
    assert _fallbacks() == []


def test_multi_head_attention_errors_as_on_cpu():
    """PyTorch's meta kernel checks nothing: the entry's validate raises CPU's errors at the call."""
    q, w, b, p, pb = torch.randn(2, 3, 8), torch.randn(24, 8), torch.randn(24), torch.randn(8, 8), torch.randn(8)
    bad = [
        (q, q, q, 6, 2, torch.randn(18, 6), torch.randn(18), p, pb),  # embed_dim is not query's
        (q, q, q, 8, 3, w, b, p, pb),  # heads do not divide embed_dim
        (q, torch.randn(2, 4, 8), torch.randn(2, 4, 8), 8, 2, w, b, p, pb),
        (q, q, q, 8, 2, torch.randn(16, 8), b, p, pb),
        (q, q, q, 8, 2, w, torch.randn(16), p, pb),
        (q[0], q[0], q[0], 8, 2, w, b, p, pb),
        (q, q, q, 8, 2, w, b, p, pb, torch.zeros(2, 3, dtype=torch.bool)),  # a 2-d mask without its type
        (q, q, q, 8, 2, w, b, p, pb, torch.zeros(3, 3, dtype=torch.bool), True, True, 1),  # not (B, L)
    ]
    for args in bad:
        with pytest.raises(RuntimeError) as cpu_err:
            aten._native_multi_head_attention(*args)
        with pytest.raises(RuntimeError, match=re.escape(str(cpu_err.value))):
            aten._native_multi_head_attention(*[_dev(a) for a in args])
