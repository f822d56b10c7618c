"""FFTs: the three ATen primitives every ``torch.fft`` function reduces to.

``normalization`` is ATen's fft_norm_mode: 0 none, 1 by 1/sqrt(n), 2 by 1/n, where n
is the signal size (the product of the transformed dimensions' lengths). The jnp
transforms run unnormalised and the scale is applied once, here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def _axes(x, dim):
    return tuple(d % x.ndim for d in dim)


def _scale(y, n, normalization):
    if normalization == 0 or n == 0:
        return y
    return y * (1 / math.sqrt(n) if normalization == 1 else 1 / n)


def fft_r2c(out, self, dim, normalization, onesided):
    """aten._fft_r2c: real -> complex (the last transformed dim halved when ``onesided``)."""
    axes = _axes(self, dim)
    if self.dtype in (jnp.bfloat16, jnp.float16):  # a precision mode's storage: XLA's FFT needs float32
        self = self.astype(jnp.float32)
    y = jnp.fft.rfftn(self, axes=axes) if onesided else jnp.fft.fftn(self, axes=axes)
    return _scale(y, math.prod(self.shape[a] for a in axes), normalization).astype(out.dtype)


def fft_c2c(out, self, dim, normalization, forward):
    """aten._fft_c2c: complex -> complex, forward or (unscaled) inverse."""
    axes = _axes(self, dim)
    if not axes:
        return self
    y = jnp.fft.fftn(self, axes=axes) if forward else jnp.fft.ifftn(self, axes=axes, norm="forward")
    return _scale(y, math.prod(self.shape[a] for a in axes), normalization).astype(out.dtype)


def fft_c2r(out, self, dim, normalization, last_dim_size):
    """aten._fft_c2r: one-sided complex -> real of length ``last_dim_size`` in the last dim."""
    axes = _axes(self, dim)
    s = [self.shape[a] for a in axes[:-1]] + [last_dim_size]
    y = jnp.fft.irfftn(self, s=s, axes=axes, norm="forward")
    return _scale(y, math.prod(s), normalization).astype(out.dtype)
