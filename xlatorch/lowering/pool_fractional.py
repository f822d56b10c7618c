"""Fractional max pooling (Graham, 2014) in 2 and 3 spatial dims, given its random samples.

``random_samples`` (batch, plane, one per spatial dim) place each plane's pseudo-random
windows: CPU's ``generate_intervals`` turns a sample ``u`` into window starts
``int((i + u) * alpha) - int(u * alpha)`` with ``alpha = (in - k) / (out - 1)``, the last window
ending at the input's edge, computed in the samples' dtype (bfloat16 rounds after each
operation, as ``c10::BFloat16`` arithmetic does). The samples' order is CPU's: (width,
height) for 2-d, (time, height, width) for 3-d. Each window's maximum is CPU's scan: the
first maximum wins ties, a NaN beats any number and the last NaN wins; an all -inf window
names its first element. Indices are flat offsets into the plane.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import torch

from xlatorch.lowering.checks import in_range
from xlatorch.lowering.pool import _scatter_back


def _starts(sample, size_in: int, size_out: int, k: int):
    """Window starts along one dim: ``sample`` (batch, plane) -> (batch, plane, size_out)."""
    dt = sample.dtype
    work = jnp.float32 if dt in (jnp.bfloat16, jnp.float16) else dt

    def rnd(v):  # one operation of CPU's scalar_t arithmetic
        return v.astype(dt).astype(work)

    last = jnp.full(sample.shape + (1,), size_in - k, jnp.int64)
    if size_out <= 1:
        return last[..., :size_out]
    alpha = rnd(rnd(jnp.asarray(size_in - k, work)) / rnd(jnp.asarray(size_out - 1, work)))
    u = sample.astype(work)[..., None]
    i = jnp.arange(size_out - 1).astype(dt).astype(work)
    head = rnd(rnd(i + u) * alpha).astype(jnp.int64) - rnd(u * alpha).astype(jnp.int64)
    return jnp.concatenate([head, last], axis=-1)


def _fractional_max(out, x, kernel_size, output_size, random_samples, order):
    nd = len(kernel_size)
    batched = x.ndim == nd + 2
    if not batched:
        x = x[None]
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    samples = random_samples.reshape(n, c, nd)
    # starts[d]: (n, c, output_size[d]) for spatial dim d; the samples' slot for it is order[d]
    starts = [_starts(samples[..., order[d]], spatial[d], output_size[d], kernel_size[d]) for d in range(nd)]
    strides = [int(np.prod(spatial[d + 1 :])) for d in range(nd)]
    # flat offset of each window's first element: (n, c, *output_size)
    base = jnp.zeros((n, c) + tuple(output_size), jnp.int64)
    for d in range(nd):
        shape = [n, c] + [1] * nd
        shape[2 + d] = output_size[d]
        base = base + (starts[d] * strides[d]).reshape(shape)
    # offsets inside a window, in CPU's scan order (last dim fastest)
    offs = np.array([sum(o * s for o, s in zip(t, strides)) for t in itertools.product(*map(range, kernel_size))])
    idx = base[..., None] + offs  # (n, c, *output_size, K)
    flat = x.reshape(n, c, -1)
    vals = jnp.take_along_axis(flat, idx.reshape(n, c, -1), axis=2).reshape(idx.shape)
    nan = jnp.isnan(vals)
    kk = vals.shape[-1]
    last_nan = kk - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    first_max = jnp.argmax(jnp.where(nan, -jnp.inf, vals), axis=-1)
    pick = jnp.where(nan.any(-1), last_nan, first_max)
    value = jnp.take_along_axis(vals, pick[..., None], axis=-1)[..., 0]
    index = jnp.take_along_axis(idx, pick[..., None], axis=-1)[..., 0]
    if not batched:
        value, index = value[0], index[0]
    return value.astype(out[0].dtype), index.astype(jnp.int64)


def fractional_max_pool2d(out, self, kernel_size, output_size, random_samples):
    """``aten::fractional_max_pool2d``: (values, flat indices) of each pseudo-random window."""
    return _fractional_max(out, self, tuple(kernel_size), tuple(output_size), random_samples, (1, 0))


def fractional_max_pool3d(out, self, kernel_size, output_size, random_samples):
    """``aten::fractional_max_pool3d``: (values, flat indices) of each pseudo-random window."""
    return _fractional_max(out, self, tuple(kernel_size), tuple(output_size), random_samples, (0, 1, 2))


def fractional_max_pool2d_backward(out, grad_output, self, kernel_size, output_size, indices):
    """``aten::fractional_max_pool2d_backward``: a scatter-add through the indices."""
    return _scatter_back(grad_output, self, indices, 2)


def fractional_max_pool3d_backward(out, grad_output, self, kernel_size, output_size, indices):
    """``aten::fractional_max_pool3d_backward``: a scatter-add through the indices."""
    return _scatter_back(grad_output, self, indices, 3)


# CPU's backward kernels assert each index lies in its plane (their message, build path included).
_INDEX_ASSERTS = {
    2: "index >= 0 && index < static_cast<int64_t>(inputW) * inputH INTERNAL ASSERT FAILED at "
    '"/__w/pytorch/pytorch/aten/src/ATen/native/FractionalMaxPool2d.cpp":240, please report a bug to PyTorch. ',
    3: "index >= 0 && index < inputT * inputH * inputW INTERNAL ASSERT FAILED at "
    '"/__w/pytorch/pytorch/aten/src/ATen/native/FractionalMaxPool3d.cpp":280, please report a bug to PyTorch. ',
}


def backward_indices(self, indices, nd: int):
    """The check of CPU's fractional max pool backward: every index inside the input's plane."""
    return in_range(indices, 0, int(np.prod(self.shape[-nd:])), RuntimeError, _INDEX_ASSERTS[nd])


# PyTorch has no meta kernel for the 3-d backward: its result is shaped like the input. CPU
# checks the gradient's sizes against ``output_size`` (its error, from trace/nodes.py's
# error_on_cpu, once this raises).
def _backward3d_meta(grad_output, self, kernel_size, output_size, indices):
    if tuple(grad_output.shape[-3:]) != tuple(output_size) or grad_output.shape != indices.shape:
        raise RuntimeError("gradient sizes CPU's kernel refuses")
    return self.new_empty(self.shape)


_LIB = torch.library.Library("aten", "IMPL")
try:
    _LIB.impl("fractional_max_pool3d_backward", _backward3d_meta, "Meta")
except RuntimeError:  # a later torch registering its own meta kernel
    pass
