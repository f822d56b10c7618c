"""Samplers behind ``torch.distributions`` (gamma, Dirichlet, Poisson, binomial) and the
reparameterized gradients of gamma and Dirichlet samples.

The samplers draw from JAX's stream, not CPU's, so values differ from CPU's while the
distribution, dtypes and edge cases match: like CPU's kernels (which sample with ``double``
arithmetic whatever the tensor's dtype) they draw in float64, apply CPU's clamps and special
cases, and round once to the result dtype. float64 matters: a float32 rejection test of a
large rate cancels catastrophically (Poisson rate 1e10: terms of 2e11 whose difference is
the log-acceptance), and a Dirichlet of small concentrations needs gammas below float32's
range to normalise as CPU does.

The gradients are CPU's approximations (``ATen/native/Distributions.h``: a Taylor series, a
Rice saddle-point expansion, rational fits) term by term, with CPU's branch conditions in
the tensors' dtype. Each is evaluated in float64 and rounded once, as CPU evaluates most of
them (``accscalar_t``); where CPU uses the tensors' dtype (the Dirichlet gradient's Taylor
series, and ``digamma_one``'s stepping) float32 results differ from CPU's by CPU's own
float32 rounding error, which no emulation reproduces (CPU's log / pow are glibc's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from xlatorch.lowering import rng

_F64 = jnp.float64
_DBL_MIN = float(np.finfo(np.float64).tiny)


def _f32(v: float) -> float:
    """A C++ ``float`` literal (``0.8f``) as CPU compares it with a double."""
    return float(np.float32(v))


def _below_one(dtype):
    """``nexttoward(1, 0)`` in ``dtype``: the largest Dirichlet component CPU returns."""
    return np.nextafter(np.ones((), dtype), np.zeros((), dtype))


def standard_gamma(out, self, generator, seed):
    """``aten::_standard_gamma``: Gamma(self, 1) samples; CPU raises each below the dtype's
    smallest normal number to it (an underflowed sample, or concentration 0, gives ``tiny``)."""
    g = jax.random.gamma(rng.key(seed), self.astype(_F64), dtype=_F64)
    return jnp.maximum(g.astype(out.dtype), jnp.finfo(out.dtype).tiny)


def sample_dirichlet(out, self, generator, seed):
    """``aten::_sample_dirichlet``: float64 gammas, each at least float64's smallest normal
    number, normalised along the last dim, then clamped to [tiny, nextafter(1, 0)]."""
    g = jnp.maximum(jax.random.gamma(rng.key(seed), self.astype(_F64), dtype=_F64), _DBL_MIN)
    r = g / (g.sum(-1, keepdims=True) if g.ndim else g)
    return jnp.clip(r.astype(out.dtype), jnp.finfo(out.dtype).tiny, _below_one(out.dtype))


def poisson(out, self, generator, seed):
    """``aten::poisson``: Poisson(self) counts in the rate's dtype, by CPU's algorithms in
    float64 (negative and NaN rates raise: ``poisson_rate``). JAX's own sampler is not used:
    its transformed rejection gives a variance 1.3 times the rate at rate 1e10."""
    lam = jnp.where(self >= 0, self, 0).astype(_F64)
    return _poisson_f64(rng.key(seed), lam).astype(out.dtype)


def _poisson_f64(key, lam):
    """CPU's ``sample_poisson`` for every element at once: Knuth's product of uniforms below
    rate 10, Hoermann's transformed rejection (PTRS) from 10 on; rate 0 gives 0. Each round
    draws one pair of uniforms per element; elements that are done keep their count."""
    small = lam < 10
    enlam = jnp.exp(-jnp.where(small, lam, 0))
    lam_r = jnp.where(small, 10, lam)
    loglam = jnp.log(lam_r)
    b = 0.931 + 2.53 * jnp.sqrt(lam_r)
    a = -0.059 + 0.02483 * b
    log_invalpha = jnp.log(1.1239 + 1.1328 / (b - 3.4))
    vr = 0.9277 - 3.6224 / (b - 2)

    def body(state):
        key, k, done, prod = state
        key, k1, k2 = jax.random.split(key, 3)
        u = jax.random.uniform(k1, lam.shape, _F64)
        v = jax.random.uniform(k2, lam.shape, _F64)
        prod_next = prod * u  # Knuth: one more event while the product stays above e^-rate
        more = prod_next > enlam
        us = 0.5 - jnp.abs(u - 0.5)
        cand = jnp.floor((2 * a / us + b) * (u - 0.5) + lam_r + 0.43)
        fast = (us >= 0.07) & (v <= vr)
        reject = (cand < 0) | ((us < 0.013) & (v > us))
        slow = jnp.log(v) + log_invalpha - jnp.log(a / (us * us) + b) <= -lam_r + cand * loglam - lax.lgamma(cand + 1)
        accept = fast | (~reject & slow)
        k_next = jnp.where(small, jnp.where(more, k + 1, k), jnp.where(accept, cand, k))
        fin = jnp.where(small, ~more, accept)
        return key, jnp.where(done, k, k_next), done | fin, jnp.where(done, prod, prod_next)

    init = (key, jnp.zeros(lam.shape, _F64), lam == 0, jnp.ones(lam.shape, _F64))
    return lax.while_loop(lambda st: ~jnp.all(st[2]), body, init)[1]


def poisson_rate(self):
    """The check CPU's Poisson kernel makes on each rate (NaN fails it too)."""
    if self.size == 0:
        return None
    bad = ~(self >= 0)
    pos = jnp.argmax(bad.reshape(-1))
    return (
        jnp.any(bad),
        self.reshape(-1)[pos],
        pos,
        RuntimeError,
        "invalid Poisson rate, expected rate to be non-negative",
    )


def binomial(out, count, prob, generator, seed):
    """``aten::binomial``: Binomial(count, prob) draws by CPU's ``sample_binomial`` in float64:
    0 where count <= 0 or prob <= 0, count where prob >= 1, NaN where prob is NaN; else with
    q = min(prob, 1 - prob), inversion (count * q < 10) or BTRS, and count minus the draw
    when prob > 1/2. (JAX's sampler floors a fractional count, which CPU's does not.)"""
    n = jnp.broadcast_to(count, out.shape).astype(_F64)
    p = jnp.broadcast_to(prob, out.shape).astype(_F64)
    # An infinite or NaN count would never be accepted (CPU returns inf or NaN, or never
    # returns): NaN here.
    drawn = (n > 0) & (p > 0) & (p < 1) & (n < jnp.inf)
    flip = p > 0.5
    q = jnp.where(drawn, jnp.where(flip, 1 - p, p), 0.5)
    s = _binomial_f64(rng.key(seed), jnp.where(drawn, n, 1), q)
    s = jnp.where(flip, n - s, s)
    s = jnp.where((n == jnp.inf) | jnp.isnan(n), jnp.nan, s)
    s = jnp.where(jnp.isnan(p), jnp.nan, s)
    s = jnp.where(p >= 1, n, s)
    s = jnp.where((n <= 0) | (p <= 0), 0, s)
    return s.astype(out.dtype)


_STIRLING_TAIL = np.array([0.0810614667953272, 0.0413406959554092, 0.0276779256849983, 0.02079067210376509,
                           0.0166446911898211, 0.0138761288230707, 0.0118967099458917, 0.0104112652619720,
                           0.00925546218271273, 0.00833056343336287])  # fmt: skip


def _stirling_tail(k):
    kp1sq = (k + 1) * (k + 1)
    far = (1.0 / 12 - (1.0 / 360 - 1.0 / 1260 / kp1sq) / kp1sq) / (k + 1)
    return jnp.where(k <= 9, jnp.asarray(_STIRLING_TAIL)[jnp.clip(k, 0, 9).astype(jnp.int32)], far)


def _binomial_f64(key, n, p):
    """CPU's ``binomial_inversion`` (count * p < 10) and ``btrs`` for p <= 1/2, every element
    at once: each round draws a pair of uniforms per element; finished ones keep their draw."""
    inv = n * p < 10
    logq = jnp.log1p(-p)
    sd = jnp.sqrt(n * p * (1 - p))
    b = 1.15 + 2.53 * sd
    a = -0.0873 + 0.0248 * b + 0.01 * p
    c = n * p + 0.5
    v_r = 0.92 - 4.2 / b
    r = p / (1 - p)
    alpha = (2.83 + 5.1 / b) * sd
    m = jnp.floor((n + 1) * p)
    tail_m = _stirling_tail(m) + _stirling_tail(n - m)

    def body(state):
        key, k, done, geom_sum = state
        key, k1, k2 = jax.random.split(key, 3)
        u = jax.random.uniform(k1, n.shape, _F64)
        v = jax.random.uniform(k2, n.shape, _F64)
        # inversion: count the geometric gaps that fit in n
        gs = geom_sum + jnp.ceil(jnp.log(u) / logq)
        over = gs > n
        # BTRS
        uu = u - 0.5
        us = 0.5 - jnp.abs(uu)
        cand = jnp.floor((2 * a / us + b) * uu + c)
        ok = (cand >= 0) & (cand <= n)
        fast = (us >= 0.07) & (v <= v_r)
        bound = ((m + 0.5) * jnp.log((m + 1) / (r * (n - m + 1))) + (n + 1) * jnp.log((n - m + 1) / (n - cand + 1))
                 + (cand + 0.5) * jnp.log(r * (n - cand + 1) / (cand + 1)) + tail_m
                 - _stirling_tail(cand) - _stirling_tail(n - cand))  # fmt: skip
        accept = ok & (fast | (jnp.log(v * alpha / (a / (us * us) + b)) <= bound))
        k_next = jnp.where(inv, jnp.where(over, k, k + 1), jnp.where(accept, cand, k))
        fin = jnp.where(inv, over, accept)
        return key, jnp.where(done, k, k_next), done | fin, jnp.where(done | ~inv, geom_sum, gs)

    init = (key, jnp.zeros(n.shape, _F64), jnp.zeros(n.shape, jnp.bool_), jnp.zeros(n.shape, _F64))
    return lax.while_loop(lambda st: ~jnp.all(st[2]), body, init)[1]


# --- reparameterized gradients ------------------------------------------------------------

_DIGAMMA_A = (8.33333333333333333333e-2, -2.10927960927960927961e-2, 7.57575757575757575758e-3,
              -4.16666666666666666667e-3, 3.96825396825396825397e-3, -8.33333333333333333333e-3,
              8.33333333333333333333e-2)  # fmt: skip


def _digamma_one(x):
    """CPU's ``digamma_one<scalar_t, double>``: ``x`` steps up to 10 in its own dtype while the
    sum gathers in float64; the result in ``x``'s dtype."""
    dt = x.dtype
    pi = jnp.asarray(math.pi, dt)
    neg = x < 0
    extra = jnp.where(neg, -pi / jnp.tan(pi * x), 0).astype(_F64)
    pole = (x == 0) | (neg & (x == jnp.floor(x)))
    x = jnp.where(neg, 1 - x, x)
    acc = jnp.zeros(x.shape, _F64)
    for _ in range(10):  # from any x > 0, ten steps of 1 reach 10
        step = x < 10
        acc = acc - jnp.where(step, 1 / x, 0).astype(_F64)
        x = jnp.where(step, x + 1, x)
    z = 1.0 / (x * x).astype(_F64)
    poly = jnp.zeros(x.shape, _F64)
    for a in _DIGAMMA_A:
        poly = poly * z + a
    y = jnp.where(x < _f32(1.0e17), z * poly, 0)
    tail = acc + jnp.log(x).astype(_F64) - (0.5 / x).astype(_F64) - y + extra
    res = jnp.where(x == 10, acc + 2.25175258906672110764 + extra, tail)
    return jnp.where(pole, jnp.inf, res).astype(dt)


_GAMMA_UV = np.array([
    [0.16009398, -0.094634809, 0.025146376, -0.0030648343, 1, 0.32668115, 0.10406089, 0.0014179084],
    [0.53487893, 0.1298071, 0.065735949, -0.0015649758, 0.16639465, 0.020070113, -0.0035938915, -0.00058392623],
    [0.040121004, -0.0065914022, -0.0026286047, -0.0013441777, 0.017050642, -0.0021309326, 0.00085092367,
     -1.5247877e-07],
])  # fmt: skip


def standard_gamma_grad(out, self, output):
    """``aten::_standard_gamma_grad``: d sample / d alpha of Gamma(alpha) samples, CPU's
    three approximations in float64 (series for x < 0.8, saddle point for alpha > 8, a
    bivariate rational fit otherwise)."""
    alpha, x = jnp.broadcast_arrays(self.astype(_F64), output.astype(_F64))
    # Taylor series of the incomplete gamma function (x < 0.8).
    numer, denom = jnp.ones_like(x), alpha
    s1, s2 = numer / denom, numer / (denom * denom)
    for i in range(1, 6):
        numer = numer * (-x / i)
        denom = denom + 1
        s1 = s1 + numer / denom
        s2 = s2 + numer / (denom * denom)
    pow_xa = jnp.power(x, alpha)
    pdf = jnp.power(x, alpha - 1) * jnp.exp(-x)
    cdf_alpha = (jnp.log(x) - _digamma_one(alpha)) * (pow_xa * s1) - pow_xa * s2
    series = -cdf_alpha / pdf
    series = jnp.where(jnp.isnan(series), 0, series)
    # Rice saddle point expansion (alpha > 8).
    near = (
        (1 + 24 * alpha * (1 + 12 * alpha))
        * (1440 * (alpha * alpha) + 6 * x * (53 - 120 * x) - 65 * x * x / alpha + alpha * (107 + 3600 * x))
        / (1244160 * (alpha * alpha) * (alpha * alpha))
    )
    den = jnp.sqrt(8 * alpha)
    term2 = den / (alpha - x)
    term3 = jnp.power(x - alpha - alpha * jnp.log(x / alpha), -1.5)
    term23 = jnp.where(x < alpha, term2 - term3, term2 + term3)
    term1 = jnp.log(x / alpha) * term23 - jnp.sqrt(2 / alpha) * (alpha + x) / ((alpha - x) * (alpha - x))
    stirling = 1 + 1 / (12 * alpha) * (1 + 1 / (24 * alpha))
    far = -stirling * (x * term1) / den
    saddle = jnp.where((_f32(0.9) * alpha <= x) & (x <= _f32(1.1) * alpha), near, far)
    # Bivariate rational approximation.
    u, v = jnp.log(x / alpha), jnp.log(alpha)
    c = [_GAMMA_UV[0, i] + u * (_GAMMA_UV[1, i] + u * _GAMMA_UV[2, i]) for i in range(8)]
    p = c[0] + v * (c[1] + v * (c[2] + v * c[3]))
    q = c[4] + v * (c[5] + v * (c[6] + v * c[7]))
    rational = jnp.exp(p / q)
    res = jnp.where(x < _f32(0.8), series, jnp.where(alpha > 8.0, saddle, rational))
    return res.astype(out.dtype)


def _beta_grad_alpha_small(x, alpha, beta):
    """CPU's Taylor expansion of the Beta(alpha, beta) sample gradient for x near 0."""
    factor = _digamma_one(alpha) - _digamma_one(alpha + beta) - jnp.log(x)
    numer = jnp.ones_like(x)
    series = numer / alpha * (factor + 1 / alpha)
    for i in range(1, 11):
        numer = numer * ((i - beta) * x / i)
        denom = alpha + i
        series = series + numer / denom * (factor + 1 / denom)
    res = x * jnp.power(1 - x, -beta) * series
    return jnp.where(jnp.isnan(res), 0, res)


def _beta_grad_beta_small(x, alpha, beta):
    """CPU's Taylor expansion of the gradient with respect to beta for x near 0."""
    factor = _digamma_one(alpha + beta) - _digamma_one(beta)
    numer, betas, dbetas = jnp.ones_like(x), jnp.ones_like(x), jnp.zeros_like(x)
    series = factor / alpha
    for i in range(1, 9):
        numer = numer * (-x / i)
        dbetas = dbetas * (beta - i) + betas
        betas = betas * (beta - i)
        series = series + numer / (alpha + i) * (dbetas + factor * betas)
    res = -jnp.power(1 - x, 1 - beta) * series
    return jnp.where(jnp.isnan(res), 0, res)


def _beta_grad_alpha_mid(x, alpha, beta):
    """CPU's Rice saddle point expansion for large alpha and beta, in float64."""
    total = alpha + beta
    mean = alpha / total
    std = jnp.sqrt(alpha * beta / (total + 1)) / total
    b2 = beta * beta
    inner = (453 + 1620 * beta * (1 - x) - 455 * x) * beta + alpha * (8 * (1 - x) * (135 * beta - 11))
    poly = 47 * x * b2 * b2 + alpha * (
        (43 + 20 * (16 + 27 * beta) * x) * b2 * beta + alpha * (3 * (59 + 180 * beta - 90 * x) * b2 + alpha * inner)
    )
    pre_num = (1 + 12 * alpha) * (1 + 12 * beta) / (total * total)
    pre_den = 12960 * alpha * alpha * alpha * beta * beta * (1 + 12 * total)
    near = pre_num / (1 - x) * poly / pre_den
    prefactor = -x / jnp.sqrt(2 * alpha * beta / total)
    stirling = ((1 + 1 / (12 * alpha) + 1 / (288 * alpha * alpha)) * (1 + 1 / (12 * beta) + 1 / (288 * beta * beta))
                / (1 + 1 / (12 * total) + 1 / (288 * total * total)))  # fmt: skip
    t1_num = 2 * (alpha * alpha) * (x - 1) + alpha * beta * (x - 1) - x * (beta * beta)
    axbx = alpha * (x - 1) + beta * x
    t1_den = jnp.sqrt(2 * alpha / beta) * jnp.power(total, 1.5) * axbx * axbx
    t2 = 0.5 * jnp.log(alpha / (total * x))
    t3 = jnp.sqrt(8 * alpha * beta / total) / (beta * x + alpha * (x - 1))
    t4 = jnp.power(beta * jnp.log(beta / (total * (1 - x))) + alpha * jnp.log(alpha / (total * x)), -1.5)
    far = stirling * prefactor * (t1_num / t1_den + t2 * (t3 + jnp.where(x < mean, t4, -t4)))
    return jnp.where((mean - 0.1 * std <= x) & (x <= mean + 0.1 * std), near, far)


_DIRICHLET_C = np.array([
    [[[1.003668233, -0.01061107488, -0.0657888334, 0.01201642863],
      [0.6336835991, -0.3557432599, 0.05486251648, -0.001465281033],
      [-0.03276231906, 0.004474107445, 0.002429354597, -0.0001557569013]],
     [[0.221950385, -0.3187676331, 0.01799915743, 0.01074823814],
      [-0.2951249643, 0.06219954479, 0.01535556598, 0.001550077057],
      [0.02155310298, 0.004170831599, 0.001292462449, 6.976601077e-05]],
     [[-0.05980841433, 0.008441916499, 0.01085618172, 0.002319392565],
      [0.02911413504, 0.01400243777, -0.002721828457, 0.000751041181],
      [0.005900514878, -0.001936558688, -9.495446725e-06, 5.385558597e-05]]],
    [[[1, -0.02924021934, -0.04438342661, 0.007285809825],
      [0.6357567472, -0.3473456711, 0.05454656494, -0.002407477521],
      [-0.03301322327, 0.004845219414, 0.00231480583, -0.0002307248149]],
     [[0.5925320577, -0.1757678135, 0.01505928619, 0.000564515273],
      [0.1014815858, -0.06589186703, 0.01272886114, -0.0007316646956],
      [-0.007258481865, 0.001096195486, 0.0003934994223, -4.12701925e-05]],
     [[0.06469649321, -0.0236701437, 0.002902096474, -5.896963079e-05],
      [0.001925008108, -0.002869809258, 0.0008000589141, -6.063713228e-05],
      [-0.0003477407336, 6.959756487e-05, 1.097287507e-05, -1.650964693e-06]]],
])  # fmt: skip


def dirichlet_grad(out, x, alpha, total):
    """``aten::_dirichlet_grad``: CPU's scaled reparameterized gradient of Beta(alpha,
    total - alpha) samples ``x``: Taylor expansions near 0 and 1, a saddle point expansion
    when both parameters exceed 6, else a rational correction of an analytic approximation;
    branches chosen in the tensors' dtype, values in float64."""
    x, alpha, total = (jnp.broadcast_to(t, out.shape) for t in (x, alpha, total))
    beta = total - alpha
    boundary = total * x * (1 - x)
    x_, a_, t_ = x.astype(_F64), alpha.astype(_F64), total.astype(_F64)
    b_ = t_ - a_
    # CPU evaluates these two series in the tensors' dtype; float64 here, rounded once: no
    # emulation reproduces its float32 rounding (its log / pow are glibc's), so the float64
    # value, which differs from CPU's by CPU's own rounding error, is the one to give.
    small_alpha = _beta_grad_alpha_small(x_, a_, b_).astype(x.dtype)
    small_beta = (-_beta_grad_beta_small(1 - x_, b_, a_)).astype(x.dtype)
    mid = _beta_grad_alpha_mid(x_, a_, b_).astype(x.dtype)
    u = jnp.log(x_)
    a = jnp.log(a_) - u
    b = jnp.log(t_) - a
    p = q = jnp.zeros(out.shape, _F64)
    for i, pu in enumerate((1, u, u * u)):
        for j, pa in enumerate((1, a, a * a)):
            ua = pu * pa
            cp, cq = _DIRICHLET_C[0, i, j], _DIRICHLET_C[1, i, j]
            p = p + ua * (cp[0] + b * (cp[1] + b * (cp[2] + b * cp[3])))
            q = q + ua * (cq[0] + b * (cq[1] + b * (cq[2] + b * cq[3])))
    approx = x_ * (_digamma_one(t_) - _digamma_one(a_)) / b_
    rational = (p / q * approx).astype(x.dtype)
    res = jnp.where((x <= 0.5) & (boundary < 2.5), small_alpha,
                    jnp.where((x >= 0.5) & (boundary < 0.75), small_beta,
                              jnp.where((alpha > 6) & (beta > 6), mid, rational)))  # fmt: skip
    return res.astype(out.dtype)


# PyTorch has no meta kernels for these (their output shapes, for tracing). CPU's kernels
# write into a tensor of the first argument's shape and dtype, which the others broadcast to;
# where they do not (or a dtype differs), these raise, and the runtime then reports the error
# CPU's kernel gives (trace/nodes.py error_on_cpu).
def _like_first_meta(first, *others, generator=None):
    if not first.dtype.is_floating_point or any(
        o.dtype != first.dtype or torch.broadcast_shapes(first.shape, o.shape) != first.shape for o in others
    ):
        raise RuntimeError("arguments CPU's kernel refuses")
    return first.new_empty(first.shape)


_LIB = torch.library.Library("aten", "IMPL")
for _name in ("_sample_dirichlet", "binomial", "_standard_gamma_grad", "_dirichlet_grad"):
    try:
        _LIB.impl(_name, _like_first_meta, "Meta")
    except RuntimeError:  # a later torch registering its own meta kernel
        pass
