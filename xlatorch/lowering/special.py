"""Special functions and small integer math: angle, gcd / lcm, the incomplete gamma
functions, histc, and the ``special_*`` families (Bessel functions, orthogonal polynomials).

Each function follows the scalar formula of PyTorch's CPU kernel (``ATen/native/Math.h``,
``cpu/BinaryOpsKernel.cpp``, ``cpu/HistogramKernel.cpp``): the same piecewise branches and
the same rational approximations, so results agree with CPU within float rounding over
the whole domain, special cases included.
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
