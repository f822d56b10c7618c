"""Indexing and scattering: scatter/index_put/index_add families, masked ops, as_strided."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def _lowest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf
    return False if dtype == jnp.bool_ else jnp.iinfo(dtype).min


def _highest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.inf
    return True if dtype == jnp.bool_ else jnp.iinfo(dtype).max


def _scatter_index(self, dim, index):
    """Full advanced-index tuple writing along ``dim`` at ``index``, iota elsewhere."""
    idx = [lax.broadcasted_iota(jnp.int64, index.shape, i) for i in range(index.ndim)]
    idx[dim % max(index.ndim, 1)] = index
    return tuple(idx)


# PyTorch's add/multiply on bool are logical or/and.
_BOOL = {"add": "max", "multiply": "min"}


def _apply(ref, how, src, dtype):
    """``x.at[...]`` combined with ``src`` by ``how`` (set/add/multiply/max/min)."""
    if dtype == jnp.bool_:
        how = _BOOL.get(how, how)
    return getattr(ref, how)(src)


def _flat0(a):
    return a.reshape(1) if a.ndim == 0 else a


def _scatter(out, self, dim, index, src, how):
    """``self`` with ``src`` (a tensor cut to ``index``'s shape, or a scalar) combined in by ``how``."""
    x = _flat0(self)
    index = _flat0(index)
    if index.size == 0:
        return self
    if hasattr(src, "ndim") and src.ndim > 0 and src.shape != ():
        src = _flat0(src)[tuple(slice(0, n) for n in index.shape)]
    src = jnp.asarray(src).astype(x.dtype)
    ref = x.at[_scatter_index(x, dim, index)]
    return _apply(ref, how, src, x.dtype).reshape(self.shape)


def scatter(out, self, dim, index, src, reduce=None):
    """aten.scatter (src/value, with the legacy reduce='add'|'multiply')."""
    return _scatter(out, self, dim, index, src, reduce or "set")


def scatter_add(out, self, dim, index, src):
    """aten.scatter_add."""
    return _scatter(out, self, dim, index, src, "add")


def scatter_reduce(out, self, dim, index, src, reduce, include_self=True):
    """aten.scatter_reduce.two: sum/prod/mean/amax/amin, with or without ``self``'s values."""
    x = _flat0(self)
    index = _flat0(index)
    if index.size == 0:
        return self
    src = _flat0(src)[tuple(slice(0, n) for n in index.shape)].astype(x.dtype)
    ix = _scatter_index(x, dim, index)
    if not include_self:
        init = {"sum": 0, "mean": 0, "prod": 1, "amax": _lowest(x.dtype), "amin": _highest(x.dtype)}[reduce]
        x = x.at[ix].set(jnp.asarray(init).astype(x.dtype))
    how = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "max", "amin": "min"}[reduce]
    res = _apply(x.at[ix], how, src, x.dtype)
    if reduce == "mean":
        cnt = jnp.full(x.shape, 1 if include_self else 0, jnp.int64).at[ix].add(1)
        cnt = jnp.maximum(cnt, 1).astype(x.dtype)
        res = res / cnt if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.floor_divide(res, cnt)
    return res.reshape(self.shape).astype(out.dtype)


def _mask_positions(mask, k, axis):
    """For each element of ``mask`` (flattened), the rank of its True among the Trues, clipped to k-1."""
    return jnp.clip(jnp.cumsum(mask.reshape(-1).astype(jnp.int64)) - 1, 0, max(k - 1, 0))


def mask_values(shape, pre, rest) -> int | None:
    """How many values of ``shape`` a lone boolean mask's assignment takes (1: broadcast to every
    True), where the indexing result is ``pre + (count,) + rest``; None when they cannot broadcast
    to it for any count (CPU raises "shape mismatch"; ``checks.advanced`` reports it)."""
    full = (*pre, None, *rest)
    if len(shape) > len(full) or any(r is not None and v not in (1, r) for v, r in zip(shape[::-1], full[::-1])):
        return None
    return shape[len(shape) - 1 - len(rest)] if len(shape) > len(rest) else 1


def _index_put_mask(out, self, indices, values, accumulate):
    """index_put with one boolean mask (and leading ``None``s): static shapes, no nonzero."""
    p = next(i for i, t in enumerate(indices) if t is not None)
    m = indices[p].astype(jnp.bool_)
    d = m.ndim
    rest = self.shape[p + d :]
    if mask_values(values.shape, self.shape[:p], rest) is None:
        return self  # CPU raises: the check's row fires
    vals = values.astype(self.dtype)
    vals = vals.reshape((1,) * (p + 1 + len(rest) - vals.ndim) + vals.shape)
    k = vals.shape[p]
    mb = m.reshape((1,) * p + m.shape + (1,) * len(rest))
    if k == 0:
        return self
    if k == 1:
        full = vals.reshape(vals.shape[:p] + (1,) * d + vals.shape[p + 1 :])
    else:
        full = jnp.take(vals, _mask_positions(m, k, p), axis=p).reshape(vals.shape[:p] + m.shape + vals.shape[p + 1 :])
    full = jnp.broadcast_to(full, self.shape)
    if accumulate:
        return jnp.where(mb, self + full if self.dtype != jnp.bool_ else self | full, self)
    return jnp.where(mb, full, self)


def index_put(out, self, indices, values, accumulate=False):
    """aten.index_put: advanced-index assignment (``None`` entries keep a dimension)."""
    masks = [t for t in indices if t is not None and t.dtype in (jnp.bool_, jnp.uint8)]
    if masks:
        if len([t for t in indices if t is not None]) != 1:
            raise NotImplementedError("index_put: a boolean mask mixed with other indices (converted at dispatch)")
        return _index_put_mask(out, self, indices, values, accumulate)
    idx = tuple(slice(None) if t is None else t for t in indices)
    return _apply(self.at[idx], "add" if accumulate else "set", values.astype(self.dtype), self.dtype)


def index_add(out, self, dim, index, source, alpha=1):
    """aten.index_add: ``self[..., index, ...] += alpha * source`` along ``dim``."""
    x, src = _flat0(self), _flat0(source)
    d = dim % x.ndim
    ix = (slice(None),) * d + (index.reshape(-1),)
    src = (src * jnp.asarray(alpha).astype(src.dtype)).astype(x.dtype)
    return _apply(x.at[ix], "add", src, x.dtype).reshape(self.shape)


def index_reduce(out, self, dim, index, source, reduce, include_self=True):
    """aten.index_reduce: ``self[..., index[i], ...]`` combined with ``source[..., i, ...]`` by
    prod/mean/amax/amin along ``dim`` (a scatter); integer means round down, as on CPU."""
    x = _flat0(self)
    src = _flat0(source).astype(x.dtype)
    d = dim % x.ndim
    index = index.reshape(-1)
    ix = (slice(None),) * d + (index,)
    if not include_self:
        init = {"mean": 0, "prod": 1, "amax": _lowest(x.dtype), "amin": _highest(x.dtype)}[reduce]
        x = x.at[ix].set(jnp.asarray(init).astype(x.dtype))
    how = {"mean": "add", "prod": "multiply", "amax": "max", "amin": "min"}[reduce]
    res = _apply(x.at[ix], how, src, x.dtype)
    if reduce == "mean":
        cnt = jnp.zeros(x.shape[d], jnp.int64).at[index].add(1) + (1 if include_self else 0)
        cnt = jnp.maximum(cnt, 1).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - d - 1))
        res = res / cnt if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.floor_divide(res, cnt)
    return res.reshape(self.shape)


def index_copy(out, self, dim, index, source):
    """aten.index_copy: ``self[..., index, ...] = source`` along ``dim``."""
    x, src = _flat0(self), _flat0(source)
    d = dim % x.ndim
    return x.at[(slice(None),) * d + (index.reshape(-1),)].set(src.astype(x.dtype)).reshape(self.shape)


def index_fill(out, self, dim, index, value):
    """aten.index_fill (Scalar/Tensor value): ``self[..., index, ...] = value`` along ``dim``."""
    x = _flat0(self)
    d = dim % x.ndim
    return x.at[(slice(None),) * d + (index.reshape(-1),)].set(jnp.asarray(value).astype(x.dtype)).reshape(self.shape)


def masked_scatter(out, self, mask, source):
    """aten.masked_scatter: the k-th True of ``mask`` takes ``source.flatten()[k]``."""
    x = jnp.broadcast_to(self, out.shape)
    m = jnp.broadcast_to(mask, out.shape)
    src = source.reshape(-1).astype(x.dtype)
    if src.size == 0:
        return x
    return jnp.where(m, src[_mask_positions(m, src.size, 0)].reshape(out.shape), x)


def masked_scatter_backward(out, grad_output, mask, sizes):
    """aten.masked_scatter_backward: the gradient of ``source`` (masked-out tail is zero)."""
    n = int(np.prod(out.shape))
    m = jnp.broadcast_to(mask, grad_output.shape).reshape(-1)
    (pos,) = jnp.nonzero(m, size=n, fill_value=0)
    g = grad_output.reshape(-1)[pos]
    return jnp.where(jnp.arange(n) < jnp.sum(m), g, 0).reshape(out.shape)


def nonzero(out, self):
    """aten.nonzero with a host-known count ``out.shape[0]``: indices of non-zeros, row-major."""
    if self.ndim == 0:
        return jnp.zeros(out.shape, jnp.int64)
    return jnp.stack(jnp.nonzero(self, size=out.shape[0]), axis=-1)


def nonzero_static(out, self, size, fill_value=-1):
    """aten.nonzero_static: ``size`` rows, padded with ``fill_value``."""
    if self.ndim == 0:
        return jnp.full(out.shape, fill_value, jnp.int64)
    n = jnp.sum(self != 0)
    idx = jnp.stack(jnp.nonzero(self, size=size, fill_value=0), axis=-1)
    return jnp.where((jnp.arange(size) < n)[:, None], idx, fill_value)


def masked_select(out, self, mask):
    """aten.masked_select with a host-known count ``out.shape[0]``."""
    x, m = jnp.broadcast_arrays(self, mask)
    (pos,) = jnp.nonzero(m.reshape(-1), size=out.shape[0])
    return x.reshape(-1)[pos]


def _strided_index(size, stride, storage_offset):
    """Flat positions (trace-time numpy) of an as_strided view of a contiguous tensor."""
    idx = np.full(tuple(size), storage_offset or 0, np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + np.arange(n, dtype=np.int64).reshape(shape) * s
    return idx


def as_strided(out, self, size, stride, storage_offset=None):
    """aten.as_strided: a gather from the flattened (contiguous) input."""
    return self.reshape(-1)[_strided_index(size, stride, storage_offset)]


def as_strided_scatter(out, self, src, size, stride, storage_offset=None, idx=0):
    """aten.as_strided_scatter (and writes through an as_strided view)."""
    pos = _strided_index(size, stride, storage_offset)
    return self.reshape(-1).at[pos].set(src.astype(self.dtype).reshape(pos.shape)).reshape(self.shape)


def diagonal_scatter(out, self, src, offset=0, dim1=0, dim2=1):
    """aten.diagonal_scatter: write ``src`` onto a diagonal of ``self``."""
    d1, d2 = dim1 % self.ndim, dim2 % self.ndim
    n = src.shape[-1]
    i = jnp.arange(n)
    r, c = (i, i + offset) if offset >= 0 else (i - offset, i)
    moved = jnp.moveaxis(self, (d1, d2), (-2, -1))
    moved = moved.at[..., r, c].set(src.astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


def take(out, self, index):
    """aten.take: indices into the flattened input (negative wrap)."""
    flat = self.reshape(-1)
    return flat[jnp.where(index < 0, index + flat.size, index)]


def put(out, self, index, source, accumulate=False):
    """aten.put: writes into the flattened input (negative indices wrap)."""
    flat = self.reshape(-1)
    i = index.reshape(-1)
    i = jnp.where(i < 0, i + flat.size, i)
    v = source.reshape(-1).astype(self.dtype)
    return _apply(flat.at[i], "add" if accumulate else "set", v, flat.dtype).reshape(self.shape)


def gather(out, self, dim, index):
    """aten.gather: ``index`` may be smaller than ``self`` in every dimension."""
    x, i = _flat0(self), _flat0(index)
    if i.size == 0 or x.shape[dim % x.ndim] == 0:  # the second: every index fails its check
        return jnp.zeros(out.shape, out.dtype)
    return x[_scatter_index(x, dim, i)].reshape(out.shape)


def take_along(x, index, axis: int):
    """``jnp.take`` along ``axis``; zeros from an empty axis (where every index fails its check)."""
    if x.shape[axis] == 0:
        return jnp.zeros(x.shape[:axis] + index.shape + x.shape[axis + 1 :], x.dtype)
    return jnp.take(x, index, axis=axis)


def index_select(out, self, dim, index):
    """aten.index_select (a 0-d input behaves as 1-d); also ``embedding`` (``weight``, dim 0)."""
    return take_along(_flat0(self), index.reshape(-1), dim % max(self.ndim, 1)).reshape(out.shape)
