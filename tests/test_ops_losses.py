"""Weight norm and losses against CPU eager, where the OpInfo suite does not reach: the fused
weight-norm kernels (no OpInfo calls them), CTC on the paths a speech model takes, and that
none of them falls back to CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xlatorch.debug.metrics as met
from tests.cpu_twin import refused_as_on_cpu

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
