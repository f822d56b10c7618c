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
