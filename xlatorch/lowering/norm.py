"""Normalisation lowerings: batch norm (functional form and backward) and group norm.

Statistics are computed in float32 for low-precision inputs, as PyTorch's CPU kernels
do (two-pass biased variance; the running variance uses the unbiased one). Backward
ops use PyTorch's closed-form gradients with the saved statistics, so the epsilon and
the saved mean/rstd enter exactly as they do in eager mode.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _acc(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _channel_view(v, ndim):
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _channel_view(mean, x.ndim)), axis=axes)
    return mean, var, x.size // max(x.shape[1], 1)


def _affine(y, weight, bias):
    if weight is not None:
        y = y * _channel_view(_acc(weight), y.ndim)
    if bias is not None:
        y = y + _channel_view(_acc(bias), y.ndim)
    return y


def native_batch_norm_legit_functional(out, input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``aten::_native_batch_norm_legit_functional``: batch norm returning the new running stats."""
    x = _acc(input)
    if training:
        mean, var, n = _batch_stats(x)
        rstd = lax.rsqrt(var + eps)
        unbiased = var * (n / (n - 1)) if n > 1 else jnp.full_like(var, jnp.nan)
        new_mean = momentum * mean + (1 - momentum) * running_mean
        new_var = momentum * unbiased + (1 - momentum) * running_var
    else:
        mean, rstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
        new_mean, new_var = running_mean, running_var
    y = (x - _channel_view(mean, x.ndim)) * _channel_view(rstd, x.ndim)
    # In evaluation mode eager CPU saves empty statistics; the meta kernels say which.
    save_mean = mean if out[1].shape == mean.shape else jnp.zeros(out[1].shape)
    save_rstd = rstd if out[2].shape == rstd.shape else jnp.zeros(out[2].shape)
    return _affine(y, weight, bias), save_mean, save_rstd, new_mean, new_var


def native_batch_norm_legit_no_stats(out, input, weight, bias, training, momentum, eps):
    """``aten::_native_batch_norm_legit.no_stats``: batch norm with batch statistics only."""
    x = _acc(input)
    mean, var, _ = _batch_stats(x)
    rstd = lax.rsqrt(var + eps)
    y = (x - _channel_view(mean, x.ndim)) * _channel_view(rstd, x.ndim)
    return _affine(y, weight, bias), mean, rstd


def native_batch_norm_legit_no_training(out, input, weight, bias, running_mean, running_var, momentum, eps):
    """``aten::_native_batch_norm_legit_no_training``: batch norm with the running statistics."""
    res = native_batch_norm_legit_functional(out, input, weight, bias, running_mean, running_var, False, momentum, eps)
    return res[:3]


def native_batch_norm_backward(out, grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                               eps, output_mask):  # fmt: skip
    """``aten::native_batch_norm_backward``: PyTorch's closed-form batch-norm gradients."""
    x, dy = _acc(input), _acc(grad_out)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, rstd = _acc(save_mean), _acc(save_invstd)
    else:
        mean, rstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
    w = jnp.ones(x.shape[1], x.dtype) if weight is None else _acc(weight)
    xc = x - _channel_view(mean, x.ndim)
    sum_dy = jnp.sum(dy, axis=axes)
    dot = jnp.sum(xc * dy, axis=axes)
    if train:
        n = x.size // max(x.shape[1], 1)
        proj = xc * _channel_view(dot / n * rstd * rstd, x.ndim)
        gi = (dy - _channel_view(sum_dy / n, x.ndim) - proj) * _channel_view(rstd * w, x.ndim)
    else:
        gi = dy * _channel_view(rstd * w, x.ndim)
    return gi, dot * rstd, sum_dy


def _groups(x, n, c, group):
    return x.reshape((n, group, (c // group) * (x.size // max(n * c, 1)))) if x.size else x.reshape((n, group, 0))


def native_group_norm(out, input, weight, bias, N, C, HxW, group, eps):
    """``aten::native_group_norm``: normalise each (sample, group) block, then the affine map."""
    x = _acc(input)
    g = _groups(x, N, C, group)
    mean = jnp.mean(g, axis=-1)
    var = jnp.mean(jnp.square(g - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    y = ((g - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    return _affine(y, weight, bias), mean, rstd


def native_group_norm_backward(out, grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    """``aten::native_group_norm_backward``: PyTorch's closed-form group-norm gradients."""
    x, dy = _acc(input), _acc(grad_out)
    shape4 = (N, group, C // group if group else 0, HxW)
    xg, dyg = x.reshape(shape4), dy.reshape(shape4)
    m, r = _acc(mean)[..., None, None], _acc(rstd)[..., None, None]
    xhat = (xg - m) * r
    w = jnp.ones((C,), x.dtype) if weight is None else _acc(weight)
    dyw = dyg * w.reshape((1, group, -1, 1))
    cnt = shape4[2] * HxW
    mean_dyw = jnp.sum(dyw, axis=(2, 3), keepdims=True) / max(cnt, 1)
    mean_dyw_xhat = jnp.sum(dyw * xhat, axis=(2, 3), keepdims=True) / max(cnt, 1)
    gi = (r * (dyw - mean_dyw - xhat * mean_dyw_xhat)).reshape(x.shape)
    gw = jnp.sum(dyg * xhat, axis=(0, 3)).reshape((C,))
    gb = jnp.sum(dyg, axis=(0, 3)).reshape((C,))
    return gi, gw, gb
