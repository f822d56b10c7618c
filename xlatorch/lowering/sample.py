"""Resampling lowerings: reflection/replication padding, nearest and linear upsampling,
grid sampling, im2col/col2im and pixel/channel shuffles.

Source indices and interpolation weights depend only on static sizes and scales, so
they are numpy constants computed with PyTorch's float32 formulas (the same rounding
as its CPU kernels). Backward ops are the vector-Jacobian products of the forwards.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from xlatorch.lowering.pointwise import wide as _acc  # half floats accumulate in float32

_F32 = np.float32


def _vjp(f, grad_output, shape, dtype):
    """The VJP of ``f`` at a zero input of ``shape`` (``f`` is linear in its input)."""
    _, vjp = jax.vjp(f, jnp.zeros(shape, dtype))
    return vjp(grad_output.astype(dtype))[0]


# --- padding ---------------------------------------------------------------------------


def _pad(x, padding, mode):
    """``jnp.pad`` over the last len(padding)/2 dims, PyTorch's order (last dim first);
    negative amounts crop."""
    nd = len(padding) // 2
    pairs = [(0, 0)] * (x.ndim - nd) + [(padding[2 * i], padding[2 * i + 1]) for i in reversed(range(nd))]
    y = jnp.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in pairs], mode=mode)
    crop = tuple(slice(max(-lo, 0), n - max(-hi, 0)) for (lo, hi), n in zip(pairs, y.shape))
    return y[crop]


def reflection_pad(out, self, padding):
    """``aten::reflection_pad{1,2,3}d``: mirror padding without repeating the edge."""
    return _pad(self, padding, "reflect")


def replication_pad(out, self, padding):
    """``aten::replication_pad{1,2,3}d``: padding that repeats the edge values."""
    return _pad(self, padding, "edge")


def reflection_pad_backward(out, grad_output, self, padding):
    """``aten::reflection_pad{1,2,3}d_backward``: the VJP of :func:`reflection_pad`."""
    return _vjp(lambda x: _pad(x, padding, "reflect"), grad_output, self.shape, _acc(grad_output).dtype)


def replication_pad_backward(out, grad_output, self, padding):
    """``aten::replication_pad{1,2,3}d_backward``: the VJP of :func:`replication_pad`."""
    return _vjp(lambda x: _pad(x, padding, "edge"), grad_output, self.shape, _acc(grad_output).dtype)


# --- upsampling ------------------------------------------------------------------------


def _scale(n_in, n_out, scale):
    """PyTorch's ``compute_scales_value<float>``: 1/scale when given, else in/out."""
    return _F32(1.0 / scale) if scale is not None and scale > 0 else _F32(n_in) / _F32(n_out)


def _nearest_index(n_in, n_out, scale, exact):
    dst = np.arange(n_out)
    if not exact and n_out == n_in:
        return dst
    if not exact and n_out == 2 * n_in:
        return dst >> 1
    src = (dst.astype(_F32) + (_F32(0.5) if exact else _F32(0))) * _scale(n_in, n_out, scale)
    return np.minimum(np.floor(src).astype(np.int64), n_in - 1)


def _scales(scales, nd):
    return tuple(scales) if scales is not None else (None,) * nd


def _nearest(x, out_spatial, scales, exact):
    nd = len(out_spatial)
    for j, (o, s) in enumerate(zip(out_spatial, _scales(scales, nd))):
        ax = x.ndim - nd + j
        x = jnp.take(x, jnp.asarray(_nearest_index(x.shape[ax], o, s, exact)), axis=ax)
    return x


def upsample_nearest(out, input, output_size, *scales, exact=False):
    """``aten::upsample_nearest{1,2,3}d`` (and ``_upsample_nearest_exact``): a gather of the
    source pixel PyTorch picks."""
    nd = input.ndim - 2
    if len(scales) == 1 and (scales[0] is None or isinstance(scales[0], tuple)):  # the .vec overloads
        scales = scales[0]
    return _nearest(input, out.shape[-nd:], scales if scales else None, exact)


def upsample_nearest_exact(out, input, output_size, *scales):
    """``aten::_upsample_nearest_exact{1,2,3}d``: nearest with half-pixel centres."""
    return upsample_nearest(out, input, output_size, *scales, exact=True)


def _backward_scales(scales):
    return scales if any(s is not None for s in scales) else None


def upsample_nearest_backward(out, grad_output, output_size, input_size, *scales):
    """``aten::upsample_nearest{1,2,3}d_backward``: the VJP of the nearest gather."""
    f = lambda x: _nearest(x, tuple(output_size), _backward_scales(scales), False)  # noqa: E731
    return _vjp(f, grad_output, tuple(input_size), _acc(grad_output).dtype)


def upsample_nearest_exact_backward(out, grad_output, output_size, input_size, *scales):
    """``aten::_upsample_nearest_exact{1,2,3}d_backward``: the VJP of the exact nearest gather."""
    f = lambda x: _nearest(x, tuple(output_size), _backward_scales(scales), True)  # noqa: E731
    return _vjp(f, grad_output, tuple(input_size), _acc(grad_output).dtype)


def _source_coords(n_in, n_out, align_corners, scale):
    """Each output position's (float32) source coordinate: corner-aligned or half-pixel."""
    if align_corners:
        sc = _F32(n_in - 1) / _F32(n_out - 1) if n_out > 1 else _F32(0)
        return sc * np.arange(n_out).astype(_F32)
    return _scale(n_in, n_out, scale) * (np.arange(n_out).astype(_F32) + _F32(0.5)) - _F32(0.5)


def _linear_weights(n_in, n_out, align_corners, scale):
    """PyTorch's ``compute_indices_weights_linear``: two source indices and their weights."""
    src = _source_coords(n_in, n_out, align_corners, scale)
    if not align_corners:
        src = np.maximum(src, _F32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    lam = np.clip(src - i0.astype(_F32), _F32(0), _F32(1)).astype(_F32)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, _F32(1) - lam, lam


def _linear(x, out_spatial, align_corners, scales):
    nd = len(out_spatial)
    scales = _scales(scales, nd)
    for j in reversed(range(nd)):  # innermost dim first, as PyTorch's kernel nests them
        ax = x.ndim - nd + j
        i0, i1, w0, w1 = _linear_weights(x.shape[ax], out_spatial[j], align_corners, scales[j])
        shape = (-1,) + (1,) * (x.ndim - ax - 1)
        x = (jnp.take(x, jnp.asarray(i0), axis=ax) * jnp.asarray(w0, x.dtype).reshape(shape)
             + jnp.take(x, jnp.asarray(i1), axis=ax) * jnp.asarray(w1, x.dtype).reshape(shape))  # fmt: skip
    return x


def upsample_linear(out, input, output_size, align_corners, *scales):
    """``aten::upsample_{linear1d,bilinear2d,trilinear3d}``: separable linear interpolation
    (in float32 for low-precision inputs)."""
    nd = input.ndim - 2
    if len(scales) == 1 and (scales[0] is None or isinstance(scales[0], tuple)):  # the .vec overloads
        scales = scales[0]
    return _linear(_acc(input), out.shape[-nd:], align_corners, scales if scales else None)


def upsample_linear_backward(out, grad_output, output_size, input_size, align_corners, *scales):
    """``aten::upsample_{linear1d,bilinear2d,trilinear3d}_backward``: the VJP of :func:`upsample_linear`."""
    f = lambda x: _linear(x, tuple(output_size), align_corners, _backward_scales(scales))  # noqa: E731
    return _vjp(f, grad_output, tuple(input_size), _acc(grad_output).dtype)


def _cubic_taps(n_in, n_out, align_corners, scale):
    """PyTorch's bicubic taps: 4 edge-clamped source indices and A = -0.75 weights."""
    src = _source_coords(n_in, n_out, align_corners, scale)
    i0 = np.floor(src).astype(np.int64)
    t = (src - i0.astype(_F32)).astype(_F32)
    idx = [np.clip(i0 - 1 + k, 0, n_in - 1) for k in range(4)]
    return idx, [w.astype(_F32) for w in _cubic_weights(t)]


def _bicubic_resize(x, out_spatial, align_corners, scales):
    scales = _scales(scales, 2)
    for j in reversed(range(2)):  # width first, as PyTorch's kernel nests them
        ax = x.ndim - 2 + j
        idx, wts = _cubic_taps(x.shape[ax], out_spatial[j], align_corners, scales[j])
        shape = (-1,) + (1,) * (x.ndim - ax - 1)
        x = sum(jnp.take(x, jnp.asarray(i), axis=ax) * jnp.asarray(w, x.dtype).reshape(shape) for i, w in zip(idx, wts))
    return x


def upsample_bicubic2d(out, input, output_size, align_corners, *scales):
    """``aten::upsample_bicubic2d``: separable cubic convolution (A = -0.75), edges clamped."""
    if len(scales) == 1 and (scales[0] is None or isinstance(scales[0], tuple)):  # the .vec overload
        scales = scales[0]
    return _bicubic_resize(_acc(input), out.shape[-2:], align_corners, scales if scales else None)


def upsample_bicubic2d_backward(out, grad_output, output_size, input_size, align_corners, *scales):
    """``aten::upsample_bicubic2d_backward``: the VJP of :func:`upsample_bicubic2d`."""
    f = lambda x: _bicubic_resize(x, tuple(output_size), align_corners, _backward_scales(scales))  # noqa: E731
    return _vjp(f, grad_output, tuple(input_size), _acc(grad_output).dtype)


# --- grid sampling ---------------------------------------------------------------------


def _clip(c, size):
    # where, not clip: PyTorch's gradient is 1 on the closed interval and 0 outside
    return jnp.where(c < 0, 0, jnp.where(c > size - 1, size - 1, c))


def _reflect(c, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(c)
    lo, span = twice_low / 2, (twice_high - twice_low) / 2
    c = c - lo
    c = jnp.where(c < 0, -c, c)
    extra = jnp.fmod(c, span)
    flips = jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _unnormalize(coord, size, align_corners):
    return (coord + 1) / 2 * (size - 1) if align_corners else ((coord + 1) * size - 1) / 2


def _pad_coord(c, size, padding_mode, align_corners):
    """PyTorch's ``compute_coordinates``: border clips, reflection mirrors then clips."""
    if padding_mode == 1:
        c = _clip(c, size)
    elif padding_mode == 2:
        c = _reflect(c, 0, 2 * (size - 1)) if align_corners else _reflect(c, -1, 2 * size - 1)
        c = _clip(c, size)
    return jnp.where(jnp.isfinite(c) & (jnp.abs(c) < 2.0**31), c, -100.0)


def _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners):
    n, _, h, w = x.shape
    ix, iy = _unnormalize(grid[..., 0], w, align_corners), _unnormalize(grid[..., 1], h, align_corners)
    if interpolation_mode != 2:
        ix, iy = _pad_coord(ix, w, padding_mode, align_corners), _pad_coord(iy, h, padding_mode, align_corners)
    batch = jnp.arange(n).reshape((n, 1, 1))

    def at(yy, xx):  # zeros outside the input; result (N, C, Ho, Wo)
        inside = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
        yc, xc = jnp.clip(yy, 0, h - 1).astype(jnp.int32), jnp.clip(xx, 0, w - 1).astype(jnp.int32)
        v = x[batch, :, yc, xc]
        return jnp.moveaxis(jnp.where(inside[..., None], v, 0), -1, 1)

    if interpolation_mode == 1:
        return at(jnp.round(iy), jnp.round(ix))
    if interpolation_mode == 2:
        return _bicubic(at, ix, iy, padding_mode, align_corners, h, w)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    x1, y1 = x0 + 1, y0 + 1
    wt = lambda a: a[:, None]  # noqa: E731
    return (at(y0, x0) * wt((x1 - ix) * (y1 - iy)) + at(y0, x1) * wt((ix - x0) * (y1 - iy))
            + at(y1, x0) * wt((x1 - ix) * (iy - y0)) + at(y1, x1) * wt((ix - x0) * (iy - y0)))  # fmt: skip


def _cubic_weights(t, a=-0.75):
    def near(u):
        return ((a + 2) * u - (a + 3)) * u * u + 1

    def far(u):
        return ((a * u - 5 * a) * u + 8 * a) * u - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _bicubic(at, ix, iy, padding_mode, align_corners, h, w):
    """PyTorch's bicubic grid sampling: 4x4 taps, each tap's coordinate padded on its own."""
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    wx, wy = _cubic_weights(ix - x0), _cubic_weights(iy - y0)
    res = 0
    for i in range(4):
        yy = _pad_coord(y0 - 1 + i, h, padding_mode, align_corners)
        row = 0
        for j in range(4):
            row = row + at(yy, _pad_coord(x0 - 1 + j, w, padding_mode, align_corners)) * wx[j][:, None]
        res = res + row * wy[i][:, None]
    return res


def grid_sampler_2d(out, input, grid, interpolation_mode, padding_mode, align_corners):
    """``aten::grid_sampler_2d``: bilinear, nearest or bicubic sampling at grid locations."""
    x, g = _acc(input), _acc(grid)
    return _grid_sample(x, g, interpolation_mode, padding_mode, align_corners)


def grid_sampler_2d_backward(out, grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                             output_mask):  # fmt: skip
    """``aten::grid_sampler_2d_backward``: the VJP of :func:`grid_sampler_2d`."""
    return _grid_vjp(_grid_sample, grad_output, input, grid, interpolation_mode, padding_mode, align_corners)


def _grid_vjp(sample, grad_output, input, grid, interpolation_mode, padding_mode, align_corners):
    """(d input, d grid) of a grid sampler, computed in float32 for low-precision inputs."""
    x, g = _acc(input), _acc(grid)
    f = lambda a, b: sample(a, b, interpolation_mode, padding_mode, align_corners)  # noqa: E731
    _, vjp = jax.vjp(f, x, g)
    return vjp(grad_output.astype(x.dtype))


def _grid_sample_3d(x, grid, interpolation_mode, padding_mode, align_corners):
    n, _, *size = x.shape  # (D, H, W); grid[..., 0] indexes W, grid[..., 2] indexes D
    c = [_pad_coord(_unnormalize(grid[..., 2 - j], size[j], align_corners), size[j], padding_mode, align_corners)
         for j in range(3)]  # fmt: skip
    batch = jnp.arange(n).reshape((n, 1, 1, 1))

    def at(idx):  # zeros outside the input; result (N, C, Do, Ho, Wo)
        inside = functools.reduce(jnp.logical_and, [(i >= 0) & (i < sz) for i, sz in zip(idx, size)])
        ic = [jnp.clip(i, 0, sz - 1).astype(jnp.int32) for i, sz in zip(idx, size)]
        return jnp.moveaxis(jnp.where(inside[..., None], x[batch, :, ic[0], ic[1], ic[2]], 0), -1, 1)

    if interpolation_mode == 1:
        return at([jnp.round(v) for v in c])
    lo = [jnp.floor(v) for v in c]
    res = 0
    for bits in itertools.product((0, 1), repeat=3):  # PyTorch's corner order: tnw, tne, ..., bse
        f = [(v - f0) if b else (f0 + 1 - v) for v, f0, b in zip(c, lo, bits)]
        res = res + at([f0 + b for f0, b in zip(lo, bits)]) * (f[2] * f[1] * f[0])[:, None]
    return res


def grid_sampler_3d(out, input, grid, interpolation_mode, padding_mode, align_corners):
    """``aten::grid_sampler_3d``: trilinear or nearest sampling at grid locations."""
    return _grid_sample_3d(_acc(input), _acc(grid), interpolation_mode, padding_mode, align_corners)


def grid_sampler_3d_backward(out, grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                             output_mask):  # fmt: skip
    """``aten::grid_sampler_3d_backward``: the VJP of :func:`grid_sampler_3d`."""
    return _grid_vjp(_grid_sample_3d, grad_output, input, grid, interpolation_mode, padding_mode, align_corners)


# --- im2col / col2im -------------------------------------------------------------------


def _im2col(x, kernel_size, dilation, padding, stride):
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel_size, dilation, padding, stride
    batched = x.ndim == 4
    x = x if batched else x[None]
    n, c, h, w = x.shape
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    xp = jnp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    taps = [xp[:, :, i * dh : i * dh + (oh - 1) * sh + 1 : sh, j * dw : j * dw + (ow - 1) * sw + 1 : sw]
            for i in range(kh) for j in range(kw)]  # fmt: skip
    cols = jnp.stack(taps, axis=2).reshape((n, c * kh * kw, oh * ow))
    return cols if batched else cols[0]


def im2col(out, self, kernel_size, dilation, padding, stride):
    """``aten::im2col``: sliding kernel_size patches as columns (``F.unfold``)."""
    return _im2col(self, kernel_size, dilation, padding, stride)


def col2im(out, self, output_size, kernel_size, dilation, padding, stride):
    """``aten::col2im``: patch columns summed back into an image (``F.fold``), the VJP of im2col."""
    kk = kernel_size[0] * kernel_size[1]
    shape = self.shape[:-2] + (self.shape[-2] // kk,) + tuple(output_size)
    f = lambda x: _im2col(x, kernel_size, dilation, padding, stride)  # noqa: E731
    return _vjp(f, self, shape, _acc(self).dtype)


# --- shuffles --------------------------------------------------------------------------


def pixel_shuffle(out, self, upscale_factor):
    """``aten::pixel_shuffle``: (*, C r^2, H, W) -> (*, C, H r, W r)."""
    r, lead = upscale_factor, self.shape[:-3]
    c, h, w = self.shape[-3:]
    y = self.reshape(lead + (c // (r * r), r, r, h, w))
    k = len(lead)
    y = jnp.transpose(y, tuple(range(k)) + (k, k + 3, k + 1, k + 4, k + 2))
    return y.reshape(out.shape)


def pixel_unshuffle(out, self, downscale_factor):
    """``aten::pixel_unshuffle``: (*, C, H r, W r) -> (*, C r^2, H, W)."""
    r, lead = downscale_factor, self.shape[:-3]
    c, h, w = self.shape[-3:]
    y = self.reshape(lead + (c, h // r, r, w // r, r))
    k = len(lead)
    y = jnp.transpose(y, tuple(range(k)) + (k, k + 2, k + 4, k + 1, k + 3))
    return y.reshape(out.shape)


def channel_shuffle(out, self, groups):
    """``aten::channel_shuffle``: (N, g * k, *) -> channels interleaved as (N, k * g, *)."""
    n, c = self.shape[:2]
    y = self.reshape((n, groups, c // groups) + self.shape[2:])
    return jnp.swapaxes(y, 1, 2).reshape(self.shape)
