"""torch.distributions' samplers, their reparameterized gradients and fractional max pools
on the device, against CPU eager.

The samplers' values come from another stream than CPU's: they are judged by statistics whose
bounds a correct sampler crosses with negligible probability (each at most ~1e-6: six standard
errors, or a Kolmogorov-Smirnov distance at the 1e-6 level), while the wrong distributions
they guard against (a shifted shape, a variance off by a few percent) sit tens of standard
errors away. Seeds are fixed, so each check is also reproducible. Deterministic parts (edge
cases, gradients, pools given their samples) are compared with CPU directly.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met

N = 20000
SE = 6.0  # standard errors a statistic may stray: two-sided probability 2e-9 per check
KS_1E6 = math.sqrt(-math.log(1e-6 / 2) / 2)  # sqrt(n) * KS distance exceeded with probability 1e-6


def _device(op: str, fn, *args):
    """``fn(*args)`` on the xla device, moved back, with no ``aten::<op>`` CPU fallback."""
    met.clear_counters()
    res = fn(*[a.to("xla") if isinstance(a, torch.Tensor) else a for a in args])
    res = tuple(r.cpu() for r in res) if isinstance(res, tuple) else res.cpu()
    assert f"aten::{op}" not in met.executed_fallback_ops(), met.executed_fallback_ops()
    return res


def _ks(samples: torch.Tensor, cdf) -> float:
    """sqrt(n) times the Kolmogorov-Smirnov distance of ``samples`` from ``cdf``."""
    x = samples.double().sort().values
    n = x.numel()
    f = cdf(x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return math.sqrt(n) * max((i / n - f).max().item(), (f - (i - 1) / n).max().item())


def _mean_var_ok(x: torch.Tensor, mean: float, var: float, kurt_excess: float = 0.0) -> None:
    """Sample mean and variance within SE standard errors of ``mean`` / ``var``."""
    x = x.double()
    n = x.numel()
    assert abs(x.mean().item() - mean) <= SE * math.sqrt(var / n) + 1e-12, (x.mean().item(), mean)
    se_var = var * math.sqrt((2 + kurt_excess) / n)  # var of the sample variance: (mu4 - var^2) / n
    assert abs(x.var().item() - var) <= SE * se_var + 1e-12, (x.var().item(), var)


# --- gamma ------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.05, 0.5, 1.0, 3.0, 60.0])
def test_standard_gamma_follows_the_gamma_law(alpha):
    torch.manual_seed(0)
    g = _device("_standard_gamma", torch._standard_gamma, torch.full((N,), alpha))
    assert g.dtype == torch.float32 and g.shape == (N,)
    # Gamma(alpha) CDF: the regularized lower incomplete gamma function.
    stat = _ks(g, lambda x: torch.special.gammainc(torch.full_like(x, alpha), x))
    assert stat < KS_1E6, stat


def test_standard_gamma_edges_and_dtypes_as_cpu():
    # Concentration 0, and one so small that every draw underflows: CPU returns the dtype's
    # smallest normal number (it clamps each sample to it).
    # (Shape (N,) throughout: the graphs of the other tests, compiled once.)
    for dtype in (torch.float32, torch.float64):
        a = torch.full((N,), 2.0, dtype=dtype)
        a[:3] = torch.tensor([0.0, 1e-30, 0.0])
        want = torch._standard_gamma(a[:3])
        got = _device("_standard_gamma", torch._standard_gamma, a)
        assert got.dtype == dtype and torch.equal(got[:3], want), (got[:3], want)
        assert (got[3:] > 0).all()
    with pytest.raises(NotImplementedError, match="\"gamma_cpu\" not implemented for 'Long'"):
        torch._standard_gamma(torch.ones(3, dtype=torch.long, device="xla"))


def test_gamma_rsample_backward_stays_on_the_device():
    conc = torch.tensor([0.3, 2.0, 15.0], device="xla", requires_grad=True)
    met.clear_counters()
    x = torch.distributions.Gamma(conc, torch.ones(3, device="xla")).rsample((500,))
    x.sum().backward()
    xm.mark_step()
    assert not [k for k in met.executed_fallback_ops() if "gamma" in k], met.executed_fallback_ops()
    # d/dalpha of a Gamma(alpha) sample averages d E[x] / d alpha = 1
    assert torch.isfinite(conc.grad.cpu()).all()
    assert abs(conc.grad.cpu() / 500 - 1).max() < 0.35, conc.grad


# --- Dirichlet / Beta -------------------------------------------------------------------------


def test_dirichlet_moments():
    torch.manual_seed(1)
    alpha = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    d = _device("_sample_dirichlet", torch._sample_dirichlet, alpha.expand(N, 3).contiguous())
    assert d.dtype == torch.float64 and d.shape == (N, 3)
    assert torch.allclose(d.sum(-1), torch.ones(N, dtype=torch.float64))
    a0 = alpha.sum().item()
    for j in range(3):
        a = alpha[j].item()
        _mean_var_ok(d[:, j], a / a0, a * (a0 - a) / (a0 * a0 * (a0 + 1)), kurt_excess=6.0)


def test_dirichlet_tiny_concentrations_as_cpu():
    # float64 gammas of concentration 1e-4 underflow 93% of the time; CPU raises each to
    # float64's smallest normal number before normalising, so a row whose three all underflow
    # comes out exactly 1/3 each (probability ~0.8). Compare that frequency with CPU's:
    # two samples of N - 100, standard error of the difference < 0.005. Concentration 0: 1/3 each.
    torch.manual_seed(2)
    alpha = torch.full((N, 3), 1e-4, dtype=torch.float64)
    alpha[:100] = 0
    want = torch._sample_dirichlet(alpha)
    got = _device("_sample_dirichlet", torch._sample_dirichlet, alpha)
    assert torch.equal(got[:100], want[:100])
    third = torch.tensor(1 / 3, dtype=torch.float64)
    p_want = (want[100:] == third).all(-1).double().mean().item()
    p_got = (got[100:] == third).all(-1).double().mean().item()
    assert abs(p_want - p_got) < SE * 0.005, (p_want, p_got)
    assert (got >= torch.finfo(torch.float64).tiny).all() and (got < 1).all()


def test_beta_rsample_and_gradient_stay_on_the_device():
    a = torch.tensor([0.5, 3.0, 20.0], device="xla", requires_grad=True)
    b = torch.tensor([2.0, 0.7, 25.0], device="xla", requires_grad=True)
    met.clear_counters()
    x = torch.distributions.Beta(a, b).rsample((200,))
    x.sum().backward()
    xm.mark_step()
    bad = [k for k in met.executed_fallback_ops() if "dirichlet" in k or "gamma" in k]
    assert not bad, met.executed_fallback_ops()
    assert torch.isfinite(a.grad.cpu()).all() and torch.isfinite(b.grad.cpu()).all()
    assert (a.grad.cpu() > 0).all() and (b.grad.cpu() < 0).all()  # a larger a moves Beta samples up


# --- Poisson -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.5, 5.0, 9.99, 10.0, 60.0, 1e4, 1e10])
def test_poisson_moments(rate):
    # Both CPU algorithms: Knuth's below rate 10, transformed rejection from 10 on (float64;
    # at rate 1e10 jax.random.poisson's variance is 1.3x the rate, 30 standard errors off).
    torch.manual_seed(3)
    k = _device("poisson", torch.poisson, torch.full((N,), rate))
    assert k.dtype == torch.float32 and torch.equal(k, k.round()) and (k >= 0).all()
    _mean_var_ok(k, rate, rate, kurt_excess=1 / rate)
    if rate < 10:
        p0 = math.exp(-rate)
        p0_hat = (k == 0).double().mean().item()
        assert abs(p0_hat - p0) <= SE * math.sqrt(p0 * (1 - p0) / N), (p0_hat, p0)


def test_poisson_edges_and_errors_as_cpu():
    z = _device("poisson", torch.poisson, torch.zeros(N, dtype=torch.float64))
    assert z.dtype == torch.float64 and torch.equal(z, torch.zeros(N, dtype=torch.float64))
    b = _device("poisson", torch.poisson, torch.full((N,), 3.0, dtype=torch.bfloat16))
    assert b.dtype == torch.bfloat16 and abs(b.double().mean().item() - 3) < SE * math.sqrt(3 / N)
    for bad in (-1.0, float("nan")):
        rates = torch.ones(N)
        rates[7] = bad
        with pytest.raises(RuntimeError, match="invalid Poisson rate, expected rate to be non-negative"):
            torch.poisson(rates.to("xla")).cpu()
    with pytest.raises(NotImplementedError, match="\"poisson_cpu\" not implemented for 'Long'"):
        torch.poisson(torch.ones(2, dtype=torch.long, device="xla"))


# --- binomial ----------------------------------------------------------------------------------


@pytest.mark.parametrize("count, prob", [(10, 0.3), (100, 0.3), (100, 0.9), (7, 0.95), (1e6, 0.3)])
def test_binomial_moments(count, prob):
    torch.manual_seed(4)
    k = _device("binomial", torch.binomial, torch.full((N,), float(count)), torch.full((N,), prob))
    assert k.dtype == torch.float32 and torch.equal(k, k.round()) and (k >= 0).all() and (k <= count).all()
    var = count * prob * (1 - prob)
    _mean_var_ok(k, count * prob, var, kurt_excess=(1 - 6 * prob * (1 - prob)) / var)


def test_binomial_special_cases_as_cpu():
    # CPU's order: count <= 0 or prob <= 0 gives 0, prob >= 1 gives count, NaN prob gives NaN.
    count = torch.tensor([5.0, 5, -1, 0, 5, 5, 5.5, 0, 3], dtype=torch.float64)
    prob = torch.tensor([1.0, 0, 0.5, 0.5, 1.5, -0.2, 1.0, float("nan"), float("nan")], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):  # (N,) float32: the moments' graph
        c, p = torch.full((N,), 3.0, dtype=dtype), torch.full((N,), 0.5, dtype=dtype)
        c[:9], p[:9] = count, prob
        got = _device("binomial", torch.binomial, c, p)
        assert got.dtype == dtype
        torch.testing.assert_close(got[:9], torch.binomial(c[:9], p[:9]), equal_nan=True, atol=0, rtol=0)
    with pytest.raises(ValueError, match="binomial only supports floating-point dtypes for count"):
        torch.binomial(torch.ones(2, dtype=torch.long, device="xla"), torch.ones(2, dtype=torch.long, device="xla"))
    with pytest.raises(RuntimeError, match="Found dtype Double but expected Float"):
        torch.binomial(torch.ones(2, device="xla"), torch.ones(2, dtype=torch.float64, device="xla"))


def test_binomial_fractional_count_as_cpu():
    # CPU draws with 1 - prob and returns count minus that draw: 5.5 - Binomial(5, 0.01),
    # while JAX's sampler would floor the count (5 - ...: 300 standard errors off).
    torch.manual_seed(11)
    k = _device("binomial", torch.binomial, torch.full((N,), 5.5), torch.full((N,), 0.99))
    assert set(k.unique().tolist()) <= {5.5, 4.5, 3.5, 2.5}
    _mean_var_ok(5.5 - k, 0.05, 5 * 0.01 * 0.99, kurt_excess=(1 - 6 * 0.01 * 0.99) / (5 * 0.01 * 0.99))


def test_samplers_are_reproducible_from_the_seed():
    def draw(seed):
        torch.manual_seed(seed)
        a, n, p = torch.full((N,), 1.5), torch.full((N,), 15.0), torch.full((N,), 0.5)
        return [torch._standard_gamma(a.to("xla")).cpu(), torch.poisson(a.to("xla")).cpu(),
                torch.binomial(n.to("xla"), p.to("xla")).cpu()]  # fmt: skip

    first, again, other = draw(5), draw(5), draw(6)
    for x, y, z in zip(first, again, other):
        assert torch.equal(x, y) and not torch.equal(x, z)


# --- reparameterized gradients: CPU's approximations --------------------------------------------


def _close_to_cpu(got, x32, x64):
    """``got`` (from float32 inputs) against CPU's float32 result ``x32``: the lowerings
    evaluate in float64 and round once, so they sit within an ulp of CPU's float64 result
    ``x64``; CPU's float32 kernel is off that by its own rounding error (large where it sums
    its Taylor series in float32). Bound: that error plus 2 ulp."""
    eps = torch.finfo(torch.float32).eps
    bound = (x32.double() - x64).abs() + 2 * eps * x64.abs()
    assert ((got.double() - x32.double()).abs() <= bound).all(), (got - x32).abs().max()


def _close_to_cpu64(got, x64):
    """Float64 results against CPU's: the approximations cancel (the saddle-point branch
    subtracts terms ~1/(x - alpha) near x = 1.1 alpha; the series subtracts terms of the
    incomplete gamma function), amplifying ulp differences between XLA's log / pow / exp and
    glibc's by up to ~1e2-1e3 (up to 55 ulp seen); rtol 1e-12 (~4500 ulp) bounds that, while a
    wrong branch, coefficient or dtype is off by 1e-7 or more."""
    torch.testing.assert_close(got, x64, rtol=1e-12, atol=1e-300)


def test_standard_gamma_grad_matches_cpu():
    gen = torch.Generator().manual_seed(7)
    # every branch: x < 0.8 (series), alpha > 8 near / away from the mode (saddle point), else
    # the rational fit; plus boundaries and extremes
    edges = torch.tensor([0.5, 9.0, 20.0, 1e-3, 1e3, 8.0])
    alpha = torch.cat([torch.rand(500, generator=gen) * 0.2 + 1e-3, torch.rand(500, generator=gen) * 8,
                       torch.rand(500, generator=gen) * 200 + 8, edges])  # fmt: skip
    x = torch._standard_gamma(alpha, generator=gen)
    x[-6:] = torch.tensor([0.8, 9.0, 21.0, 1e-30, 1e3, 0.79])
    want32 = torch._standard_gamma_grad(alpha, x)
    want64 = torch._standard_gamma_grad(alpha.double(), x.double())
    _close_to_cpu(_device("_standard_gamma_grad", torch._standard_gamma_grad, alpha, x), want32, want64)
    got64 = _device("_standard_gamma_grad", torch._standard_gamma_grad, alpha.double(), x.double())
    _close_to_cpu64(got64, want64)


def test_dirichlet_grad_matches_cpu():
    gen = torch.Generator().manual_seed(8)
    a = torch.cat([torch.rand(1000, generator=gen) * 0.5 + 0.01, torch.rand(1000, generator=gen) * 20 + 0.1,
                   torch.rand(1000, generator=gen) * 30 + 6.5])  # fmt: skip
    b = torch.cat([torch.rand(1000, generator=gen) * 20 + 0.1, torch.rand(1000, generator=gen) * 0.5 + 0.01,
                   torch.rand(1000, generator=gen) * 30 + 6.5])  # fmt: skip
    torch.manual_seed(8)
    x = torch.distributions.Beta(a, b).sample().clamp(1e-6, 1 - 1e-6)
    want32 = torch._dirichlet_grad(x, a, a + b)
    want64 = torch._dirichlet_grad(x.double(), a.double(), (a + b).double())
    _close_to_cpu(_device("_dirichlet_grad", torch._dirichlet_grad, x, a, a + b), want32, want64)
    got64 = _device("_dirichlet_grad", torch._dirichlet_grad, x.double(), a.double(), (a + b).double())
    _close_to_cpu64(got64, want64)


def test_rrelu_with_noise_backward_matches_cpu():
    gen = torch.Generator().manual_seed(9)
    g, x, noise = (torch.randn(300, generator=gen) for _ in range(3))
    x[::17] = 0
    for training in (True, False):
        for self_is_result in (True, False):
            args = (g, x, noise, 0.1, 0.3, training, self_is_result)
            got = _device("rrelu_with_noise_backward", torch.ops.aten.rrelu_with_noise_backward, *args)
            assert torch.equal(got, torch.ops.aten.rrelu_with_noise_backward(*args))


# --- fractional max pools, given their samples ------------------------------------------------

POOLS = [  # (input shape, kernel, output size)
    ((2, 3, 10, 9), (3, 2), (4, 5)),
    ((3, 17, 13), (2, 2), (8, 6)),  # no batch dim
    ((1, 2, 300, 7), (5, 3), (41, 2)),  # bfloat16 rounds the window starts (i + u ~ 40)
    ((2, 1, 6, 6), (3, 3), (1, 1)),
    ((2, 3, 7, 8, 9), (2, 3, 2), (4, 3, 5)),
    ((2, 5, 6, 7), (2, 2, 2), (3, 4, 4)),  # no batch dim
    ((1, 1, 40, 5, 5), (3, 2, 2), (30, 2, 2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float64: float32's code path
@pytest.mark.parametrize("shape, kernel, size", POOLS, ids=[str(p[0]) for p in POOLS])
def test_fractional_max_pool_equals_cpu(shape, kernel, size, dtype):
    nd = len(kernel)
    fn = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(shape, generator=gen).to(dtype)
    x.view(-1)[::7] = float("nan")  # a NaN wins its window; the last NaN of several
    x.view(-1)[3::11] = -float("inf")
    batch = shape[0] if len(shape) == nd + 2 else 1
    samples = torch.rand(batch, shape[-nd - 1], nd, generator=gen).to(dtype)
    x.requires_grad_(True)
    out, idx = fn(x, kernel, output_size=size, return_indices=True, _random_samples=samples)
    # integer cotangents: sums where windows share a maximum are exact in any order
    cot = torch.randint(-4, 5, out.shape, generator=gen).to(dtype)
    (grad,) = torch.autograd.grad(out, x, cot)
    xx = x.detach().to("xla").requires_grad_(True)
    met.clear_counters()
    xout, xidx = fn(xx, kernel, output_size=size, return_indices=True, _random_samples=samples.to("xla"))
    (xgrad,) = torch.autograd.grad(xout, xx, cot.to("xla"))
    assert torch.equal(xidx.cpu(), idx)
    torch.testing.assert_close(xout.cpu(), out.detach(), equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(xgrad.cpu(), grad, atol=0, rtol=0)
    assert not [k for k in met.executed_fallback_ops() if "fractional" in k], met.executed_fallback_ops()
