"""Neural-network ops of bfloat16 and float16 tensors, against CPU eager: layers, their
gradients and losses, each computed the way CPU's kernel computes it for a half float (in
float32 rounded once, op by op with each result rounded, or in the half dtype's own
arithmetic). See docs/precision-and-amp.md, "Values as CPU computes them"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.cpu_twin import bfloat16_sums_as_cpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [-1, 0])
def test_softmax_of_half_dtypes_is_computed_in_float32_and_rounded_once_as_on_cpu(dtype, dim):
    # The device computed exp and the sum in bfloat16: up to 9 ulps from CPU's result, in 6,097
    # of these 8,192 elements. In float32 only exp's last float32 bit can differ, which moves
    # a rounding to the half dtype by at most one of its ulps.
    x = (torch.randn(64, 128) * 3).to(dtype)
    want = torch.softmax(x, dim)
    got = torch.softmax(x.to("xla"), dim).cpu()
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert got.dtype == dtype and float(((got.float() - want.float()).abs() / ulp).max()) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_of_half_dtypes_is_computed_in_float32_as_on_cpu(dtype, approximate):
    # Computed in bfloat16 it was up to 67 ulps from CPU's value. In float32 the two differ by
    # erf's / tanh's last float32 bits, at most one ulp of the half dtype once rounded (for x
    # below -2 both lose every bit to 1 + erf(x) cancelling: not compared there).
    x = torch.linspace(-2, 4, 4096).to(dtype)
    g = torch.linspace(-1, 1, 4096).to(dtype)
    xr, xd = x.clone().requires_grad_(), x.to("xla").requires_grad_()
    want, got = F.gelu(xr, approximate=approximate), F.gelu(xd, approximate=approximate)
    want.backward(g)
    got.backward(g.to("xla"))
    for w, v in ((want.detach(), got.detach().cpu()), (xr.grad, xd.grad.cpu())):
        ulp = torch.finfo(dtype).eps * w.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert v.dtype == dtype and float(((v.float() - w.float()).abs() / ulp).max()) <= 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh()),
        lambda: torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Sigmoid()),
        lambda: torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.SiLU()),
        lambda: torch.nn.Conv1d(4, 8, 3),
    ],
    ids=["tanh", "sigmoid", "silu", "conv1d"],
)
def test_bfloat16_layers_and_their_gradients_are_cpus(make):
    """A bfloat16 layer's output and gradients as CPU computes them: CPU's gradient kernels of
    tanh / sigmoid / SiLU compute in float32 and round once (the device had computed tanh's and
    sigmoid's in bfloat16, and SiLU's went through PyTorch's decomposition for other backends,
    rounding each step: 33-50% of input gradients differed); a convolution adds its bias before
    rounding (28% of outputs differed)."""
    torch.manual_seed(0)
    cpu = make().to(torch.bfloat16)
    dev = copy.deepcopy(cpu).to("xla")
    x = torch.randn(8, 4, 64) if isinstance(cpu, torch.nn.Conv1d) else torch.randn(8, 16, 64)
    x = x.to(torch.bfloat16)
    xs = [x.clone().requires_grad_(), x.to("xla").requires_grad_()]
    outs = []
    for m, xi in zip((cpu, dev), xs):
        out = m(xi)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        out.backward(dy.to(xi.device))
        outs.append(out)
    # float32's last bit (a matmul's order of summation, XLA's and CPU's tanh) may move a
    # bfloat16 rounding in a few elements of a thousand; a formula computed otherwise moves a third
    pairs = [(outs[1].detach(), outs[0].detach()), (xs[1].grad, xs[0].grad)]
    pairs += [(q.grad, p.grad) for p, q in zip(cpu.parameters(), dev.parameters())]
    if isinstance(cpu, torch.nn.Conv1d):
        _assert_conv_is_the_exact_sum_rounded(cpu, x, dy, pairs)
        return
    for i, (got, want) in enumerate(pairs):
        diff = (got.cpu() != want).sum().item()
        assert diff <= want.numel() // 50, (i, diff, want.numel())


def _assert_conv_is_the_exact_sum_rounded(cpu, x, dy, pairs):
    """A bfloat16 convolution's output and gradients, each a sum of products, against the exact
    ones (``cpu_twin.bfloat16_sums_as_cpu``: on an AMD EPYC 911 of 2,048 of CPU's input gradients
    differed from the device's; on CPUs with bfloat16 instructions, none), each element's count
    of terms and sum of magnitudes computed by the same convolution on ones and absolute values."""

    def conv(f):
        m = copy.deepcopy(cpu).double()
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(f(p.double()))
        xi = f(x.double()).requires_grad_()
        out = m(xi)
        out.backward(f(dy.double()))
        return [out.detach(), xi.grad] + [p.grad for p in m.parameters()]

    for (got, want), exact, magnitude, terms in zip(pairs, conv(lambda t: t), conv(torch.abs), conv(torch.ones_like)):
        bfloat16_sums_as_cpu(got, want, exact, magnitude, terms)


def test_silus_gradient_of_a_gradient_still_records_through_its_decomposition():
    """SiLU's gradient reaches its one-kernel lowering only when autograd need not record it;
    a gradient of a gradient (``create_graph=True``) decomposes as before, and matches CPU."""
    x = torch.randn(50, dtype=torch.float64)
    grads = []
    for xi in (x.clone().requires_grad_(), x.to("xla").requires_grad_()):
        (g,) = torch.autograd.grad(torch.nn.functional.silu(xi).sum(), xi, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), xi)
        grads.append((g.detach().cpu(), gg.cpu()))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_float_log_softmax_is_cpus(dtype):
    """Along the last dim CPU's kernel keeps each row's sum of exponentials and its log in the
    tensor's dtype (``x - max - round(log(round(sum)))``); along another it rounds once. The
    device had rounded once everywhere: 6-17% of a bfloat16 log_softmax differed from CPU's."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(40, 30, 100, generator=g) * 3).to(dtype)
    for dim in (-1, 1, 0):
        for fn in (torch.log_softmax, torch.compile(torch.log_softmax, backend="openxla")):
            diff = (fn(x.to("xla"), dim).cpu() != torch.log_softmax(x, dim)).sum().item()
            # rounded once: XLA's float32 exp and log and CPU's may move a rounding, rarely
            assert diff <= (0 if dim == -1 else x.numel() // 5000), (dim, diff)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_float_losses_are_cpus(dtype):
    """CPU's loss kernels and composites for half floats, each as CPU computes it: op by op with
    each result rounded (``binary_cross_entropy_with_logits``, ``soft_margin_loss``, ``mse_loss``),
    in the half dtype's own arithmetic (float16 ``smooth_l1_loss``, bfloat16 ``huber_loss``), or
    in float32 rounded once (the others). Rounding once everywhere had made 17-37% differ."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(3000, generator=g) * 2).to(dtype)
    y = torch.randn(3000, generator=g).to(dtype)
    t = torch.rand(3000, generator=g).to(dtype)

    def f(x, y, t):
        return [
            F.binary_cross_entropy_with_logits(x, t, reduction="none"),
            F.binary_cross_entropy_with_logits(x, t, pos_weight=t + 0.5, reduction="none"),
            F.soft_margin_loss(x, y.sign(), reduction="none"),
            F.smooth_l1_loss(x, y, reduction="none", beta=0.3),
            F.huber_loss(x, y, reduction="none", delta=1.3),
            F.mse_loss(x, y, reduction="none"),
            F.l1_loss(x, y, reduction="none"),
        ]

    for i, (got, want) in enumerate(zip(f(x.to("xla"), y.to("xla"), t.to("xla")), f(x, y, t))):
        diff = (got.cpu() != want).sum().item()
        assert diff <= (x.numel() // 500 if i == 1 else 0), (i, diff)  # pos_weight: log_sigmoid's last bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_float_results_are_rounded_after_each_op_inside_a_graph(dtype):
    """Each op's half-float result is rounded before the next op reads it, as PyTorch rounds
    every op's result: XLA's default lets a fusion keep a matmul's float32 result for the
    elementwise ops after it (Muon's Newton-Schulz step ``b * A + c * (A @ A)`` differed from
    CPU in half its bfloat16 elements, while each op alone matched). Checked against CPU's
    elementwise ops on the device's own matmul results (CPU's half-float matmul itself differs
    between CPUs with and without bfloat16 instructions; its elementwise ops do not)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 12, generator=g).to(dtype).to("xla")
    a = x @ x.mT
    aa = a @ a
    b = -4.775 * a + 2.0315 * aa
    bx = b @ x
    y = 3.4445 * x + bx
    a, aa, b, bx, y = (t.cpu() for t in (a, aa, b, bx, y))  # one graph: every value read at once
    assert torch.equal(b, -4.775 * a + 2.0315 * aa)
    assert torch.equal(y, 3.4445 * x.cpu() + bx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["addmm", "baddbmm"])
def test_a_half_float_addmm_scales_and_adds_in_float32_and_rounds_once(op, dtype):
    """CPU's ``addmm`` / ``baddbmm`` of half floats compute ``beta * self + alpha * (a @ b)`` in
    float32 (beta and alpha in float32, the float32 sums) and round once; the device rounded the
    product, beta and alpha to the half dtype first: 16-45% of elements differed whenever beta or
    alpha was not 1 (``torch.optim.Muon``'s step, ``baddbmm`` of attention scores). Four-term
    sums of half-float products are exact in float32, so no summation order can move a result."""
    g = torch.Generator().manual_seed(0)
    batch = (3,) if op == "baddbmm" else ()
    # 16 x 4 x 12: CPU's baddbmm takes its gemm here (below 400 multiply-adds a matrix it loops
    # itself, and rounds an element otherwise now and then)
    c, a, b = (torch.randn(batch + s, generator=g).to(dtype) for s in ((16, 12), (16, 4), (4, 12)))
    fn = getattr(torch, op)
    for beta, alpha in ((1, 1), (3.4445, 1), (-4.775, 2.0315), (0.5, 0.3), (0, 0.7)):
        want = fn(c, a, b, beta=beta, alpha=alpha)
        got = fn(c.to("xla"), a.to("xla"), b.to("xla"), beta=beta, alpha=alpha).cpu()
        # CPU's own kernels may round an element otherwise now and then (float16 baddbmm: one of
        # 576 here), by one unit in its last place
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert float(((got.float() - want.float()).abs() / ulp).max()) <= 1, (beta, alpha)
        assert (got != want).sum() <= want.numel() // 100, (beta, alpha, (got != want).sum())


def test_muons_bfloat16_orthogonalization_steps_as_on_cpu():
    """``torch.optim.Muon`` orthogonalizes each update by Newton-Schulz iterations in bfloat16
    (``addmm`` with beta and alpha); its parameters after three steps are CPU's (they were 7e-3
    away after four). The matrices are 4 x 6, so every bfloat16 sum has at most 6 exact terms."""
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    x, y = torch.randn(5, 6), torch.randn(5, 4)
    results = []
    for device in ("cpu", "xla"):
        p = torch.nn.Parameter(w.clone().to(device))
        opt = torch.optim.Muon([p], lr=0.02)
        for _ in range(3):
            opt.zero_grad()
            ((x.to(device) @ p.T - y.to(device)) ** 2).mean().backward()
            opt.step()
        results.append(p.detach().cpu())
    # float32 steps between the bfloat16 ones (the loss's gradient, the update) round as CPU's
    # up to their last bit
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)
