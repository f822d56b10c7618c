"""Normalisation lowerings: batch norm (functional form and backward), group norm, the
attention softmax, GLU gating and p-norm distances (cdist, pdist).

Statistics are computed in float32 for low-precision inputs, as PyTorch's CPU kernels
do (two-pass biased variance; the running variance uses the unbiased one). Backward
ops use PyTorch's closed-form gradients with the saved statistics, so the epsilon and
the saved mean/rstd enter exactly as they do in eager mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xlatorch.lowering.pointwise import wide as _acc  # half floats accumulate in float32


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


# --- softmax for attention, gating -----------------------------------------------------


def safe_softmax(out, self, dim, dtype):
    """``aten::_safe_softmax``: softmax whose fully masked (all -inf) rows are 0, not NaN."""
    y = jax.nn.softmax(self.astype(out.dtype), axis=dim)
    return jnp.where(jnp.all(self == -jnp.inf, axis=dim, keepdims=True), 0, y)


# --- p-norm distances ------------------------------------------------------------------


def _pnorm(diff, p, axis=-1):
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(diff.dtype), axis=axis)
    if p == 1:
        return jnp.sum(a, axis=axis)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis))
    if p == float("inf"):
        return jnp.max(a, axis=axis, initial=0)
    return jnp.power(jnp.sum(jnp.power(a, p), axis=axis), 1.0 / p)


def _pnorm_grad(diff, g, dist, p):
    """d(dist)/d(diff) times ``g``, with PyTorch's zero where the distance or term is 0."""
    sign = jnp.sign(diff)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return g * sign
    if p == float("inf"):
        return g * sign * (jnp.abs(diff) == dist)
    safe = jnp.where(dist == 0, 1, dist)
    if p == 2:
        return jnp.where(dist == 0, 0, g * diff / safe)
    a = jnp.abs(diff)
    term = sign * jnp.power(a, p - 1) * g / jnp.power(safe, p - 1)
    return jnp.where((dist == 0) | ((a == 0) & (p < 1)), 0, term)


def _use_mm(p, compute_mode, r1, r2):
    return p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and (r1 > 25 or r2 > 25)))


def euclidean_dist(out, x1, x2):
    """``aten::_euclidean_dist``: sqrt(max(|a|^2 + |b|^2 - 2 a.b, 0)) through one matmul."""
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    a = jnp.concatenate([-2 * x1, n1, jnp.ones_like(n1)], axis=-1)
    b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
    d2 = jnp.matmul(a, jnp.swapaxes(b, -1, -2), precision=lax.Precision.HIGHEST)
    return jnp.sqrt(jnp.maximum(d2, 0))


def cdist_forward(out, x1, x2, p, compute_mode):
    """``aten::_cdist_forward``: pairwise p-norm distances between the rows of x1 and x2."""
    if _use_mm(p, compute_mode, x1.shape[-2], x2.shape[-2]):
        return euclidean_dist(out, x1, x2)
    return _pnorm(x1[..., :, None, :] - x2[..., None, :, :], p)


def cdist_backward(out, grad, x1, x2, p, cdist):
    """``aten::_cdist_backward``: the gradient of :func:`cdist_forward` for x1."""
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    gx = jnp.sum(_pnorm_grad(diff, grad[..., None], cdist[..., None], p), axis=-2)
    # x1 may have been broadcast against x2's batch dims: sum those back
    extra = gx.ndim - len(out.shape)
    gx = jnp.sum(gx, axis=tuple(range(extra)))
    axes = tuple(i for i, (a, b) in enumerate(zip(gx.shape, out.shape)) if a != b)
    return jnp.sum(gx, axis=axes, keepdims=True)


def _pairs(n):
    i, j = np.triu_indices(n, k=1)
    return jnp.asarray(i), jnp.asarray(j)


def pdist_forward(out, self, p):
    """``aten::_pdist_forward``: p-norm distances of all row pairs i < j, row-major."""
    i, j = _pairs(self.shape[0])
    return _pnorm(self[i] - self[j], p)


def pdist_backward(out, grad, self, p, pdist):
    """``aten::_pdist_backward``: each pair's gradient added to row i, subtracted from row j."""
    i, j = _pairs(self.shape[0])
    gd = _pnorm_grad(self[i] - self[j], grad[:, None], pdist[:, None], p)
    return jnp.zeros_like(self).at[i].add(gd).at[j].add(-gd)


def embedding_renorm(out, self, indices, max_norm, norm_type):
    """``aten::embedding_renorm``: rows named by ``indices`` rescaled to p-norm at most max_norm."""
    used = jnp.zeros((self.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    norms = _pnorm(self.astype(jnp.float32), norm_type)
    scale = jnp.where(used & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return (self * scale[:, None].astype(self.dtype)).astype(self.dtype)


# --- weight norm (torch.nn.utils.weight_norm's fused kernels) --------------------------


def _weight_norm_axes(v, dim):
    """The axes CPU's fused kernel reduces (every one but ``dim``, which is 0 or the last) and
    ``dim``'s per-slice values' shape to broadcast against ``v``."""
    axes = tuple(i for i in range(v.ndim) if i != dim)
    keep = tuple(v.shape[i] if i == dim else 1 for i in range(v.ndim))
    return axes, keep


def weight_norm_interface(out, v, g, dim):
    """``aten::_weight_norm_interface``: ``norm = sqrt(sum(v^2))`` over every dim but ``dim`` and
    ``w = v * (g / norm)``, all in CPU's accumulation type (float32 for bfloat16 / float16, w
    rounded once). ``norm`` has ``g``'s shape (CPU fills it as a flat vector of the slices)."""
    x = _acc(v)
    axes, keep = _weight_norm_axes(v, dim)
    norm = jnp.sqrt(jnp.sum(x * x, axis=axes))
    a = _acc(g).reshape(norm.shape).astype(x.dtype) / norm
    w = x * a.reshape(keep)
    return w.astype(out[0].dtype), norm.reshape(out[1].shape).astype(out[1].dtype)


def weight_norm_interface_backward(out, grad_w, saved_v, saved_g, saved_norms, dim):
    """``aten::_weight_norm_interface_backward``: CPU's kernel's formulas per slice, in its
    accumulation type: ``s = sum(grad_w * v)``, ``grad_g = s / norm``, ``a = g / norm``,
    ``b = a * grad_g / norm`` (grad_g unrounded) and ``grad_v = a * grad_w - b * v``."""
    x, gw = _acc(saved_v), _acc(grad_w)
    axes, keep = _weight_norm_axes(saved_v, dim)
    norm = saved_norms.reshape(-1).astype(x.dtype)
    s = jnp.sum(gw * x, axis=axes)
    grad_g = s / norm
    a = _acc(saved_g).reshape(-1).astype(x.dtype) / norm
    b = a * grad_g / norm
    grad_v = a.reshape(keep) * gw - b.reshape(keep) * x
    return grad_v.astype(out[0].dtype), grad_g.reshape(out[1].shape).astype(out[1].dtype)
