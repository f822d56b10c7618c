"""Weight norm and losses against CPU eager, where the OpInfo suite does not reach: the fused
weight-norm kernels (no OpInfo calls them), CTC on the paths a speech model takes, and that
none of them falls back to CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests.cpu_twin import refused_as_on_cpu, runs_as_on_cpu

aten = torch.ops.aten


def _fallbacks():
    return {n for n in met.executed_fallback_ops()}


def _no_fallback(*ops):
    got = _fallbacks()
    assert not {f"aten::{op}" for op in ops} & got, got


# --- weight norm -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "dim"),
    [(lambda: nn.Conv1d(6, 8, 5, groups=2), 2), (lambda: nn.Linear(7, 5), 0), (lambda: nn.Conv1d(4, 3, 2), 0)],
    ids=["conv1d-last-dim", "linear-first-dim", "conv1d-first-dim"],
)
def test_weight_norm_module_forward_and_gradients_match_cpu(make, dim):
    """``parametrizations.weight_norm`` as Wav2Vec2's positional convolution uses it (dim=2, the
    last) and with the default dim=0: output and the gradients of ``g`` and ``v``. Sums of up to
    30 float32 products in another order: a few ulps, 1e-5 relative."""
    torch.manual_seed(0)
    cpu = nn.utils.parametrizations.weight_norm(make(), dim=dim)
    dev = nn.utils.parametrizations.weight_norm(make(), dim=dim)
    dev.load_state_dict(cpu.state_dict())
    dev.to("xla")
    x = torch.randn(3, cpu.weight.shape[1] * (2 if isinstance(cpu, nn.Conv1d) and cpu.groups == 2 else 1), 9)
    if isinstance(cpu, nn.Linear):
        x = x[:, :, 0].reshape(3, -1)[:, : cpu.in_features]
    met.clear_counters()
    outs = {}
    for name, m, xx in (("cpu", cpu, x), ("xla", dev, x.to("xla"))):
        y = m(xx)
        (y * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
        p = m.parametrizations.weight
        outs[name] = [y.detach().cpu(), p.original0.grad.cpu(), p.original1.grad.cpu()]
    _no_fallback("_weight_norm_interface", "_weight_norm_interface_backward")
    for got, want in zip(outs["xla"], outs["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_interface_and_backward_match_cpu(dtype, dim):
    """The ATen ops themselves: ``norm`` of ``g``'s shape, float32 for bfloat16 (CPU's
    accumulation type), ``w = v * (g / norm)`` with ``g / norm`` in float32 and ``w`` rounded
    once; the backward's ``grad_g = sum(grad_w v) / norm`` and ``grad_v = a grad_w - b v``.
    Tolerance: float32 sums of 60 products in another order; for bfloat16 a result one
    rounding from the float32 value (1 ulp: 2^-8 relative)."""
    torch.manual_seed(1)
    v = torch.randn(4, 3, 5).to(dtype)
    g = torch.randn([4 if dim == 0 else 1, 1, 5 if dim == 2 else 1]).to(dtype)
    gw = torch.randn(4, 3, 5).to(dtype)
    met.clear_counters()
    res = {}
    for d in ("cpu", "xla"):
        w, norm = aten._weight_norm_interface(v.to(d), g.to(d), dim)
        gv, gg = aten._weight_norm_interface_backward(gw.to(d), v.to(d), g.to(d), norm, dim)
        res[d] = [t.cpu() for t in (w, norm, gv, gg)]
    _no_fallback("_weight_norm_interface", "_weight_norm_interface_backward")
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-5)
    for got, want in zip(res["xla"], res["cpu"]):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)


def test_weight_norm_interface_refuses_as_cpu():
    """CPU's fused kernel takes only the first or the last dim; ``g`` of ``v``'s dtype."""
    v, g = torch.randn(4, 3, 5), torch.randn(1, 3, 1)
    refused_as_on_cpu(lambda d: aten._weight_norm_interface(v.to(d), g.to(d), 1)[0], at_call=True, word_for_word=False)
    refused_as_on_cpu(lambda d: aten._weight_norm_interface(v.to(d), g.to(d), -1)[0], at_call=True, word_for_word=False)
    g0 = torch.randn(4, 1, 1)
    refused_as_on_cpu(lambda d: aten._weight_norm_interface(v.to(d), g0.double().to(d), 0)[0], at_call=True)
    refused_as_on_cpu(lambda d: aten._weight_norm_interface(v.long().to(d), g0.long().to(d), 0)[0], at_call=True)


# --- CTC -----------------------------------------------------------------------------------
# The alpha / beta recursions add a rounding per time step to log values of magnitude up to
# T log C (~25 here): 1e-5 relative on the loss. The gradient, exp(lp) - exp(lcab + nll - lp),
# carries the same absolute error of the exponent into values at most 1: 2e-5 absolute.
_LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
_GRAD_TOL = dict(rtol=1e-5, atol=2e-5)


def _ctc_case(layout):
    """T=12, B=4, C=6: a full-length input, a shorter one, an empty target, and an impossible
    alignment (5 labels with repeats need at least 7 inputs; sample 3 has 4)."""
    torch.manual_seed(2)
    lp = torch.randn(12, 4, 6).log_softmax(2)
    il, tl = (12, 9, 7, 4), (5, 3, 0, 5)
    padded = torch.randint(1, 6, (4, 5))
    padded[3] = torch.tensor([2, 2, 3, 3, 1])
    if layout == "padded":
        return lp, padded, il, tl
    return lp, torch.cat([padded[b, : tl[b]] for b in range(4)]), il, tl


@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("layout", ["padded", "concatenated"])
def test_ctc_loss_and_gradient_match_cpu(layout, zero_infinity):
    """``F.ctc_loss`` with the lengths as tuples (``_ctc_loss`` and its backward), each
    reduction: loss and gradient against CPU, an infinite loss (or its zero, and a zero
    gradient) and the NaN gradient CPU gives an impossible alignment without ``zero_infinity``
    included. One graph for the three reductions (read back at the end)."""
    lp, targets, il, tl = _ctc_case(layout)
    res = {}
    met.clear_counters()
    for d in ("cpu", "xla"):
        res[d] = []
        for reduction in ("none", "mean", "sum"):
            x = lp.to(d).requires_grad_()
            loss = F.ctc_loss(x, targets.to(d), il, tl, reduction=reduction, zero_infinity=zero_infinity)
            w = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(d)
            (g,) = torch.autograd.grad((loss * w).sum(), x)
            res[d] += [loss.detach(), g]
        res[d] = [v.cpu() for v in res[d]]
    _no_fallback("_ctc_loss", "_ctc_loss_backward")
    assert torch.isinf(res["cpu"][0]).any() != zero_infinity  # the impossible sample is in
    for k, (got, want) in enumerate(zip(res["xla"], res["cpu"])):
        torch.testing.assert_close(got, want, equal_nan=True, **(_GRAD_TOL if k % 2 else _LOSS_TOL))


@pytest.mark.parametrize("layout", ["padded", "concatenated"])
def test_ctc_loss_ops_match_cpu(layout):
    """The ATen ops: ``log_alpha`` of (B, T, 2 max(L) + 1) where CPU writes it (each sample's
    first input_length times and 2 L + 1 states; CPU leaves the rest uninitialised), the
    backward with and without ``zero_infinity``, a target holding the blank label itself; float32
    padded, float64 concatenated."""
    lp, targets, il, tl = _ctc_case(layout)
    targets = targets.clone()
    if layout == "padded":  # the last label of the first sample is the blank
        targets[0, tl[0] - 1] = 0
    else:
        targets[tl[0] - 1] = 0
    for dtype in (torch.float32,) if layout == "padded" else (torch.float64,):
        grad = torch.linspace(-1, 2, 4, dtype=dtype)
        res = {}
        met.clear_counters()
        for d in ("cpu", "xla"):
            x, t = lp.to(dtype).to(d), targets.to(d)
            nll, alpha = aten._ctc_loss(x, t, il, tl, 0, False)
            g0 = aten._ctc_loss_backward(grad.to(d), x, t, il, tl, nll, alpha, 0, False)
            g1 = aten._ctc_loss_backward(grad.to(d), x, t, il, tl, nll, alpha, 0, True)
            res[d] = [v.cpu() for v in (nll, alpha, g0, g1)]
        _no_fallback("_ctc_loss", "_ctc_loss_backward")
        (nll, alpha, g0, g1), (want_nll, want_alpha, want0, want1) = res["xla"], res["cpu"]
        assert alpha.shape == want_alpha.shape == (4, 12, 11) and alpha.dtype == dtype
        written = torch.zeros(alpha.shape, dtype=torch.bool)
        for b in range(4):
            written[b, : il[b], : 2 * tl[b] + 1] = True
        torch.testing.assert_close(nll, want_nll, **_LOSS_TOL)
        torch.testing.assert_close(alpha[written], want_alpha[written], **_LOSS_TOL)
        torch.testing.assert_close(g0, want0, equal_nan=True, **_GRAD_TOL)
        torch.testing.assert_close(g1, want1, **_GRAD_TOL)


@pytest.mark.parametrize(("held", "layout"), [("cpu", "padded"), ("xla", "concatenated")])
def test_ctc_loss_of_lengths_held_as_tensors_does_not_fall_back(held, layout):
    """Lengths as CPU tensors (a DataLoader's) go to the device; as device tensors
    (Wav2Vec2ForCTC's, with concatenated targets) they stay: either way ``_ctc_loss.Tensor`` and
    its backward are lowered with the lengths traced (log_alpha sized for the most labels the
    targets hold, as its shape on CPU depends on their values). Loss and gradient as on CPU."""
    lp, targets, il, tl = _ctc_case(layout)
    res = {}
    for d in ("cpu", "xla"):
        met.clear_counters()
        x = lp.to(d).requires_grad_()
        lens = (torch.tensor(il), torch.tensor(tl))
        lens = tuple(t.to(d) for t in lens) if held == "xla" else lens
        loss = F.ctc_loss(x, targets.to(d), *lens, zero_infinity=True)
        (g,) = torch.autograd.grad(loss, x)
        res[d] = loss.detach().cpu(), g.cpu()
    _no_fallback("_ctc_loss", "_ctc_loss_backward")
    torch.testing.assert_close(res["xla"][0], res["cpu"][0], **_LOSS_TOL)
    torch.testing.assert_close(res["xla"][1], res["cpu"][1], **_GRAD_TOL)


def test_ctc_loss_of_empty_targets_and_one_input_match_cpu():
    """Every target empty (log_alpha of one state; padded and concatenated), and one input."""
    torch.manual_seed(4)
    lp = torch.randn(4, 2, 5).log_softmax(2)
    cases = [(lp, torch.ones(2, 0, dtype=torch.long), (4, 2), (0, 0)),
             (lp, torch.ones(0, dtype=torch.long), (4, 2), (0, 0)),
             (lp[:1], torch.ones(2, 1, dtype=torch.long), (1, 1), (1, 0))]  # fmt: skip
    res = {}
    met.clear_counters()
    for d in ("cpu", "xla"):
        got = []
        for x, t, il, tl in cases:
            nll, alpha = aten._ctc_loss(x.to(d), t.to(d), il, tl)
            got += [nll, aten._ctc_loss_backward(torch.ones(2).to(d), x.to(d), t.to(d), il, tl, nll, alpha, 0)]
        res[d] = [v.cpu() for v in got]
    _no_fallback("_ctc_loss", "_ctc_loss_backward")
    for got, want in zip(res["xla"], res["cpu"]):
        torch.testing.assert_close(got, want, **_GRAD_TOL)


def test_ctc_loss_refuses_as_cpu():
    lp, targets, il, tl = _ctc_case("padded")
    refused_as_on_cpu(lambda d: aten._ctc_loss(lp[:0].to(d), targets.to(d), (0,) * 4, tl)[0], at_call=True)
    refused_as_on_cpu(lambda d: aten._ctc_loss(lp.bfloat16().to(d), targets.to(d), il, tl)[0], at_call=True)
    refused_as_on_cpu(lambda d: aten._ctc_loss(lp.to(d), targets.float().to(d), il, tl)[0], at_call=True)
    refused_as_on_cpu(lambda d: aten._ctc_loss(lp.to(d), targets.to(d), il, (5, 3, 0, 6))[0], at_call=True)
    refused_as_on_cpu(lambda d: aten._ctc_loss(lp.to(d), targets.to(d), (13, 9, 7, 4), tl)[0], at_call=True)
    refused_as_on_cpu(lambda d: aten._ctc_loss(lp.to(d), targets.to(d), il, tl, 6)[0], at_call=True)


# --- margin losses over classes ------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_matches_cpu(reduction):
    """Targets ended by -1 early, a repeated target label (CPU counts its slot twice), values
    after the -1 ignored, no -1 at all, and a 1-d input: loss, gradient and no fallback. Sums of
    at most 36 terms of magnitude ~3: float32 rounding (CPU sums the frames in double)."""
    torch.manual_seed(3)
    x = torch.randn(4, 6)
    t = torch.tensor([[3, 0, -1, 1, 5, 2], [2, 2, 4, -1, 0, 0], [0, 1, 2, 3, 4, 5], [-1, 3, 3, 3, 3, 3]])
    met.clear_counters()
    res = {}
    for d in ("cpu", "xla"):
        got = []
        for xx, tt in ((x, t), (x[1], t[1])):
            xd = xx.to(d).requires_grad_()
            loss = F.multilabel_margin_loss(xd, tt.to(d), reduction=reduction)
            w = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(d)
            (g,) = torch.autograd.grad((loss * w).sum(), xd)
            got += [loss.detach(), g]
        res[d] = [v.cpu() for v in got]
    _no_fallback("multilabel_margin_loss_forward", "multilabel_margin_loss_backward")
    for got, want in zip(res["xla"], res["cpu"]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_margin_losses_refuse_targets_out_of_range_as_cpu():
    x = torch.randn(3, 4)
    refused_as_on_cpu(lambda d: F.multi_margin_loss(x.to(d), torch.tensor([0, 4, 1]).to(d)))
    refused_as_on_cpu(lambda d: F.multi_margin_loss(x.to(d), torch.tensor([0, -1, 1]).to(d)))
    bad = torch.tensor([[0, 1, -1, 4]] * 3)
    refused_as_on_cpu(lambda d: F.multilabel_margin_loss(x.to(d), bad.to(d)))
    refused_as_on_cpu(lambda d: F.multilabel_margin_loss(x.to(d), torch.tensor([[0, -2, -1, 1]] * 3).to(d)))
    refused_as_on_cpu(lambda d: F.multi_margin_loss(x.to(d), torch.tensor([0, 1, 1]).to(d), p=3), at_call=True)


def test_margin_losses_of_a_1d_input_are_0d_as_on_cpu():
    """``reduction='none'`` of one frame (a 1-d input): CPU's loss is 0-d (PyTorch's meta
    kernels said [1])."""
    x = torch.randn(5)
    runs_as_on_cpu(lambda d: F.multilabel_margin_loss(x.to(d), torch.tensor([1, 3, -1, 0, 0]).to(d), reduction="none"))
    runs_as_on_cpu(lambda d: F.multi_margin_loss(x.to(d), torch.tensor(2).to(d), reduction="none"), rtol=1e-6)


def test_ctc_lowering_takes_traced_lengths_as_int_lists():
    """The helpers with the lengths traced (what a lowering of lengths held on the device would
    give them) compute what they compute with int lists."""
    import jax
    import jax.numpy as jnp

    from xlatorch.lowering import ctc

    lp, targets, il, tl = _ctc_case("concatenated")
    x, t = jnp.asarray(lp.numpy()), jnp.asarray(targets.numpy())
    avals = (jax.ShapeDtypeStruct((4,), x.dtype), jax.ShapeDtypeStruct((4, 12, 11), x.dtype))
    grad = jnp.linspace(-1.0, 2.0, 4, dtype=x.dtype)

    def run(il, tl):
        nll, alpha = ctc.ctc_loss(avals, x, t, il, tl, 0, True)
        return nll, ctc.ctc_loss_backward(avals[0].update(shape=x.shape), grad, x, t, il, tl, nll, alpha, 0, True)

    want = run(il, tl)
    got = jax.jit(run)(jnp.asarray(il), jnp.asarray(tl))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths", ["device tensors", "cpu tensors", "int lists"])
def test_ctc_loss_compiles_one_step_for_every_set_of_lengths(lengths, no_cached_executables):
    """An ASR batch's lengths change every step: they are read in the graph, never constants of
    it, so the steps after the first compile nothing; each step's loss and gradient are CPU's."""
    lp, targets, il, tl = _ctc_case("padded")
    compiles = []
    for step in range(3):
        ils = [max(1, n - step) for n in il]
        tls = [max(0, n - (step % 2)) for n in tl]
        res = {}
        for d in ("cpu", "xla"):
            x = lp.to(d).requires_grad_()
            if lengths == "int lists":
                lens = (ils, tls)
            else:
                lens = (torch.tensor(ils), torch.tensor(tls))
                lens = tuple(t.to(d) for t in lens) if lengths == "device tensors" else lens
            loss = F.ctc_loss(x, targets.to(d), *lens, reduction="mean", zero_infinity=True)
            (g,) = torch.autograd.grad(loss, x)
            if d == "xla":
                before = met.counter_value("UncachedCompile") or 0
                xm.mark_step()
                compiles.append((met.counter_value("UncachedCompile") or 0) - before)
            res[d] = loss.detach().cpu(), g.cpu()
        torch.testing.assert_close(res["xla"][0], res["cpu"][0], **_LOSS_TOL)
        torch.testing.assert_close(res["xla"][1], res["cpu"][1], **_GRAD_TOL)
    assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles
