"""Reductions and scans."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from xlatorch.lowering.pointwise import wide as _acc  # half floats accumulate in float32


def _axes(self, dim):
    if dim is None or (isinstance(dim, tuple) and len(dim) == 0):
        return None
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(d % max(self.ndim, 1) for d in dim) if self.ndim else None


def sum_dim(out, self, dim, keepdim=False, dtype=None):
    return jnp.sum(self.astype(out.dtype), axis=_axes(self, dim), keepdims=keepdim)


def mean_dim(out, self, dim, keepdim=False, dtype=None):
    return jnp.mean(self.astype(out.dtype), axis=_axes(self, dim), keepdims=keepdim)


def amax(out, self, dim, keepdim):
    return jnp.max(self, axis=_axes(self, dim), keepdims=keepdim)


def amin(out, self, dim, keepdim):
    return jnp.min(self, axis=_axes(self, dim), keepdims=keepdim)


def max_dim(out, self, dim, keepdim):
    d = dim % max(self.ndim, 1)
    idx = jnp.argmax(self, axis=d, keepdims=keepdim) if self.ndim else jnp.zeros((), jnp.int64)
    val = jnp.max(self, axis=d, keepdims=keepdim) if self.ndim else self
    return val, idx


def min_dim(out, self, dim, keepdim):
    d = dim % max(self.ndim, 1)
    idx = jnp.argmin(self, axis=d, keepdims=keepdim) if self.ndim else jnp.zeros((), jnp.int64)
    val = jnp.min(self, axis=d, keepdims=keepdim) if self.ndim else self
    return val, idx


def argmax(out, self, dim, keepdim):
    if dim is None or self.ndim == 0:
        return jnp.argmax(self.reshape(-1)).reshape(out.shape)
    return jnp.argmax(self, axis=dim % max(self.ndim, 1), keepdims=keepdim)


def argmin(out, self, dim, keepdim):
    if dim is None or self.ndim == 0:
        return jnp.argmin(self.reshape(-1)).reshape(out.shape)
    return jnp.argmin(self, axis=dim % max(self.ndim, 1), keepdims=keepdim)


def var_correction(out, self, dim, correction, keepdim):
    c = 1 if correction is None else correction
    return jnp.var(_acc(self), axis=_axes(self, dim), ddof=c, keepdims=keepdim)


def std_correction(out, self, dim, correction, keepdim):
    """``std.correction``: the square root of ``var.correction``."""
    return jnp.sqrt(var_correction(out, self, dim, correction, keepdim))


def var_mean_correction(out, self, dim, correction, keepdim):
    """``var_mean.correction``: (variance, mean) over ``dim``."""
    mean = jnp.mean(_acc(self), axis=_axes(self, dim), keepdims=keepdim)
    return var_correction(out, self, dim, correction, keepdim), mean


def std_mean_correction(out, self, dim, correction, keepdim):
    """``std_mean.correction``: (standard deviation, mean) over ``dim``."""
    v, m = var_mean_correction(out, self, dim, correction, keepdim)
    return jnp.sqrt(v), m


def any_(out, self, dim, keepdim):
    """``any.dim`` / ``any.dims``: whether any element is non-zero (NaN counts)."""
    return jnp.any(self != 0, axis=_axes(self, dim), keepdims=keepdim)


def all_(out, self, dim, keepdim):
    """``all.dim`` / ``all.dims``: whether every element is non-zero (NaN counts)."""
    return jnp.all(self != 0, axis=_axes(self, dim), keepdims=keepdim)


def prod_dim(out, self, dim, keepdim, dtype):
    """``prod.dim_int``: the product over one dim, in the output dtype."""
    return jnp.prod(self.astype(out.dtype), axis=_axes(self, dim), keepdims=keepdim)


def nansum(out, self, dim, keepdim, dtype):
    """``nansum``: the sum with NaNs counted as zero."""
    x = self.astype(out.dtype)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        x = jnp.where(jnp.isnan(x), 0, x)
    return jnp.sum(x, axis=_axes(self, dim), keepdims=keepdim)


def count_nonzero(out, self, dim):
    """``count_nonzero``: the number of non-zero elements over ``dim`` (all dims if None)."""
    return jnp.sum(self != 0, axis=_axes(self, dim), dtype=jnp.int64)


def aminmax(out, self, dim, keepdim):
    """``aminmax``: (min, max) over ``dim``, or over everything when ``dim`` is None."""
    ax = _axes(self, dim)
    return jnp.min(self, axis=ax, keepdims=keepdim), jnp.max(self, axis=ax, keepdims=keepdim)


def logsumexp(out, self, dim, keepdim):
    """``logsumexp``: log(sum(exp(x))) over ``dim``, stable, exact at +-inf."""
    x = self.astype(out.dtype)
    return jax.scipy.special.logsumexp(_acc(x), axis=_axes(self, dim), keepdims=keepdim)


def _scan(f, self, dim, dtype):
    x = _acc(self.astype(dtype))
    return x if self.ndim == 0 else f(x, axis=dim % self.ndim)


def cumsum(out, self, dim, dtype):
    """``cumsum`` along ``dim`` in the output dtype (float32 accumulation for bf16/f16)."""
    return _scan(jnp.cumsum, self, dim, out.dtype)


def cumprod(out, self, dim, dtype):
    """``cumprod`` along ``dim`` in the output dtype (float32 accumulation for bf16/f16)."""
    return _scan(jnp.cumprod, self, dim, out.dtype)


def logcumsumexp(out, self, dim):
    """``logcumsumexp``: running log(sum(exp(x))) along ``dim``."""
    return _scan(lax.cumlogsumexp, self, dim, out.dtype)


def _cumext(self, dim, better):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = dim % self.ndim
    idx = lax.broadcasted_iota(jnp.int64, self.shape, d)

    def combine(a, b):
        # b comes later: it wins ties, and a NaN wins over everything (PyTorch's rule).
        take_b = better(b[0], a[0])
        if jnp.issubdtype(self.dtype, jnp.inexact):
            take_b = jnp.isnan(b[0]) | (~jnp.isnan(a[0]) & take_b)
        return jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1])

    return lax.associative_scan(combine, (self, idx), axis=d)


def cummax(out, self, dim):
    """``cummax``: running maximum along ``dim`` and the index where it was attained."""
    return _cumext(self, dim, lambda b, a: b >= a)


def cummin(out, self, dim):
    """``cummin``: running minimum along ``dim`` and the index where it was attained."""
    return _cumext(self, dim, lambda b, a: b <= a)
