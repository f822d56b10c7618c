"""Reductions."""

from __future__ import annotations

import jax.numpy as jnp


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
    return jnp.var(self, axis=_axes(self, dim), ddof=c, keepdims=keepdim)
