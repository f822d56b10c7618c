"""Views, indexing and layout lowerings."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _norm(i, n, default):
    if i is None:
        return default
    i = int(i)
    if i < 0:
        i += n
    return min(max(i, 0), n)


def slice_bounds(shape, dim, start, end, step):
    n = shape[dim]
    s = _norm(start, n, 0)
    e = max(_norm(end, n, n), s)
    return s, e, int(step)


def slice_(out, self, dim, start, end, step):
    s, e, st = slice_bounds(self.shape, dim, start, end, step)
    return lax.slice_in_dim(self, s, e, st, axis=dim % max(self.ndim, 1))


def slice_scatter(out, self, src, dim, start, end, step, idx=0):
    d = dim % max(self.ndim, 1)
    s, e, st = slice_bounds(self.shape, d, start, end, step)
    index = [slice(None)] * self.ndim
    index[d] = slice(s, e, st)
    return self.at[tuple(index)].set(src.astype(self.dtype))


def select(out, self, dim, index):
    d = dim % self.ndim
    return lax.index_in_dim(self, index % self.shape[d], axis=d, keepdims=False)


def select_scatter(out, self, src, dim, index, idx=0):
    d = dim % self.ndim
    ix = [slice(None)] * self.ndim
    ix[d] = index % self.shape[d]
    return self.at[tuple(ix)].set(src.astype(self.dtype))


def split(out, self, split_size, dim):
    d = dim % max(self.ndim, 1)
    res, start = [], 0
    for o in out:
        n = o.shape[d]
        res.append(lax.slice_in_dim(self, start, start + n, axis=d))
        start += n
    return res


def split_with_sizes(out, self, split_sizes, dim):
    return split(out, self, None, dim)


def unbind(out, self, dim):
    d = dim % self.ndim
    return [lax.index_in_dim(self, i, axis=d, keepdims=False) for i in range(self.shape[d])]


def split_scatter(out, self, src, split_size, dim, idx):
    d = dim % max(self.ndim, 1)
    return lax.dynamic_update_slice_in_dim(self, src.astype(self.dtype), idx * split_size, axis=d)


def split_with_sizes_scatter(out, self, src, split_sizes, dim, idx):
    d = dim % max(self.ndim, 1)
    return lax.dynamic_update_slice_in_dim(self, src.astype(self.dtype), sum(split_sizes[:idx]), axis=d)


def _windows(self, dimension, size, step):
    """(dim, index array [n, size]) of ``unfold``'s windows along ``dimension``."""
    d = dimension % max(self.ndim, 1)
    length = self.shape[d] if self.ndim else 1
    n = (length - size) // step + 1
    return d, jnp.arange(n)[:, None] * step + jnp.arange(size)[None, :]


def unfold(out, self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(out.shape)
    d, ix = _windows(self, dimension, size, step)
    # take() puts the [n, size] window axes at d; the size axis goes last, as in PyTorch.
    return jnp.moveaxis(jnp.take(self, ix, axis=d), d + 1, -1)


def unfold_backward(out, grad_in, input_sizes, dim, size, step):
    """aten.unfold_backward (``Tensor.unfold``'s gradient): each window's gradient added back at
    its elements of a zero input, overlapping windows summed."""
    if len(input_sizes) == 0:
        return grad_in.reshape(())
    d = dim % len(input_sizes)
    n = (input_sizes[d] - size) // step + 1
    ix = jnp.arange(n)[:, None] * step + jnp.arange(size)[None, :]
    src = jnp.moveaxis(grad_in, -1, d + 1).astype(out.dtype)
    return jnp.zeros(out.shape, out.dtype).at[(slice(None),) * d + (ix,)].add(src)


def unfold_scatter(out, self, src, dimension, size, step, idx):
    if self.ndim == 0:
        return src.reshape(()).astype(self.dtype)
    d, ix = _windows(self, dimension, size, step)
    src = jnp.moveaxis(src, -1, d + 1).astype(self.dtype)
    index = (slice(None),) * d + (ix,)
    return self.at[index].set(src)


def view_dtype(out, self, dtype):
    """``view(dtype)``: the same bytes reinterpreted; the last dim scales by the size ratio."""
    to = out.dtype
    src = self.astype(jnp.uint8) if self.dtype == jnp.bool_ else self
    tgt = jnp.uint8 if to == jnp.bool_ else to
    a, b = src.dtype.itemsize, jnp.dtype(tgt).itemsize
    if a < b:  # group b // a elements of the last dim into one
        src = src.reshape(src.shape[:-1] + (src.shape[-1] // (b // a), b // a))
    r = lax.bitcast_convert_type(src, tgt)
    if a > b:  # bitcast added a trailing dim of a // b
        r = r.reshape(r.shape[:-2] + (r.shape[-2] * r.shape[-1],))
    return r.astype(jnp.bool_) if to == jnp.bool_ else r


def view_dtype_scatter(out, self, src, dtype, idx):
    return view_dtype(out, src, self.dtype)  # out is the base: its dtype is the target


def permute_back(src, dims):
    inv = [0] * len(dims)
    for i, d in enumerate(dims):
        inv[d % len(dims)] = i
    return jnp.transpose(src, inv)


def cat(out, tensors, dim):
    # PyTorch skips legacy empty 1-d tensors in cat.
    ts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors)
    return jnp.concatenate([t.astype(out.dtype) for t in ts], axis=dim % out.ndim if out.ndim else 0)


def index_tensor(out, self, indices):
    if self.size == 0:  # nothing to read: an empty result, or indices that fail their check
        return jnp.zeros(out.shape, out.dtype)
    idx = []
    for i in indices:
        if i is None:
            idx.append(slice(None))
        elif i.dtype == jnp.bool_:
            raise NotImplementedError("boolean mask indexing has a data-dependent shape")
        else:
            idx.append(i)
    return self[tuple(idx)]


def complex_of_pairs(x):
    """The complex values whose (real, imag) pairs are ``x``'s last dim (``view_as_complex``).

    ``lax.complex`` takes float32/float64 only: a float32 tensor that a precision mode
    stores as bfloat16 is widened first (exactly; the complex dtypes are never narrowed).
    """
    if x.dtype in (jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    return lax.complex(x[..., 0], x[..., 1])


def narrow(out, self, dim, start, length):
    """``narrow_copy``: ``length`` elements from ``start`` (negative counts from the end)."""
    d = dim % max(self.ndim, 1)
    s = int(start) + self.shape[d] if int(start) < 0 else int(start)
    return lax.slice_in_dim(self, s, s + int(length), axis=d)
