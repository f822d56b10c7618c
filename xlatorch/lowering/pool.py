"""Pooling lowerings: average, max (with indices) and adaptive pools in 1-3 spatial dims,
and embedding bags (sum / mean / max pooling of embedding rows).

Window geometry is static (shapes are known when a graph is traced), so divisors and
adaptive bins are numpy constants. Max pools follow PyTorch's CPU scan: the first
maximum wins ties, a NaN beats any number, and the last NaN wins among NaNs; indices
are flat offsets into the input's spatial dims. Backward ops are the vector-Jacobian
product of the forward (average pools) or a scatter-add through the indices (max pools).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xlatorch.lowering.index import take_along

_IDX_PAD = np.iinfo(np.int64).max  # the index of padding: loses every tie against real data


def _nd_args(v, nd):
    v = tuple(v)
    return v * nd if len(v) == 1 else v


def _acc_dtype(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _lowest(dtype):
    return -np.inf if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).min


def _window_pads(spatial, out_spatial, k, s, p, d=None):
    """(lo, hi) padding per spatial dim so a VALID window pass yields exactly ``out_spatial``."""
    d = d or (1,) * len(k)
    geometry = zip(spatial, out_spatial, k, s, p, d)
    return [(pp, (o - 1) * ss + dd * (kk - 1) + 1 - n - pp) for n, o, kk, ss, pp, dd in geometry]


def _pad(x, lead, pads, value):
    cfg = [(0, 0, 0)] * lead + [(lo, hi, 0) for lo, hi in pads]
    return lax.pad(x, jnp.asarray(value, x.dtype), cfg)


# --- average pools ---------------------------------------------------------------------


def _avg_divisor(spatial, out_spatial, k, s, p, count_include_pad, divisor_override):
    """PyTorch's per-window divisor as a numpy array over the output's spatial dims."""
    if divisor_override:
        return np.asarray(divisor_override)
    per_dim = []
    for n, o, kk, ss, pp in zip(spatial, out_spatial, k, s, p):
        start = np.arange(o) * ss - pp
        end = np.minimum(start + kk, n + pp)
        size = end - start if count_include_pad else np.minimum(end, n) - np.maximum(start, 0)
        per_dim.append(np.maximum(size, 1))
    div = per_dim[0]
    for v in per_dim[1:]:
        div = np.multiply.outer(div, v)
    return div


def _avg_pool(out_shape, x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k = _nd_args(kernel_size, nd)
    s = _nd_args(stride, nd) if stride else k
    p = _nd_args(padding, nd)
    lead = x.ndim - nd
    spatial, out_spatial = x.shape[lead:], tuple(out_shape[lead:])
    acc = _acc_dtype(x.dtype)
    xp = _pad(x.astype(acc), lead, _window_pads(spatial, out_spatial, k, s, p), 0)
    total = lax.reduce_window(xp, np.array(0, acc), lax.add, (1,) * lead + k, (1,) * lead + s, "VALID")
    div = _avg_divisor(spatial, out_spatial, k, s, p, count_include_pad, divisor_override)
    if jnp.issubdtype(acc, jnp.integer):
        return lax.div(total, jnp.broadcast_to(jnp.asarray(div, acc), total.shape))
    return (total / jnp.asarray(div, acc)).astype(x.dtype)


def avg_pool1d(out, self, kernel_size, stride, padding, ceil_mode, count_include_pad):
    """``aten::avg_pool1d``: a window sum over the last dim divided by PyTorch's divisor."""
    return _avg_pool(out.shape, self, 1, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


def avg_pool2d(out, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """``aten::avg_pool2d``: a window sum over the last 2 dims divided by PyTorch's divisor."""
    return _avg_pool(out.shape, self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def avg_pool3d(out, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """``aten::avg_pool3d``: a window sum over the last 3 dims divided by PyTorch's divisor."""
    return _avg_pool(out.shape, self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _avg_pool_backward(nd, grad_output, self, *args):
    x = self.astype(_acc_dtype(self.dtype))
    _, vjp = jax.vjp(lambda v: _avg_pool(grad_output.shape, v, nd, *args), x)
    return vjp(grad_output.astype(x.dtype))[0]


def avg_pool2d_backward(out, grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):  # fmt: skip
    """``aten::avg_pool2d_backward``: the VJP of :func:`avg_pool2d`."""
    return _avg_pool_backward(2, grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)  # fmt: skip


def avg_pool3d_backward(out, grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):  # fmt: skip
    """``aten::avg_pool3d_backward``: the VJP of :func:`avg_pool3d`."""
    return _avg_pool_backward(3, grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)  # fmt: skip


# --- max pools -------------------------------------------------------------------------


def _pick(a, b):
    """Combine two (value, flat index) candidates the way PyTorch's CPU scan would."""
    (av, ai), (bv, bi) = a, b
    an, bn = jnp.isnan(av), jnp.isnan(bv)
    take_b = jnp.where(an | bn, bn & (~an | (bi > ai)), (bv > av) | ((bv == av) & (bi < ai)))
    return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)


def _spatial_index(shape, nd):
    """Each element's flat index within its last ``nd`` dims, built from iotas in the graph: a
    constant array of the input's size would slow lowering and bloat the program."""
    lead = len(shape) - nd
    idx = None
    for i in range(lead, len(shape)):
        term = lax.broadcasted_iota(jnp.int64, shape, i) * int(np.prod(shape[i + 1 :]))
        idx = term if idx is None else idx + term
    return idx


def _max_pool(out, x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    k = _nd_args(kernel_size, nd)
    s = _nd_args(stride, nd) if stride else k
    p = _nd_args(padding, nd)
    d = _nd_args(dilation, nd)
    lead = x.ndim - nd
    pads = _window_pads(x.shape[lead:], out[0].shape[lead:], k, s, p, d)
    if any(n == 0 for n in out[0].shape):
        return jnp.zeros(out[0].shape, x.dtype), jnp.zeros(out[1].shape, jnp.int64)
    if np.prod(k) <= _MAX_TAPS:
        return _max_pool_taps(x, lead, pads, out[0].shape[lead:], k, s, p, d)
    xv = _pad(x, lead, pads, _lowest(x.dtype))
    xi = _pad(_spatial_index(x.shape, nd), lead, pads, _IDX_PAD)
    init = (jnp.asarray(_lowest(x.dtype), x.dtype), jnp.asarray(_IDX_PAD, jnp.int64))
    ones = (1,) * lead
    return lax.reduce_window((xv, xi), init, _pick, ones + k, ones + s, "VALID", window_dilation=ones + d)


# Windows of up to this many elements are pooled tap by tap (``_max_pool_taps``); larger
# ones by a (value, index) window reduction.
_MAX_TAPS = 27


def _taps(x, lead, pads, out_spatial, k, s, d, fill):
    """For each window offset, in PyTorch's scan order, the strided slice of ``x`` (padded
    with ``fill``) holding that element of every window: an array of the output's shape."""
    xp = _pad(x, lead, pads, fill)
    strides = (1,) * lead + tuple(s)
    for offs in itertools.product(*map(range, k)):
        start = (0,) * lead + tuple(o * dd for o, dd in zip(offs, d))
        limit = x.shape[:lead] + tuple(b + (o - 1) * ss + 1 for b, o, ss in zip(start[lead:], out_spatial, s))
        yield lax.slice(xp, start, limit, strides)


def _max_pool_taps(x, lead, pads, out_spatial, k, s, p, d):
    """A max pool as elementwise passes over the window's taps, which XLA fuses into loops
    (a (value, index) ``reduce_window`` with ``_pick`` runs 2-4x slower on CPU). The value
    is PyTorch's scan (a later tap wins if greater or NaN); the index, the first tap equal
    to the maximum (a real one, not padding), or where the maximum is NaN the last NaN tap:
    the same picks as ``_pick``'s. The two are separate passes because XLA fuses each into
    its consumers, and the value's alone is cheap."""
    taps = list(_taps(x, lead, pads, out_spatial, k, s, d, _lowest(x.dtype)))
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    value = taps[0]
    for t in taps[1:]:
        value = jnp.where((t > value) | jnp.isnan(t), t, value) if floating else jnp.maximum(t, value)
    padded = any(lo or hi for lo, hi in pads)
    real = list(_taps(jnp.ones(x.shape, bool), lead, pads, out_spatial, k, s, d, False)) if padded else None
    m = taps[0]
    for t in taps[1:]:
        m = jnp.maximum(m, t)  # a NaN anywhere in the window makes the maximum NaN
    # Each tap's offset from its window's first element, as a flat index into the input.
    inner = [int(np.prod(x.shape[lead + j + 1 :])) for j in range(len(k))]
    offsets = [sum(o * dd * st for o, dd, st in zip(offs, d, inner)) for offs in itertools.product(*map(range, k))]
    offset = jnp.full(m.shape, offsets[-1], jnp.int32 if max(offsets) < 2**31 else jnp.int64)
    for n in reversed(range(len(taps) - 1)):
        hit = taps[n] == m if real is None else (taps[n] == m) & real[n]
        offset = jnp.where(hit, offsets[n], offset)
    if floating:
        last_nan = offset
        for n, t in enumerate(taps):
            last_nan = jnp.where(jnp.isnan(t), offsets[n], last_nan)
        offset = jnp.where(jnp.isnan(m), last_nan, offset)
    start = None  # each window's first element (padding included), as a flat index
    for j, (ss, pp, st) in enumerate(zip(s, p, inner)):
        term = (lax.broadcasted_iota(jnp.int64, m.shape, lead + j) * ss - pp) * st
        start = term if start is None else start + term
    return value, start + offset.astype(jnp.int64)


def max_pool2d_with_indices(out, self, kernel_size, stride, padding, dilation, ceil_mode):
    """``aten::max_pool2d_with_indices``: a (value, index) window reduction over the last 2 dims."""
    return _max_pool(out, self, 2, kernel_size, stride, padding, dilation, ceil_mode)


def max_pool2d_with_indices_backward(out, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):  # fmt: skip
    """``aten::max_pool2d_with_indices_backward``: a scatter-add through the indices."""
    return _scatter_back(grad_output, self, indices, 2)


def max_pool3d_with_indices(out, self, kernel_size, stride, padding, dilation, ceil_mode):
    """``aten::max_pool3d_with_indices``: a (value, index) window reduction over the last 3 dims."""
    return _max_pool(out, self, 3, kernel_size, stride, padding, dilation, ceil_mode)


def _scatter_back(grad_output, self, indices, nd):
    """Each output gradient added at the flat spatial offset its index names."""
    lead = self.shape[: self.ndim - nd]
    n_in = int(np.prod(self.shape[self.ndim - nd :]))
    g = grad_output.reshape((int(np.prod(lead)), -1))
    ix = indices.reshape(g.shape)
    rows = jnp.arange(g.shape[0])[:, None]
    res = jnp.zeros((g.shape[0], n_in), grad_output.dtype).at[rows, ix].add(g, mode="drop")
    return res.reshape(self.shape)


def max_pool3d_with_indices_backward(out, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):  # fmt: skip
    """``aten::max_pool3d_with_indices_backward``: a scatter-add through the indices."""
    return _scatter_back(grad_output, self, indices, 3)


def _max_unpool(x, indices, out_shape, nd):
    lead = x.shape[: x.ndim - nd]
    rows = int(np.prod(lead))
    n_out = int(np.prod(out_shape[len(lead) :]))
    src = x.reshape((rows, -1))
    ix = indices.reshape(src.shape)
    res = jnp.zeros((rows, n_out), x.dtype).at[jnp.arange(rows)[:, None], ix].set(src, mode="drop")
    return res.reshape(out_shape)


def max_unpool2d(out, self, indices, output_size):
    """``aten::max_unpool2d``: each value written at the flat spatial offset its index names."""
    return _max_unpool(self, indices, out.shape, 2)


def max_unpool3d(out, self, indices, output_size, stride, padding):
    """``aten::max_unpool3d``: each value written at the flat spatial offset its index names."""
    return _max_unpool(self, indices, out.shape, 3)


# --- adaptive pools --------------------------------------------------------------------


def _bins(n, o):
    """PyTorch's adaptive bins [floor(i*n/o), ceil((i+1)*n/o)) as gather indices and a mask."""
    i = np.arange(o)
    start = (i * n) // o
    end = -((-(i + 1) * n) // o)
    width = int((end - start).max()) if o else 1
    idx = start[:, None] + np.arange(width)[None, :]
    mask = idx < end[:, None]
    return np.minimum(idx, n - 1), mask, end - start


def _gather_bins(x, axis, idx, mask, fill):
    """``x`` with ``axis`` replaced by (bin, slot) axes; slots past a bin's end hold ``fill``."""
    g = jnp.take(x, jnp.asarray(idx), axis=axis)
    m = jnp.asarray(mask).reshape(mask.shape + (1,) * (x.ndim - axis - 1))
    return jnp.where(m, g, jnp.asarray(fill, x.dtype))


def _adaptive_avg(out, x, nd):
    lead = x.ndim - nd
    acc = _acc_dtype(x.dtype)
    y = x.astype(acc)
    div = np.ones((), np.int64)
    for j in range(nd):
        ax = lead + j
        n, o = x.shape[ax], out.shape[ax]
        if n == 0 or o == 0:
            return jnp.zeros(out.shape, out.dtype)
        idx, mask, count = _bins(n, o)
        y = jnp.sum(_gather_bins(y, ax, idx, mask, 0), axis=ax + 1)
        div = np.multiply.outer(div, count)
    return (y / jnp.asarray(div, acc)).astype(x.dtype)


def adaptive_avg_pool1d(out, self, output_size):
    """``aten::adaptive_avg_pool1d``: the mean of each adaptive bin of the last dim."""
    return _adaptive_avg(out, self, 1)


def adaptive_avg_pool2d(out, self, output_size):
    """``aten::_adaptive_avg_pool2d``: the mean of each adaptive bin of the last 2 dims."""
    return _adaptive_avg(out, self, 2)


def adaptive_avg_pool3d(out, self, output_size):
    """``aten::_adaptive_avg_pool3d``: the mean of each adaptive bin of the last 3 dims."""
    return _adaptive_avg(out, self, 3)


def adaptive_avg_pool2d_backward(out, grad_output, self):
    """``aten::_adaptive_avg_pool2d_backward``: the VJP of :func:`adaptive_avg_pool2d`."""
    x = self.astype(_acc_dtype(self.dtype))
    _, vjp = jax.vjp(lambda v: _adaptive_avg(grad_output, v, 2), x)
    return vjp(grad_output.astype(x.dtype))[0]


def adaptive_avg_pool3d_backward(out, grad_output, self):
    """``aten::_adaptive_avg_pool3d_backward``: the VJP of :func:`adaptive_avg_pool3d`."""
    x = self.astype(_acc_dtype(self.dtype))
    _, vjp = jax.vjp(lambda v: _adaptive_avg(grad_output, v, 3), x)
    return vjp(grad_output.astype(x.dtype))[0]


def _adaptive_max(out, x, nd):
    lead = x.ndim - nd
    if any(n == 0 for n in out[0].shape):
        return jnp.zeros(out[0].shape, x.dtype), jnp.zeros(out[1].shape, jnp.int64)
    v, i = x, _spatial_index(x.shape, nd)
    init = (jnp.asarray(_lowest(x.dtype), x.dtype), jnp.asarray(_IDX_PAD, jnp.int64))
    for j in range(nd):
        ax = lead + j
        idx, mask, _ = _bins(x.shape[ax], out[0].shape[ax])
        gv = _gather_bins(v, ax, idx, mask, init[0])
        gi = _gather_bins(i, ax, idx, mask, _IDX_PAD)
        v, i = lax.reduce((gv, gi), init, _pick, (ax + 1,))
    return v, i


def adaptive_max_pool2d(out, self, output_size):
    """``aten::adaptive_max_pool2d``: the (value, index) maximum of each adaptive bin."""
    return _adaptive_max(out, self, 2)


def adaptive_max_pool3d(out, self, output_size):
    """``aten::adaptive_max_pool3d``: the (value, index) maximum of each adaptive bin."""
    return _adaptive_max(out, self, 3)


def adaptive_max_pool2d_backward(out, grad_output, self, indices):
    """``aten::adaptive_max_pool2d_backward``: a scatter-add through the indices."""
    return _scatter_back(grad_output, self, indices, 2)


def adaptive_max_pool3d_backward(out, grad_output, self, indices):
    """``aten::adaptive_max_pool3d_backward``: a scatter-add through the indices."""
    return _scatter_back(grad_output, self, indices, 3)


# --- embedding bags --------------------------------------------------------------------
# offset2bag, bag_size and max_indices are this module's own bookkeeping (their shapes
# are the meta kernel's): offset2bag[i] is the bag of index i, bag_size[b] the number of
# non-padding indices of bag b, max_indices[b, d] the weight row that won dimension d.


def _bag_layout(indices, offsets, include_last_offset, padding_idx, n_bags):
    m = indices.shape[0]
    starts = offsets[:n_bags].astype(jnp.int64)
    ends = offsets[1 : n_bags + 1].astype(jnp.int64) if include_last_offset else None
    if ends is None:
        ends = jnp.concatenate([offsets[1:n_bags].astype(jnp.int64), jnp.full((min(n_bags, 1),), m, jnp.int64)])
    pos = jnp.arange(m, dtype=jnp.int64)
    bag = jnp.clip(jnp.searchsorted(starts, pos, side="right") - 1, 0, max(n_bags - 1, 0))
    valid = (pos >= starts[bag]) & (pos < ends[bag]) if n_bags else jnp.zeros((m,), jnp.bool_)
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    count = jnp.zeros((n_bags,), jnp.int64).at[bag].add(valid.astype(jnp.int64))
    return bag, valid, count


def embedding_bag(out, weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                  include_last_offset, padding_idx):  # fmt: skip
    """``aten::_embedding_bag``: sum, mean or max of the embedding rows of each bag."""
    n_bags, d = out[0].shape
    bag, valid, count = _bag_layout(indices, offsets, include_last_offset, padding_idx, n_bags)
    rows = _acc_dtype(weight.dtype)
    vals = take_along(weight, indices, 0).astype(rows)
    if per_sample_weights is not None:
        vals = vals * per_sample_weights.astype(rows)[:, None]
    bag_size = jnp.zeros(out[2].shape, jnp.int64).at[: count.shape[0]].set(count)
    if mode == 2:
        masked = jnp.where(valid[:, None], vals, -jnp.inf)
        best = jnp.full((n_bags, d), -jnp.inf, rows).at[bag].max(masked)
        pos = jnp.arange(indices.shape[0])[:, None]
        first = (
            jnp.full((n_bags, d), indices.shape[0])
            .at[bag]
            .min(jnp.where(valid[:, None] & (masked == best[bag]), pos, indices.shape[0]))
        )
        empty = count[:, None] == 0
        max_idx = jnp.where(empty, -1, jnp.take(indices, jnp.minimum(first, max(indices.shape[0] - 1, 0))))
        return jnp.where(empty, 0, best), bag, bag_size, max_idx
    total = jnp.zeros((n_bags, d), rows).at[bag].add(jnp.where(valid[:, None], vals, 0))
    if mode == 1:
        total = jnp.where(count[:, None] > 0, total / jnp.maximum(count, 1)[:, None].astype(rows), 0)
    return total, bag, bag_size, jnp.zeros(out[3].shape, jnp.int64)


def embedding_bag_backward(out, grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx):  # fmt: skip
    """``aten::_embedding_bag_backward`` (dense): each bag's gradient added to its rows."""
    if sparse:
        raise NotImplementedError("xlatorch: embedding_bag(sparse=True) gradients are sparse tensors, not lowered")
    return embedding_bag_dense_backward(out, grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)  # fmt: skip


def embedding_bag_dense_backward(out, grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx):  # fmt: skip
    """``aten::_embedding_bag_dense_backward``: the weight gradient of :func:`embedding_bag`."""
    d = grad.shape[1]
    acc = _acc_dtype(grad.dtype)
    g = grad.astype(acc)
    res = jnp.zeros((num_weights, d), acc)
    if mode == 2:
        cols = jnp.broadcast_to(jnp.arange(d), maximum_indices.shape)
        rows = jnp.where(maximum_indices < 0, num_weights, maximum_indices)  # empty bags: dropped
        return res.at[rows, cols].add(g, mode="drop")
    valid = jnp.ones(indices.shape, jnp.bool_) if padding_idx < 0 else indices != padding_idx
    rows = g[offset2bag]
    if mode == 1:
        rows = rows / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), acc).at[indices].add(1)
        rows = rows / freq[indices][:, None]
    return res.at[indices].add(jnp.where(valid[:, None], rows, 0))


def embedding_bag_per_sample_weights_backward(out, grad, weight, indices, offsets, offset2bag, mode, padding_idx):
    """``aten::_embedding_bag_per_sample_weights_backward``: <bag gradient, embedding row>."""
    acc = _acc_dtype(grad.dtype)
    dots = jnp.sum(grad.astype(acc)[offset2bag] * jnp.take(weight, indices, axis=0).astype(acc), axis=1)
    return dots if padding_idx < 0 else jnp.where(indices == padding_idx, 0, dots)
