"""Segment reductions: ``torch.segment_reduce`` and its backward, as XLA segment scatters.

Segments are runs along ``axis`` given by ``lengths`` or ``offsets`` (one row per index of
the dims before ``axis``). Each element gets the id of its segment (one past the last for
elements after the final offset, which belong to none); a row-major id over the rows makes
one ``segment_*`` call cover every row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["segment_reduce", "segment_reduce_backward"]

_LOW = (jnp.bfloat16, jnp.float16)


def _offsets(lengths, offsets):
    if offsets is not None:
        return offsets.astype(jnp.int64)
    zero = jnp.zeros(lengths.shape[:-1] + (1,), jnp.int64)
    return jnp.concatenate([zero, jnp.cumsum(lengths.astype(jnp.int64), axis=-1)], axis=-1)


def _ids(data, lengths, offsets, axis):
    """(flat segment id per element of ``data`` moved to (rows * L, ...), rows, segments)."""
    off = _offsets(lengths, offsets)
    rows, n = math.prod(data.shape[:axis]), data.shape[axis]
    segs = off.shape[-1] - 1
    off = jnp.broadcast_to(off.reshape((-1, segs + 1)), (rows, segs + 1))
    pos = jnp.arange(n)
    seg = jnp.sum(off[:, 1:, None] <= pos, axis=1)  # segments ended at or before pos
    inside = (pos >= off[:, :1]) & (pos < off[:, -1:])
    seg = jnp.where(inside, seg, segs)
    return (seg + jnp.arange(rows)[:, None] * (segs + 1)).reshape(-1), rows, segs


def _rows(x, rows, axis):
    return x.reshape((rows * x.shape[axis],) + x.shape[axis + 1 :])


def segment_reduce(out, data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """aten.segment_reduce: sum/mean/max/min/prod over each segment (low-precision input in
    float32); an empty segment gives ``initial``, or 0, NaN (mean), -inf/inf (max/min), 1 (prod)."""
    axis = axis % data.ndim
    ids, rows, segs = _ids(data, lengths, offsets, axis)
    x = _rows(data, rows, axis)
    x = x.astype(jnp.float32) if x.dtype in _LOW else x
    num = rows * (segs + 1)
    init = None if initial is None else jnp.asarray(initial).astype(x.dtype)
    if reduce in ("sum", "mean"):
        res = jax.ops.segment_sum(x, ids, num)
        res = res if init is None else res + init
        if reduce == "mean":
            cnt = jax.ops.segment_sum(jnp.ones(ids.shape, x.dtype), ids, num).reshape((num,) + (1,) * (x.ndim - 1))
            empty = jnp.asarray(jnp.nan, x.dtype) if init is None else init
            res = jnp.where(cnt > 0, res / jnp.maximum(cnt, 1), empty)
    elif reduce in ("max", "min"):
        res = (jax.ops.segment_max if reduce == "max" else jax.ops.segment_min)(x, ids, num)
        if init is not None:
            res = (jnp.maximum if reduce == "max" else jnp.minimum)(res, init)
    else:
        res = jax.ops.segment_prod(x, ids, num)
        res = res if init is None else res * init
    res = res.reshape((rows, segs + 1) + x.shape[1:])[:, :segs]
    return res.reshape(out.shape).astype(out.dtype)


def segment_reduce_backward(out, grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    """aten._segment_reduce_backward: each element's share of its segment's gradient, by CPU's
    rules (max/min: ties share a positive gradient equally; prod: exclusive products for zeros)."""
    axis = axis % data.ndim
    ids, rows, segs = _ids(data, lengths, offsets, axis)
    x = _rows(data, rows, axis)
    dt = x.dtype
    x = x.astype(jnp.float32) if dt in _LOW else x
    num = rows * (segs + 1)

    def per_element(r):  # (rows, segs, ...) -> one value per element of x (0 outside segments)
        r = r.astype(x.dtype).reshape((rows, segs) + x.shape[1:])
        r = jnp.pad(r, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 1))
        return r.reshape((num,) + x.shape[1:])[ids]

    def seg_total(v):
        return jax.ops.segment_sum(v, ids, num)[ids]

    g = per_element(grad)
    if reduce == "sum":
        res = g
    elif reduce == "mean":
        cnt = seg_total(jnp.ones(ids.shape, x.dtype)).reshape((-1,) + (1,) * (x.ndim - 1))
        res = g / jnp.maximum(cnt, 1)
    elif reduce in ("max", "min"):
        hit = jnp.isnan(x) | (x == per_element(output))
        res = jnp.where(hit, g, 0)
        n = seg_total(hit.astype(x.dtype))
        res = jnp.where((n >= 2) & (res > 0), res / jnp.maximum(n, 1), res)
    else:
        zero, nan = x == 0, jnp.isnan(x)
        plain = jax.ops.segment_prod(jnp.where(zero | nan, 1, x), ids, num)[ids]
        if initial is not None:
            plain = plain * jnp.asarray(initial).astype(x.dtype)
        zeros_else = seg_total(zero.astype(jnp.int64)) - zero
        nans_else = seg_total(nan.astype(jnp.int64)) - nan
        exclusive = jnp.where(nans_else > 0, jnp.nan, jnp.where(zeros_else > 0, 0, plain))
        res = jnp.where(zero | nan, g * exclusive, g * per_element(output) / x)
    res = lax.convert_element_type(res, dt)
    return res.reshape(out.shape)
