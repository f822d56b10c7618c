"""Factories whose values follow a formula: ranges, spaces and triangle indices.

``start``/``end`` arrive as traced scalars (0-d arrays), so changing them never recompiles;
sizes are static. Values are computed as PyTorch's CPU kernels compute them (the endpoints
rounded to the result dtype first, the step in that dtype, each half counted from its
nearer endpoint), so integer and bfloat16 results match eager exactly, not just closely.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from xlatorch.lowering.pointwise import HALF

__all__ = ["linspace", "logspace", "triu_indices", "tril_indices"]


def _integral(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_


def _exponents(dt, start, end, steps: int, calc):
    """The CPU kernels' ``start + step * i`` for the first half, ``end - step * (steps - 1 - i)``
    for the rest, with ``start``/``end`` rounded to ``dt`` and the arithmetic in ``calc``."""
    s = jnp.asarray(start).astype(dt).astype(calc)
    e = jnp.asarray(end).astype(dt).astype(calc)
    # A true division, as on CPU: behind the barrier XLA cannot turn it into a multiplication
    # by the constant's reciprocal (linspace(50, 1, 50) would give 24.999... -> 24).
    step = (e - s) / lax.optimization_barrier(jnp.asarray(steps - 1, calc))
    i = np.arange(steps)
    lo = s + step * jnp.asarray(i, calc)
    hi = e - step * jnp.asarray(steps - 1 - i, calc)
    return jnp.where(i < steps // 2, lo, hi)


def arange(out, start, end, step):
    """``arange`` with CPU's values: integers exactly; floats as CPU's kernel computes them. It
    fills blocks of two 32-byte vectors (8 float32s), each vector from its first index's value
    ``start + step * i`` (in float64; in float32, the accumulation type, for the half dtypes)
    rounded to the dtype, then ``base + j * step`` in float64, rounded; after the last whole
    block, ``start + step * i`` rounded. So float32's ``arange(0, 1, 0.1)[9]`` is 0.89999998,
    where ``9 * 0.1`` in float32 gave 0.90000004. (float64: CPU fuses ``base + j * step`` into one rounding, which XLA's
    program does not: the last bit of about one value in six differs. Over 32,768 elements CPU
    splits the range among its threads; the values follow one thread's.)"""
    n = out.shape[0]
    if not jnp.issubdtype(out.dtype, jnp.floating):
        return jnp.arange(start, end, step, dtype=out.dtype)[:n]
    acc = jnp.float32 if out.dtype in HALF else jnp.float64
    width = 32 // jnp.dtype(out.dtype).itemsize
    i = jnp.arange(n, dtype=jnp.int64)
    first = i // width * width
    base = (jnp.asarray(start, acc) + jnp.asarray(step, acc) * first.astype(acc)).astype(out.dtype)
    in_block = base.astype(jnp.float64) + (i - first).astype(jnp.float64) * step
    tail = jnp.asarray(start, acc) + jnp.asarray(step, acc) * i.astype(acc)
    return jnp.where(i < n // (2 * width) * (2 * width), in_block, tail).astype(out.dtype)


def linspace(out, start, end, steps: int, dtype=None, layout=None, device=None, pin_memory=None):
    """aten.linspace (and its Tensor overloads): ``steps`` evenly spaced values.

    Integer results: the step in float64, each value truncated (CPU's ``step_t = double``);
    floating results: the step and values in the result dtype.
    """
    dt = out.dtype
    if steps == 1:
        return jnp.full((1,), jnp.asarray(start).astype(dt), dt)
    if steps == 0:
        return jnp.zeros((0,), dt)
    calc = jnp.float64 if _integral(dt) else dt
    return _exponents(dt, start, end, steps, calc).astype(dt)


def logspace(out, start, end, steps: int, base=10.0, dtype=None, layout=None, device=None, pin_memory=None):
    """aten.logspace: ``base ** linspace(start, end)``, the power taken in float64 as CPU does."""
    dt = out.dtype
    base = jnp.asarray(base, jnp.float64)
    if steps == 1:  # CPU: pow(base, start) with start as a double, not rounded to dt first
        return jnp.full((1,), jnp.power(base, jnp.asarray(start).astype(jnp.float64)).astype(dt), dt)
    if steps == 0:
        return jnp.zeros((0,), dt)
    # The exponents in float64 for integer results; floating results round the endpoints to
    # their dtype but not the step (CPU: logspace(0, 4, 4) in bfloat16 is 1, 21.5, 464, 9984).
    calc = jnp.float64 if _integral(dt) or dt in (jnp.bfloat16, jnp.float16) else dt
    x = _exponents(dt, start, end, steps, calc)
    return jnp.power(base, x.astype(jnp.float64)).astype(dt)


def _tri_indices(out, row: int, col: int, offset: int, upper: bool):
    r, c = (np.triu_indices if upper else np.tril_indices)(row, offset, col)
    return jnp.asarray(np.stack([r, c]), out.dtype)


def triu_indices(out, row: int, col: int, offset: int = 0, dtype=None, layout=None, device=None, pin_memory=None):
    """aten.triu_indices: a (2, N) constant, the upper triangle's coordinates in row-major order."""
    return _tri_indices(out, row, col, offset, True)


def tril_indices(out, row: int, col: int, offset: int = 0, dtype=None, layout=None, device=None, pin_memory=None):
    """aten.tril_indices: a (2, N) constant, the lower triangle's coordinates in row-major order."""
    return _tri_indices(out, row, col, offset, False)
