"""Antialiased resampling and more linear algebra: results vs CPU eager, CPU's errors, and no
CPU fallback (each would cut the graph)."""

import pytest
import torch
import torch.nn.functional as F

import xlatorch.debug.metrics as met
from tests.cpu_twin import refused_as_on_cpu


def _no_fallback(*ops):
    fallen = met.executed_fallback_ops()
    assert not [op for op in fallen if any(op == f"aten::{o}" for o in ops)], fallen


# --- antialiased resampling -------------------------------------------------------------

AA_CASES = [  # (input H, W), interpolate's size / scale_factor, align_corners
    ((32, 40), dict(size=(11, 13)), False),  # downscale: the support widens
    ((32, 40), dict(size=(11, 13)), True),
    ((7, 9), dict(size=(20, 23)), False),  # upscale: the plain filter
    ((7, 9), dict(size=(20, 23)), True),
    ((32, 40), dict(scale_factor=0.37), False),  # explicit scales, not in/out
    ((32, 40), dict(scale_factor=(2.3, 0.5)), False),  # one dim up, one down
    ((32, 40), dict(size=(32, 17)), False),  # the height pass skipped (same size)
    ((7, 9), dict(size=(1, 5)), True),  # align_corners with one output row: scale 0
]


def _image(shape, dtype):
    x = torch.rand(shape, dtype=torch.float64) * 255
    return x.round().to(torch.uint8) if dtype == torch.uint8 else x.to(dtype)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.uint8])
def test_interpolate_antialias_matches_cpu(mode, dtype):
    for hw, kw, ac in AA_CASES:
        x = _image((2, 3) + hw, dtype)
        want = F.interpolate(x, mode=mode, antialias=True, align_corners=ac, **kw)
        met.clear_counters()
        got = F.interpolate(x.to("xla"), mode=mode, antialias=True, align_corners=ac, **kw).cpu()
        _no_fallback(f"_upsample_{mode}2d_aa")
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.uint8:
            # integer arithmetic with the kernel's int16 weights: exact
            assert torch.equal(got, want), (hw, kw, ac)
        else:
            # each output is a normalised weighted sum of at most ~2*support inputs, computed
            # twice (width, then height) in the input's dtype: a few ulps of |values| <= 255
            # (the cubic filter's negative lobes make partial sums no larger than that)
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(got, want, atol=255 * 16 * eps, rtol=16 * eps)


def test_interpolate_antialias_uint8_many_channels_channels_last():
    # CPU's vectorised uint8 kernel takes up to 4 channels, its generic one more: same weights
    x = _image((1, 5, 30, 26), torch.uint8).contiguous(memory_format=torch.channels_last)
    for mode in ("bilinear", "bicubic"):
        want = F.interpolate(x, size=(9, 12), mode=mode, antialias=True)
        got = F.interpolate(x.to("xla"), size=(9, 12), mode=mode, antialias=True).cpu()
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolate_antialias_grad_matches_cpu(mode):
    for hw, kw, ac in AA_CASES[:6]:
        x = torch.rand((2, 3) + hw, dtype=torch.float32)
        g = torch.rand_like(F.interpolate(x, mode=mode, antialias=True, align_corners=ac, **kw))
        xc = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(F.interpolate(xc, mode=mode, antialias=True, align_corners=ac, **kw), xc, g)
        xx = x.to("xla").requires_grad_()
        met.clear_counters()
        y = F.interpolate(xx, mode=mode, antialias=True, align_corners=ac, **kw)
        (got,) = torch.autograd.grad(y, xx, g.to("xla"))
        got = got.cpu()
        _no_fallback(f"_upsample_{mode}2d_aa", f"_upsample_{mode}2d_aa_backward")
        # a sum of grad * weight products over every output an input pixel reaches: float32 rounding
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_aa_backward_same_size_with_scale_uses_the_scale():
    # CPU's forward copies a dim whose size does not change; its backward still weights it by
    # the given scale (in 5, scale_factor 1.1 -> out 5, scale 1/1.1)
    g = torch.rand(1, 2, 5, 6)
    for op in (torch.ops.aten._upsample_bilinear2d_aa_backward, torch.ops.aten._upsample_bicubic2d_aa_backward):
        want = op(g, [5, 6], [1, 2, 5, 9], False, 1.1, 0.7)
        got = op(g.to("xla"), [5, 6], [1, 2, 5, 9], False, 1.1, 0.7).cpu()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_aa_dtypes_refused_as_on_cpu():
    for mode in ("bilinear", "bicubic"):
        refused_as_on_cpu(
            lambda d, mode=mode: F.interpolate(torch.ones(1, 1, 8, 8, dtype=torch.bfloat16, device=d), size=(3, 3),
                                               mode=mode, antialias=True), at_call=True)  # fmt: skip
        refused_as_on_cpu(
            lambda d, mode=mode: F.interpolate(torch.ones(1, 1, 8, 8, dtype=torch.int32, device=d), size=(3, 3),
                                               mode=mode, antialias=True), at_call=True)  # fmt: skip
    # the same size is a copy, whatever the dtype
    x = torch.arange(12, dtype=torch.bfloat16).reshape(1, 1, 3, 4)
    got = F.interpolate(x.to("xla"), size=(3, 4), mode="bilinear", antialias=True).cpu()
    assert torch.equal(got, x)
    backward = torch.ops.aten._upsample_bicubic2d_aa_backward
    refused_as_on_cpu(
        lambda d: backward(torch.ones(1, 1, 3, 3, dtype=torch.bfloat16, device=d), [3, 3], [1, 1, 8, 8], False),
        at_call=True,
    )
