"""Special functions and small integer math: angle, gcd / lcm and the ``special_*``
orthogonal polynomials.

Each function follows the scalar formula of PyTorch's CPU kernel (``ATen/native/Math.h``,
``cpu/BinaryOpsKernel.cpp``, ``cpu/zmath.h``): the same piecewise branches in the same order
and the same recurrences, so results agree with CPU within float rounding over the whole
domain, special cases included.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def _wide(x):
    """bfloat16 / float16 in float32: CPU's kernels compute half floats in float32."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def angle(out, self):
    """``angle``: ``atan2(imag, real)`` for complex; for reals CPU's ``angle_impl``: NaN stays
    NaN, negatives give pi, the rest (``-0.0`` included) 0."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        return jnp.arctan2(jnp.imag(self), jnp.real(self)).astype(out.dtype)
    x = self.astype(out.dtype)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(math.pi, out.dtype), jnp.zeros((), out.dtype)))


def gcd(out, self, other):
    """``gcd``: CPU's Euclid on ``|a|``, ``|b|`` (``abs`` wraps: ``gcd(INT64_MIN, 0)`` is
    ``INT64_MIN``), run elementwise until every remainder is 0."""
    a, b = jnp.broadcast_arrays(jnp.abs(self).astype(out.dtype), jnp.abs(other).astype(out.dtype))

    def step(ab):
        a, b = ab
        safe = jnp.where(a == 0, jnp.ones((), a.dtype), a)
        return jnp.where(a == 0, a, lax.rem(b, safe)), jnp.where(a == 0, b, a)

    _, g = lax.while_loop(lambda ab: jnp.any(ab[0] != 0), step, (a, b))
    return g


def lcm(out, self, other):
    """``lcm``: CPU's ``g == 0 ? 0 : abs(a / g * b)``; C++ computes types narrower than
    ``int`` in ``int`` (the product and its ``abs`` before the store truncates), wider ones wrap."""
    g = gcd(out, self, other)
    wide = jnp.int32 if jnp.iinfo(out.dtype).bits < 32 else out.dtype
    a, b = jnp.broadcast_arrays(self.astype(out.dtype).astype(wide), other.astype(out.dtype).astype(wide))
    g = g.astype(wide)
    safe = jnp.where(g == 0, jnp.ones((), wide), g)
    return jnp.where(g == 0, jnp.zeros((), wide), jnp.abs(lax.div(a, safe) * b)).astype(out.dtype)


# --- orthogonal polynomials (Math.h's *_polynomial_*_forward) ----------------------------


def _degree(n):
    """CPU's ``static_cast<int64_t>(n)`` of a floating degree; NaN and infinities (undefined
    in C++, INT64_MIN on CPU's x86 build) as -1: a negative degree, whose polynomial is 0."""
    if jnp.issubdtype(n.dtype, jnp.floating):
        return jnp.where(jnp.isfinite(n), n, -1).astype(jnp.int64)
    return n.astype(jnp.int64)


def _recurrence(x, n, p, q, step, k, last, skip, stop_nan=True):
    """CPU's three-term loop ``for (k = k0; k <= last(n) && !isnan(q); k++)``, run for every
    element at once until none continues: ``r = step(k, p, q)``, ``p, q = q, r``. Returns
    ``r`` (``q`` where the loop ran no step). ``skip``: the elements another branch decides,
    which run no step (CPU's kernel returns before its loop: a huge degree costs nothing there)."""
    x, n, p, q = jnp.broadcast_arrays(x, n, p, q)
    end = jnp.where(skip, k - 1, last(jnp.maximum(n, 1)))

    def active(k, q):
        go = k <= end
        return go & ~jnp.isnan(q) if stop_nan else go

    def body(state):
        k, p, q = state
        go = active(k, q)
        r = step(k.astype(x.dtype), p, q)
        return k + 1, jnp.where(go, q, p), jnp.where(go, r, q)

    _, _, q = lax.while_loop(lambda s: jnp.any(active(s[0], s[2])), body, (jnp.int64(k), p, q))
    return q


def _one(x):
    return jnp.ones((), x.dtype)


def _parity(x, n, even_value, odd_value):
    """The value at ``|x| == 1``: ``even_value`` where ``x > 0`` or ``n`` is even."""
    return jnp.where((x > 0) | (n % 2 == 0), even_value, odd_value)


# Per kind: the degree above which CPU's kernel takes the trigonometric form inside the
# interval (plain, shifted), and ``q0`` (the degree-1 polynomial) from ``y`` (``x``, or the
# shifted ``2x - 1``).
_CHEBYSHEV = {
    "t": ((6, 6), lambda y, one: y),
    "u": ((8, 6), lambda y, one: y + y),
    "v": ((8, 6), lambda y, one: y + y - one),
    "w": ((8, 4), lambda y, one: y + y + one),
}


def _chebyshev_trig(kind, y, n, shifted, x):
    """The trigonometric form (``t = acos y``) CPU's kernel uses for large degrees."""
    t = jnp.arccos(y)
    half = (n.astype(y.dtype) + 0.5) * t
    odd = (n + n + 1).astype(y.dtype)
    sign_odd = jnp.where(n % 2 == 0, odd, -odd)
    one = _one(y)
    if kind == "t":
        return jnp.cos(n.astype(y.dtype) * t)
    if kind == "u":
        m = (n + 1).astype(y.dtype)
        return jnp.where(jnp.sin(t) != 0, jnp.sin(m * t) / jnp.sin(t), m * jnp.cos(m * t) / y)
    if kind == "v":
        return jnp.where(jnp.sin(t / 2) != 1, jnp.cos(half) / jnp.cos(t / 2), sign_odd)
    sign_one = jnp.where(n % 2 == 0, one, -one)
    edge = sign_one if shifted else jnp.where(x > 0, odd, sign_one)
    return jnp.where(jnp.cos(t / 2) != 1, jnp.sin(half) / jnp.sin(t / 2), edge)


def _chebyshev_ends(kind, n, one):
    """The values at the interval's ends (``x = 1`` and ``x = -1``, shifted ``1`` and ``0``):
    (at the upper end, at the lower end for even ``n``); odd ``n`` negates the latter."""
    m = (n + 1).astype(one.dtype)
    odd = (n + n + 1).astype(one.dtype)
    return {"t": (one, one), "u": (m, m), "v": (one, odd), "w": (odd, one)}[kind]


def chebyshev(kind, shifted=False):
    """``special_[shifted_]chebyshev_polynomial_{t,u,v,w}``: CPU's branches in its order:
    0 for ``n < 0``, the values at the interval's ends, the trigonometric form for large
    degrees inside it, else the recurrence ``P(k) = 2y P(k-1) - P(k-2)`` (stopping at NaN)."""
    (limits, first) = _CHEBYSHEV[kind]
    limit = limits[1 if shifted else 0]

    def lower(out, x, n):
        x, n = jnp.broadcast_arrays(jnp.asarray(x).astype(out.dtype), _degree(jnp.asarray(n)))
        one = _one(x)
        y = x + x - one if shifted else x
        q0 = first(y, one)
        top, bottom = (x == 1, x == 0) if shifted else ((jnp.abs(x) == 1) & (x > 0), (jnp.abs(x) == 1) & (x <= 0))
        trig = (n > limit) & (jnp.abs(y) < 1)
        skip = (n < 2) | top | bottom | trig
        rec = _recurrence(x, n, one, q0, lambda k, p, q: (y + y) * q - p, 2, lambda n: n, skip)
        v = jnp.where(n == 0, one, jnp.where(n == 1, q0, rec))
        v = jnp.where(trig, _chebyshev_trig(kind, y, n, shifted, x), v)
        upper, lower_even = _chebyshev_ends(kind, n, one)
        lower_end = jnp.where(n % 2 == 0, lower_even, -lower_even)
        v = jnp.where(bottom, lower_end, jnp.where(top, upper, v))
        return jnp.where(n < 0, jnp.zeros((), x.dtype), v)

    lower.__name__ = f"{'shifted_' if shifted else ''}chebyshev_{kind}"
    return lower


chebyshev_t, chebyshev_u, chebyshev_v, chebyshev_w = (chebyshev(k) for k in "tuvw")
shifted_chebyshev_t, shifted_chebyshev_u, shifted_chebyshev_v, shifted_chebyshev_w = (
    chebyshev(k, True) for k in "tuvw"
)


def _hermite_limit(dtype):
    return {jnp.dtype(jnp.float32): 128, jnp.dtype(jnp.float64): 512}.get(jnp.dtype(dtype), 1024)


def hermite_h(out, x, n):
    """``special_hermite_polynomial_h``: ``H(k+1) = 2x H(k) - 2k H(k-1)``; NaN past CPU's
    degree limit (128 for float32, 512 for float64)."""
    x, n = jnp.broadcast_arrays(jnp.asarray(x).astype(out.dtype), _degree(jnp.asarray(n)))
    one = _one(x)
    # CPU's loop: k = 2, 4, ..., k < 2n; with j = k / 2 it runs j = 1 .. n - 1
    rec = _recurrence(
        x,
        n,
        one,
        x + x,
        lambda j, p, q: (x + x) * q - (j + j) * p,
        1,
        lambda n: n - 1,
        (n < 2) | (n > _hermite_limit(x.dtype)),
        False,
    )
    v = jnp.where(n > _hermite_limit(x.dtype), jnp.nan, rec)
    v = jnp.where(n == 0, one, jnp.where(n == 1, x + x, v))
    return jnp.where(n < 0, jnp.zeros((), x.dtype), v)


def hermite_he(out, x, n):
    """``special_hermite_polynomial_he``: ``He(k+1) = x He(k) - k He(k-1)``; NaN past CPU's
    degree limit."""
    x, n = jnp.broadcast_arrays(jnp.asarray(x).astype(out.dtype), _degree(jnp.asarray(n)))
    one = _one(x)
    rec = _recurrence(
        x, n, one, x, lambda k, p, q: x * q - k * p, 1, lambda n: n - 1, (n < 2) | (n > _hermite_limit(x.dtype)), False
    )
    v = jnp.where(n > _hermite_limit(x.dtype), jnp.nan, rec)
    v = jnp.where(n == 0, one, jnp.where(n == 1, x, v))
    return jnp.where(n < 0, jnp.zeros((), x.dtype), v)


def laguerre_l(out, x, n):
    """``special_laguerre_polynomial_l``: ``L(k+1) = ((2k + 1 - x) L(k) - k L(k-1)) / (k+1)``;
    1 at ``x == 0``."""
    x, n = jnp.broadcast_arrays(jnp.asarray(x).astype(out.dtype), _degree(jnp.asarray(n)))
    one = _one(x)
    step = lambda k, p, q: (((k + k) + (one - x)) * q - k * p) / (k + 1)  # noqa: E731
    rec = _recurrence(x, n, one, one - x, step, 1, lambda n: n - 1, (n < 2) | (jnp.abs(x) == 0))
    v = jnp.where(n == 0, one, jnp.where(n == 1, one - x, rec))
    v = jnp.where(jnp.abs(x) == 0, one, v)
    return jnp.where(n < 0, jnp.zeros((), x.dtype), v)


def legendre_p(out, x, n):
    """``special_legendre_polynomial_p``: ``P(k+1) = ((2k + 1) x P(k) - k P(k-1)) / (k+1)``."""
    x, n = jnp.broadcast_arrays(jnp.asarray(x).astype(out.dtype), _degree(jnp.asarray(n)))
    one = _one(x)
    rec = _recurrence(
        x,
        n,
        one,
        x,
        lambda k, p, q: ((k + k + 1) * x * q - k * p) / (k + 1),
        1,
        lambda n: n - 1,
        (n < 2) | (jnp.abs(x) == 1),
    )
    v = jnp.where(n == 0, one, jnp.where(n == 1, x, rec))
    v = jnp.where(jnp.abs(x) == 1, _parity(x, n, one, -one), v)
    return jnp.where(n < 0, jnp.zeros((), x.dtype), v)
