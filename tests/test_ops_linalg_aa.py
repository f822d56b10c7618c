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


# --- matrix exponential -----------------------------------------------------------------


def _mexp_matrices(dtype):
    """A batch whose 1-norms fall in each of CPU's degree intervals (float32 bounds 1.2e-7,
    6e-4, 0.051, 0.58, 1.46) and past them (scaling and squaring: s = 0, 2, 5)."""
    torch.manual_seed(0)
    base = torch.randn(8, 4, 4, dtype=torch.float64)
    base = base / base.abs().sum(-2).amax(-1)[:, None, None]  # 1-norm 1
    norms = torch.tensor([1e-8, 3e-4, 0.03, 0.4, 1.2, 2.5, 10.0, 80.0], dtype=torch.float64)
    return (base * norms[:, None, None]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_matrix_exp_every_degree_matches_cpu(dtype):
    a = _mexp_matrices(torch.float64)
    if dtype.is_complex:
        a = torch.complex(a, _mexp_matrices(torch.float64).flip(0) * 0.5)
    a = a.to(dtype)
    want = torch.linalg.matrix_exp(a)
    met.clear_counters()
    got = torch.linalg.matrix_exp(a.to("xla")).cpu()
    _no_fallback("linalg_matrix_exp")
    assert got.dtype == want.dtype
    # Both compute CPU's polynomial; summation orders differ. The error is norm-wise: per matrix
    # about u * 2^s * n * max|e^A| (s squarings; here s <= 5, n = 4)
    u = torch.finfo(dtype).eps / 2
    scale = want.abs().amax((-2, -1), keepdim=True)
    err = ((got - want).abs() / scale).amax((-2, -1))
    assert (err <= 2 * u * 2**5 * 4).all(), err


def test_matrix_exp_trivial_sizes():
    for shape in [(3, 1, 1), (2, 0, 0)]:
        a = torch.randn(shape)
        assert torch.equal(torch.linalg.matrix_exp(a.to("xla")).cpu(), torch.linalg.matrix_exp(a))


# --- LU ---------------------------------------------------------------------------------


def test_linalg_lu_shapes_and_values_match_cpu():
    for shape in [(4, 4), (5, 3), (3, 5), (2, 3, 6, 4)]:
        a = torch.randn(shape, dtype=torch.float64)
        want = torch.linalg.lu(a)
        met.clear_counters()
        got = torch.linalg.lu(a.to("xla"))
        _no_fallback("linalg_lu")
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            # partial pivoting picks the same rows (no near-ties in Gaussian data): P exact,
            # L and U within float64 rounding of an elimination of ~n steps
            torch.testing.assert_close(g.cpu(), w, atol=1e-12, rtol=1e-12)


def test_linalg_lu_without_pivoting_refused_as_on_cpu():
    refused_as_on_cpu(lambda d: torch.linalg.lu(torch.randn(3, 3, device=d), pivot=False), at_call=True)
    refused_as_on_cpu(lambda d: torch.linalg.lu(torch.ones(3, 3, dtype=torch.int64, device=d)), at_call=True)
    # an empty A factors without pivoting on CPU: P is an empty (0,)
    want = torch.linalg.lu(torch.ones(0, 3, 4), pivot=False)
    got = torch.linalg.lu(torch.ones(0, 3, 4).to("xla"), pivot=False)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]


# --- Householder products ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_householder_product_matches_cpu(dtype):
    # the reflectors geqrf leaves, and arbitrary ones; tau with fewer entries than columns
    a = torch.randn(2, 6, 4, dtype=dtype)
    h, tau = torch.geqrf(a)
    cases = [(h, tau), (a, torch.randn(2, 3, dtype=dtype)), (a[0], torch.randn(0, dtype=dtype))]
    for v, t in cases:
        want = torch.linalg.householder_product(v, t)
        met.clear_counters()
        got = torch.linalg.householder_product(v.to("xla"), t.to("xla")).cpu()
        _no_fallback("linalg_householder_product")
        # a product of k reflectors: k rank-one updates, each exact to float64 rounding
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    bf16 = dict(dtype=torch.bfloat16)
    refused_as_on_cpu(
        lambda d: torch.linalg.householder_product(torch.ones(5, 3, **bf16, device=d), torch.ones(2, **bf16, device=d)),
        at_call=True,
    )


# --- eigendecomposition -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_linalg_eig_matches_cpu(dtype):
    # Eigenvalues: geev's, in its order, on both sides. Eigenvectors: geev makes each of unit
    # 2-norm with its largest component real, which leaves its sign free (LAPACK builds differ:
    # CPU's MKL and JAX's LAPACK flip some), so they are compared up to a unit factor per
    # column. Gaussian matrices have well separated eigenvalues (gaps ~0.1 and more): values
    # and vectors within ~u * |A| / gap of CPU's, far below 1e-10
    a = torch.randn(3, 6, 6, dtype=dtype)
    w, v = torch.linalg.eig(a)
    met.clear_counters()
    gw, gv = (t.cpu() for t in torch.linalg.eig(a.to("xla")))
    vals = torch.linalg.eigvals(a.to("xla")).cpu()
    _no_fallback("linalg_eig", "_linalg_eigvals")
    assert gw.dtype == w.dtype and gv.dtype == v.dtype
    torch.testing.assert_close(gw, w, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(vals, w, atol=1e-10, rtol=1e-10)
    phase = (v.conj() * gv).sum(-2, keepdim=True)  # <v, gv> per column: a unit factor
    torch.testing.assert_close(phase.abs(), torch.ones_like(phase.abs()), atol=1e-10, rtol=0)
    torch.testing.assert_close(gv, v * phase, atol=1e-10, rtol=1e-10)


def test_linalg_eig_errors_as_on_cpu():
    nan = torch.eye(3)
    nan[1, 2] = float("nan")
    refused_as_on_cpu(lambda d: torch.linalg.eig(nan.to(d))[0])  # CPU's check on the data
    refused_as_on_cpu(lambda d: torch.linalg.eig(torch.eye(3, dtype=torch.bfloat16, device=d)), at_call=True)


@pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated")
def test_cholesky_factors_and_raises_cpus_linalg_error():
    """``torch.cholesky`` (deprecated, still used): the factor as CPU's, and a matrix that is not
    positive-definite raises CPU's ``LinAlgError`` naming the minor and the batch element (it
    used to fall back to the CPU, a graph cut per call)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    a = a @ a.mT + 0.1 * torch.eye(4, dtype=torch.float64)
    met.clear_counters()
    for upper in (False, True):
        torch.testing.assert_close(torch.cholesky(a.to("xla"), upper=upper).cpu(), torch.cholesky(a, upper=upper))
    bad = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    for x in (bad, torch.stack([torch.eye(2), bad])):
        with pytest.raises(torch.linalg.LinAlgError) as want:
            torch.cholesky(x)
        with pytest.raises(torch.linalg.LinAlgError) as got:
            torch.cholesky(x.to("xla")).cpu()
        assert str(got.value).startswith(str(want.value)), (got.value, want.value)
    _no_fallback("cholesky")
