"""Antialiased bilinear/bicubic resampling (``F.interpolate(..., antialias=True)``).

PyTorch's CPU kernel (``UpSampleKernel.cpp``, the PIL algorithm) is separable: the width
is resampled first, then the height, each pass skipped when that size does not change. An
output pixel ``i`` reads the input pixels ``[xmin, xmin + xsize)`` around its centre
``scale * (i + 0.5)``, where the filter's support widens by ``scale`` when downscaling;
the weights are the filter (triangle, or Keys cubic with a = -0.5) at those pixels, divided
by their sum. ``scale`` follows ``align_corners`` and an explicit scale factor; the centre
never does (half-pixel centres always).

Indices and weights depend only on static sizes and scales: numpy constants computed with
the kernel's arithmetic (float32 for float32 input, float64 for float64 and uint8). A
uint8 image is resampled in integers, as CPU does: weights rounded to int16 at a
per-pass precision, each pass rounded and clamped back to uint8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlatorch.lowering.pointwise import wide as _acc  # half floats accumulate in float32

_LINEAR, _CUBIC = 2, 4  # the filters' interp_size


def _filter(x, interp_size):
    """The antialias filter at ``x`` (in x's dtype): triangle, or Keys' cubic with a = -0.5."""
    x = np.abs(x)
    one, two = x.dtype.type(1), x.dtype.type(2)
    if interp_size == _LINEAR:
        return np.where(x < one, (one - x).astype(x.dtype), x.dtype.type(0))
    a = x.dtype.type(-0.5)
    near = ((a + two) * x - (a + x.dtype.type(3))) * x * x + one
    far = ((a * x - x.dtype.type(5) * a) * x + x.dtype.type(8) * a) * x - x.dtype.type(4) * a
    return np.where(x < one, near, np.where(x < two, far, x.dtype.type(0))).astype(x.dtype)


def _area_scale(n_in, n_out, align_corners, scale, dt):
    """``area_pixel_compute_scale<dt>``: input pixels per output pixel."""
    if align_corners:
        return dt(n_in - 1) / dt(n_out - 1) if n_out > 1 else dt(0)
    return dt(1.0 / scale) if scale is not None and scale > 0 else dt(n_in) / dt(n_out)


def _trunc(v):
    return np.trunc(v).astype(np.int64)  # C++'s static_cast<int64_t>: towards zero


def aa_weights(n_in, n_out, align_corners, scale, interp_size, dt):
    """``_compute_index_ranges_weights`` with antialias: per output pixel the first input
    pixel ``xmin`` (n_out,) and normalised weights (n_out, taps), zero past each pixel's
    ``xsize``; all arithmetic in ``dt`` where the kernel's is, in float64 where C++ promotes."""
    s = _area_scale(n_in, n_out, align_corners, scale, dt)
    f64 = np.float64
    support = dt(interp_size * 0.5 * f64(s)) if s >= 1.0 else dt(interp_size * 0.5)
    invscale = dt(1.0 / f64(s)) if s >= 1.0 else dt(1.0)
    taps = int(np.ceil(support)) * 2 + 1
    i = np.arange(n_out)
    center = (f64(s) * (i + 0.5)).astype(dt)
    xmin = np.maximum(_trunc((center - support).astype(f64) + 0.5), 0)
    xsize = np.minimum(_trunc((center + support).astype(f64) + 0.5), n_in) - xmin
    xsize = np.clip(xsize, 0, taps)
    j = np.arange(taps)
    pos = (xmin[:, None] + j[None, :]).astype(dt) - center[:, None]  # int - float: float
    w = _filter(((pos.astype(f64) + 0.5) * f64(invscale)).astype(dt), interp_size)
    w = np.where(j[None, :] < xsize[:, None], w, dt(0)).astype(dt)
    total = np.zeros(n_out, dt)
    for k in range(taps):  # summed in order, in dt
        total = (total + w[:, k]).astype(dt)
    w = np.where(total[:, None] != 0, w / np.where(total == 0, dt(1), total)[:, None], w).astype(dt)
    return xmin, w


def _int16_weights(w):
    """``_compute_index_ranges_int16_weights``: (float64) weights as int16 at the largest
    precision (at most 22 bits) that keeps the largest weight below 2**15."""
    wt_max = float(np.max(w)) if w.size else 0.0
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    return np.where(v < 0, _trunc(v - 0.5), _trunc(v + 0.5)).astype(np.int32), precision


def _pass(x, axis, n_out, align_corners, scale, interp_size):
    """One separable pass over ``axis``: a gather of each output pixel's taps, weighted."""
    n_in = x.shape[axis]
    integer = x.dtype == jnp.uint8
    dt = np.float64 if integer or x.dtype == jnp.float64 else np.float32
    xmin, w = aa_weights(n_in, n_out, align_corners, scale, interp_size, dt)
    taps = w.shape[1]
    idx = np.minimum(xmin[:, None] + np.arange(taps)[None, :], n_in - 1)  # past xsize: weight 0
    g = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=axis)
    g = g.reshape(x.shape[:axis] + (n_out, taps) + x.shape[axis + 1 :])
    shape = (n_out, taps) + (1,) * (x.ndim - axis - 1)
    if integer:
        wi, precision = _int16_weights(w)
        acc = jnp.sum(g.astype(jnp.int32) * jnp.asarray(wi.reshape(shape)), axis=axis + 1)
        acc = (acc + (1 << (precision - 1))) >> precision
        return jnp.clip(acc, 0, 255).astype(jnp.uint8)
    return jnp.sum(g * jnp.asarray(w.reshape(shape), x.dtype), axis=axis + 1)


def _resample(x, out_hw, align_corners, scales, interp_size, skip_same):
    """Width, then height; a pass whose size does not change is a copy when ``skip_same``
    (CPU's forward) and runs (weights of the given scale) otherwise (its backward)."""
    scales = tuple(scales) if scales is not None else (None, None)
    for j in (1, 0):
        ax = x.ndim - 2 + j
        if skip_same and x.shape[ax] == out_hw[j]:
            continue
        x = _pass(x, ax, out_hw[j], align_corners, scales[j], interp_size)
    return x


def _forward(out, input, align_corners, scales, interp_size):
    if len(scales) == 1:  # the .vec overloads
        scales = scales[0]
    x = input if input.dtype == jnp.uint8 else _acc(input)
    if tuple(x.shape[-2:]) == tuple(out.shape[-2:]):
        return x  # CPU copies (any dtype)
    return _resample(x, tuple(out.shape[-2:]), align_corners, scales, interp_size, True)


def _backward(grad_output, output_size, input_size, align_corners, scales, interp_size):
    g = _acc(grad_output)
    f = lambda x: _resample(x, tuple(output_size), align_corners, scales, interp_size, False)  # noqa: E731
    _, vjp = jax.vjp(f, jnp.zeros(tuple(input_size), g.dtype))
    return vjp(g)[0]


def upsample_bilinear2d_aa(out, input, output_size, align_corners, *scales):
    """``aten::_upsample_bilinear2d_aa``: separable triangle-filter resampling."""
    return _forward(out, input, align_corners, scales, _LINEAR)


def upsample_bicubic2d_aa(out, input, output_size, align_corners, *scales):
    """``aten::_upsample_bicubic2d_aa``: separable cubic-filter (a = -0.5) resampling."""
    return _forward(out, input, align_corners, scales, _CUBIC)


def upsample_bilinear2d_aa_backward(out, grad_output, output_size, input_size, align_corners, *scales):
    """``aten::_upsample_bilinear2d_aa_backward``: the transpose of both passes."""
    return _backward(grad_output, output_size, input_size, align_corners, scales, _LINEAR)


def upsample_bicubic2d_aa_backward(out, grad_output, output_size, input_size, align_corners, *scales):
    """``aten::_upsample_bicubic2d_aa_backward``: the transpose of both passes."""
    return _backward(grad_output, output_size, input_size, align_corners, scales, _CUBIC)
