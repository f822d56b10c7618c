"""Sorting and selection: sort, topk, kthvalue, median, mode, searchsorted, isin.

Every order is a stable sort with PyTorch's NaN rule (NaN is larger than any
number), so indices of equal elements come out in their original order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _d(x, dim):
    return dim % max(x.ndim, 1)


def _argsort(x, axis, descending):
    """Stable argsort along ``axis``; NaNs last ascending, first descending."""
    return jnp.argsort(x, axis=axis, stable=True, descending=descending)


def sort(out, self, dim=-1, descending=False):
    """aten.sort (always stable, as PyTorch's CPU kernel)."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = _d(self, dim)
    i = _argsort(self, d, descending)
    return jnp.take_along_axis(self, i, axis=d), i


def sort_stable(out, self, stable=None, dim=-1, descending=False):
    """aten.sort.stable."""
    return sort(out, self, dim, descending)


def topk(out, self, k, dim=-1, largest=True, sorted=True):
    """aten.topk: the first ``k`` of a stable sort (``sorted=False`` gives sorted order too)."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = _d(self, dim)
    i = jax.lax.slice_in_dim(_argsort(self, d, largest), 0, k, axis=d)
    return jnp.take_along_axis(self, i, axis=d), i


def _pick(self, d, pos, keepdim):
    """Value and index at sorted position ``pos`` (per row) along ``d``."""
    i = _argsort(self, d, False)
    p = jnp.expand_dims(pos, d)
    idx = jnp.take_along_axis(i, p, axis=d)
    val = jnp.take_along_axis(self, idx, axis=d)
    if not keepdim:
        val, idx = jnp.squeeze(val, d), jnp.squeeze(idx, d)
    return val, idx


def _nans(x, d):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape[:d] + x.shape[d + 1 :], jnp.int64)
    return jnp.sum(jnp.isnan(x), axis=d)


def kthvalue(out, self, k, dim=-1, keepdim=False):
    """aten.kthvalue: the k-th smallest (NaN largest)."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = _d(self, dim)
    return _pick(self, d, jnp.full(self.shape[:d] + self.shape[d + 1 :], k - 1), keepdim)


def median_dim(out, self, dim, keepdim=False, ignore_nan=False):
    """aten.median.dim: the lower median; a row with NaN gives its first NaN (unless ``ignore_nan``)."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = _d(self, dim)
    n = self.shape[d]
    nan = _nans(self, d)
    if ignore_nan:
        pos = jnp.maximum((n - nan - 1) // 2, 0)
    else:
        pos = jnp.where(nan > 0, n - nan, (n - 1) // 2)
    return _pick(self, d, pos, keepdim)


def nanmedian_dim(out, self, dim, keepdim=False):
    """aten.nanmedian.dim: the lower median of the non-NaN values."""
    return median_dim(out, self, dim, keepdim, ignore_nan=True)


def median(out, self, ignore_nan=False):
    """aten.median: the lower median of all elements (NaN if any is NaN)."""
    if self.size == 0:
        return jnp.full((), jnp.nan, self.dtype)
    return median_dim(None, self.reshape(-1), 0, False, ignore_nan)[0]


def nanmedian(out, self):
    """aten.nanmedian: the lower median of the non-NaN elements."""
    return median(out, self, ignore_nan=True)


def mode(out, self, dim=-1, keepdim=False):
    """aten.mode: the most frequent value (smallest on ties) and the last index holding it."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = _d(self, dim)
    x = jnp.moveaxis(self, d, -1)
    n = x.shape[-1]
    i = _argsort(x, -1, False)
    s = jnp.take_along_axis(x, i, axis=-1)
    pos = jnp.arange(n)
    new = jnp.concatenate([jnp.ones(s.shape[:-1] + (1,), bool), s[..., 1:] != s[..., :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(new, pos, 0), axis=x.ndim - 1)
    length = pos - start + 1
    last = jnp.concatenate([new[..., 1:], jnp.ones(s.shape[:-1] + (1,), bool)], axis=-1)
    best = jnp.argmax(jnp.where(last, length, 0), axis=-1, keepdims=True)  # first (smallest) longest run
    val = jnp.take_along_axis(s, best, axis=-1)
    idx = jnp.take_along_axis(i, best, axis=-1)  # stable: the run's last element has the largest index
    val, idx = jnp.moveaxis(val, -1, d), jnp.moveaxis(idx, -1, d)
    if not keepdim:
        val, idx = jnp.squeeze(val, d), jnp.squeeze(idx, d)
    return val, idx


def searchsorted(out, sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    """aten.searchsorted (Tensor/Scalar): per-row insertion points; ``side`` overrides ``right``."""
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    s = side if side is not None else ("right" if right else "left")
    vals = jnp.asarray(self)
    if seq.shape[-1] == 0 or vals.size == 0:
        return jnp.zeros(out.shape, out.dtype)
    if seq.ndim == 1:
        res = jnp.searchsorted(seq, vals.astype(seq.dtype) if vals.ndim == 0 else vals, side=s)
    else:
        rows = seq.reshape(-1, seq.shape[-1])
        v = vals.reshape(rows.shape[0], -1)
        res = jax.vmap(lambda a, b: jnp.searchsorted(a, b, side=s))(rows, v).reshape(vals.shape)
    return res.astype(out.dtype)


def bucketize(out, self, boundaries, out_int32=False, right=False):
    """aten.bucketize (Tensor/Scalar): searchsorted into 1-d ``boundaries``."""
    return searchsorted(out, boundaries, self, out_int32, right)


# Above this many element pairs, isin sorts the test elements and binary-searches them
# instead of comparing every pair (the pairwise compare materialises an N x M mask).
_ISIN_PAIRWISE_MAX = 1 << 20


def isin(out, elements, test_elements, assume_unique=False, invert=False):
    """aten.isin (all overloads): whether each element occurs in ``test_elements``.

    Both arguments arrive promoted to their common dtype. Small problems compare every
    pair (one broadcasted ``==`` and an ``any``, what HF ``generate()`` needs for its stop
    tokens); large ones sort the test elements and binary-search each element, O((N + M)
    log M). ``assume_unique`` only licenses a faster algorithm; the result is the same.
    """
    x = jnp.asarray(elements)
    t = jnp.asarray(test_elements).reshape(-1)
    if t.size == 0:
        hit = jnp.zeros(x.shape, jnp.bool_)
    elif x.size * t.size <= _ISIN_PAIRWISE_MAX:
        hit = jnp.any(x[..., None] == t, axis=-1)
    else:
        s = jnp.sort(t)
        pos = jnp.clip(jnp.searchsorted(s, x.reshape(-1)), 0, t.size - 1)
        hit = (s[pos] == x.reshape(-1)).reshape(x.shape)
    return jnp.logical_not(hit) if invert else hit
