"""Loss lowerings: elementwise losses with a reduction, their backwards, and 2-d NLL.

``reduction`` is PyTorch's enum: 0 none, 1 mean, 2 sum. Low-precision inputs are
computed in float32 and cast back to the dtype PyTorch's meta kernel gives. Backward
formulas are PyTorch's own (including its choices at kinks, e.g. smooth L1 at 0).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from xlatorch.lowering import (
    ctc,  # noqa: F401 - L.ctc: CTC's lowerings (ops.yaml names them), its meta kernel
    nn,
)
from xlatorch.lowering.pointwise import HALF
from xlatorch.lowering.pointwise import rounded as _rounded


def _acc(*xs):
    return [x.astype(jnp.float32) if x is not None and x.dtype in (jnp.bfloat16, jnp.float16) else x for x in xs]


def _reduce(loss, reduction):
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _n(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _scaled(grad_output, x, reduction):
    g = jnp.broadcast_to(grad_output.astype(x.dtype), x.shape)
    return g / _n(x.shape) if reduction == 1 else g


def mse_loss(out, self, target, reduction):
    """``aten::mse_loss``: reduced squared difference. A bfloat16 / float16 loss is CPU's: the
    difference and each square rounded to the input's dtype (its kernel computes in that dtype)
    before the reduction."""
    x, t = _acc(self, target)
    half = self.dtype if self.dtype in HALF else None
    d = _rounded(x - t, half)
    return _reduce(_rounded(d * d, half), reduction)


def mse_loss_backward(out, grad_output, self, target, reduction):
    """``aten::mse_loss_backward``: ``2 (self - target) grad``."""
    x, t, g = _acc(self, target, grad_output)
    d = jnp.broadcast_to(x - t, out.shape)
    return 2 * d * _scaled(g, d, reduction)


def binary_cross_entropy(out, self, target, weight, reduction):
    """``aten::binary_cross_entropy``: with PyTorch's clamp of the logs at -100."""
    x, t, w = _acc(self, target, weight)
    loss = (t - 1) * jnp.maximum(jnp.log1p(-x), -100) - t * jnp.maximum(jnp.log(x), -100)
    if w is not None:
        loss = loss * w
    return _reduce(loss, reduction)


def binary_cross_entropy_backward(out, grad_output, self, target, weight, reduction):
    """``aten::binary_cross_entropy_backward``: ``(x - t) / max(x (1 - x), 1e-12)``."""
    x, t, w, g = _acc(self, target, weight, grad_output)
    gi = (x - t) / jnp.maximum((1 - x) * x, 1e-12) * _scaled(g, x, reduction)
    return gi if w is None else gi * w


def binary_cross_entropy_with_logits(out, self, target, weight, pos_weight, reduction):
    """``aten::binary_cross_entropy_with_logits``: ``(1 - t) x - log_weight * log_sigmoid(x)``, as
    CPU's composite computes it, op by op: for half floats each op's result is rounded to their
    dtype (rounding once had made 37% of a bfloat16 loss differ from CPU's)."""
    x, t, w, pw = _acc(self, target, weight, pos_weight)
    half = self.dtype if self.dtype in HALF else None
    ls = _rounded(jnp.minimum(x, 0) - jnp.log1p(jnp.exp(-jnp.abs(x))), half)  # CPU's log_sigmoid kernel
    if pw is not None:
        ls = _rounded(ls * _rounded(_rounded(_rounded(pw - 1, half) * t, half) + 1, half), half)
    loss = _rounded(_rounded(_rounded(1 - t, half) * x, half) - ls, half)
    if w is not None:
        loss = _rounded(loss * w, half)
    return _reduce(loss, reduction)


def smooth_l1_loss(out, self, target, reduction, beta):
    """``aten::smooth_l1_loss``: quadratic below ``beta``, linear above (L1 when beta is 0).
    float16 as CPU's kernel computes it, in float16 arithmetic (each op rounded, ``beta`` a
    float16); bfloat16 in float32, rounded once (CPU's two paths differ: 17% of a float16 loss
    had differed)."""
    x, t = _acc(self, target)
    if self.dtype == jnp.float16:
        return _reduce(_quadratic_below(x, t, beta, self.dtype, huber=False), reduction)
    z = jnp.abs(x - t)
    safe = jnp.where(beta == 0, 1, beta)
    loss = jnp.where(z < beta, 0.5 * z * z / safe, z - 0.5 * beta)
    return _reduce(loss, reduction)


def _quadratic_below(x, t, edge, dtype, huber):
    """smooth_l1 / huber in ``dtype``'s arithmetic, each op rounded, as CPU's scalar kernels."""
    z = _rounded(jnp.abs(_rounded(x - t, dtype)), dtype)
    e = _rounded(jnp.asarray(edge, x.dtype), dtype)
    sq = _rounded(_rounded(0.5 * z, dtype) * z, dtype)
    half_e = _rounded(0.5 * e, dtype)
    if huber:
        return jnp.where(z < e, sq, _rounded(e * _rounded(z - half_e, dtype), dtype))
    return jnp.where(z < e, _rounded(sq / jnp.where(e == 0, 1, e), dtype), _rounded(z - half_e, dtype))


def smooth_l1_loss_backward(out, grad_output, self, target, reduction, beta):
    """``aten::smooth_l1_loss_backward``: -1 / 1 outside (-beta, beta), ``d / beta`` inside."""
    x, t, g = _acc(self, target, grad_output)
    d = jnp.broadcast_to(x - t, out.shape)
    safe = jnp.where(beta == 0, 1, beta)
    slope = jnp.where(d <= -beta, -1, jnp.where(d >= beta, 1, d / safe))
    return slope * _scaled(g, d, reduction)


def huber_loss(out, self, target, reduction, delta):
    """``aten::huber_loss``: quadratic below ``delta``, ``delta``-scaled linear above. bfloat16 as
    CPU's kernel computes it, in bfloat16 arithmetic (each op rounded, ``delta`` a bfloat16);
    float16 in float32, rounded once (37% of a bfloat16 loss had differed)."""
    x, t = _acc(self, target)
    if self.dtype == jnp.bfloat16:
        return _reduce(_quadratic_below(x, t, delta, self.dtype, huber=True), reduction)
    z = jnp.abs(x - t)
    loss = jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))
    return _reduce(loss, reduction)


def huber_loss_backward(out, grad_output, self, target, reduction, delta):
    """``aten::huber_loss_backward``: ``d`` inside (-delta, delta), ``±delta`` outside."""
    x, t, g = _acc(self, target, grad_output)
    d = jnp.broadcast_to(x - t, out.shape)
    slope = jnp.where(d <= -delta, -delta, jnp.where(d >= delta, delta, d))
    return slope * _scaled(g, d, reduction)


def soft_margin_loss(out, self, target, reduction):
    """``aten::soft_margin_loss``: ``log1p(exp(-target * self))``, op by op as CPU's composite:
    half floats rounded after each (18-20% had differed)."""
    x, t = _acc(self, target)
    half = self.dtype if self.dtype in HALF else None
    return _reduce(_rounded(jnp.log1p(_rounded(jnp.exp(_rounded(-x * t, half)), half)), half), reduction)


def soft_margin_loss_backward(out, grad_output, self, target, reduction):
    """``aten::soft_margin_loss_backward``: ``-target z / (1 + z)`` with ``z = exp(-target self)``."""
    x, t, g = _acc(self, target, grad_output)
    z = jnp.exp(-t * x)
    gi = -t * z / (1 + z)
    return gi * _scaled(g, jnp.broadcast_to(gi, out.shape), reduction)


def _flat_classes(self, target):
    """(N, C, d1, ...) scores and (N, d1, ...) targets as (N*d1*..., C) and (N*d1*...)."""
    x = jnp.moveaxis(self, 1, -1).reshape((target.size, self.shape[1]))
    return x, target.reshape(-1)


def nll_loss2d_forward(out, self, target, weight, reduction, ignore_index):
    """``aten::nll_loss2d_forward``: :func:`nn.nll_loss_forward` over every pixel."""
    x, t = _flat_classes(self, target)
    loss, total = nn.nll_loss_forward(out, x, t, weight, reduction, ignore_index)
    return (loss.reshape(target.shape) if reduction == 0 else loss), total


def nll_loss2d_backward(out, grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """``aten::nll_loss2d_backward``: :func:`nn.nll_loss_backward` over every pixel."""
    x, t = _flat_classes(self, target)
    g = grad_output.reshape(-1) if reduction == 0 else grad_output
    grad = nn.nll_loss_backward(out, g, x, t, weight, reduction, ignore_index, total_weight)
    n, c = self.shape[0], self.shape[1]
    return jnp.moveaxis(grad.reshape((n,) + self.shape[2:] + (c,)), -1, 1)


# --- margin losses over classes --------------------------------------------------------


def _frames(self, target):
    """``self`` as CPU's kernels read it, (frames, classes): a 0-d input is one class, a 1-d
    one a single frame; ``target`` flattened to match."""
    x = self.reshape((1, 1) if self.ndim == 0 else (1, -1) if self.ndim == 1 else self.shape)
    return x, target.reshape((x.shape[0], -1)).astype(jnp.int64)


def _per_frame(rows, reduction, out_shape, n, dim):
    """CPU's reduction of the per-frame sums ``rows``: each divided by ``dim``, then their sum,
    or their mean over the frames, or (``none`` with a frame per target) the rows."""
    if out_shape:
        return rows / dim
    total = jnp.sum(rows) / dim
    return total / n if reduction == 1 else total


def multi_margin_loss(out, self, target, p, margin, weight, reduction):
    """``aten::multi_margin_loss``: per frame, ``sum over d != t of w[t] max(margin - x[t] +
    x[d], 0)^p / dim``, then the reduction (``none`` for a 1-d input gives a 0-d result)."""
    x, t = _frames(self, target)
    n, dim = x.shape
    t = t.reshape(n)
    xt = jnp.take_along_axis(x, t[:, None], axis=1)
    z = jnp.asarray(margin, x.dtype) - xt + x
    h = jnp.where(z > 0, z if p == 1 else z * z, 0)
    if weight is not None:
        h = h * weight.reshape(-1)[t][:, None]
    h = jnp.where(jnp.arange(dim)[None, :] == t[:, None], 0, h)
    return _per_frame(jnp.sum(h, axis=1), reduction, out.shape, n, dim).reshape(out.shape).astype(out.dtype)


def multi_margin_loss_backward(out, grad_output, self, target, p, margin, weight, reduction):
    """``aten::multi_margin_loss_backward``: CPU's kernel: with ``g = 1 / dim`` (``1 / (frames
    dim)`` for the mean), ``h = w[t] (g or 2 g z)`` where ``z > 0``, each class d != t gets
    ``h`` and the target class minus their sum; times the output's gradient."""
    x, t = _frames(self, target)
    n, dim = x.shape
    t = t.reshape(n)
    g = 1.0 / (n * dim) if reduction == 1 else 1.0 / dim
    xt = jnp.take_along_axis(x, t[:, None], axis=1)
    z = jnp.asarray(margin, x.dtype) - xt + x
    h = jnp.where(z > 0, g if p == 1 else 2 * g * z, 0).astype(x.dtype)
    if weight is not None:
        h = h * weight.reshape(-1)[t][:, None]
    is_t = jnp.arange(dim)[None, :] == t[:, None]
    h = jnp.where(is_t, 0, h)
    gi = jnp.where(is_t, -jnp.sum(h, axis=1, keepdims=True), h)
    go = grad_output.reshape((n, 1) if reduction == 0 and grad_output.ndim else ())
    return (gi * go).reshape(self.shape).astype(out.dtype)


def _label_sets(x, t):
    """multilabel: per frame, which target slots count (those before the first negative) and
    which classes are targets (``is_target``)."""
    dim = x.shape[1]
    neg = t < 0
    first = jnp.min(jnp.where(neg, jnp.arange(dim)[None, :], dim), axis=1, keepdims=True)
    used = jnp.arange(dim)[None, :] < first
    hits = used[:, :, None] & (t[:, :, None] == jnp.arange(dim)[None, None, :])
    return used, jnp.any(hits, axis=1)


def _label_margins(x, t, used, nontarget):
    """z[i, j, d] = 1 - x[i, t_j] + x[i, d] > 0 for each counted slot j and non-target d."""
    xt = jnp.take_along_axis(x, jnp.where(used, t, 0), axis=1)
    z = 1 - xt[:, :, None] + x[:, None, :]
    return z, used[:, :, None] & nontarget[:, None, :] & (z > 0)


def multilabel_margin_loss_forward(out, self, target, reduction):
    """``aten::multilabel_margin_loss_forward``: (loss, is_target). Per frame, the sum over the
    target slots before the first -1 and the non-target classes d of ``max(1 - x[t_j] + x[d],
    0)``, over ``dim``; then the reduction (``none`` for a 1-d input gives a 0-d result)."""
    x, t = _frames(self, target)
    n, dim = x.shape
    used, is_target = _label_sets(x, t)
    z, live = _label_margins(x, t, used, ~is_target)
    rows = jnp.sum(jnp.where(live, z, 0), axis=(1, 2))
    loss = _per_frame(rows, reduction, out[0].shape, n, dim).reshape(out[0].shape)
    return loss.astype(out[0].dtype), is_target.reshape(target.shape).astype(out[1].dtype)


def multilabel_margin_loss_backward(out, grad_output, self, target, reduction, is_target):
    """``aten::multilabel_margin_loss_backward``: CPU's kernel: for each counted slot j and
    class d not marked in ``is_target`` (the argument, as CPU reads it) with ``1 - x[t_j] +
    x[d] > 0``, ``g`` added to d and taken from t_j (``g = 1 / dim``, ``1 / (frames dim)`` for
    the mean); times the output's gradient."""
    x, t = _frames(self, target)
    n, dim = x.shape
    g = 1.0 / (n * dim) if reduction == 1 else 1.0 / dim
    used, _ = _label_sets(x, t)
    _, live = _label_margins(x, t, used, is_target.reshape(n, dim) == 0)
    count = live.astype(x.dtype)
    plus = jnp.sum(count, axis=1)  # (n, dim): per class d
    minus = jnp.zeros_like(x).at[jnp.arange(n)[:, None], jnp.where(used, t, 0)].add(jnp.sum(count, axis=2))
    gi = (plus - minus) * jnp.asarray(g, x.dtype)
    go = grad_output.reshape((n, 1) if reduction == 0 and grad_output.ndim else ())
    return (gi * go).reshape(self.shape).astype(out.dtype)


# PyTorch has no meta kernels for these backwards: the gradient is shaped as ``self``.
def _like_self_meta(grad_output, self, *args, **kwargs):
    return self.new_empty(self.shape)


# The forwards' meta kernels (PyTorch's decompositions) give ``reduction='none'`` of a 1-d
# input a loss of shape [1]; CPU gives a 0-d one (multi_margin: for a 0-d target). Their checks
# stand, the shape is CPU's.
_DECOMP = torch._decomp.decomposition_table
_aten = torch.ops.aten


def _multi_margin_meta(self, target, p=1, margin=1, weight=None, reduction=1):
    res = _DECOMP[_aten.multi_margin_loss.default](self, target, p, margin, weight, reduction)
    return res.reshape(()) if reduction == 0 and target.dim() == 0 else res


def _multilabel_margin_meta(self, target, reduction):
    loss, is_target = _DECOMP[_aten.multilabel_margin_loss_forward.default](self, target, reduction)
    return (loss.reshape(()) if target.dim() <= 1 else loss), is_target


_LIB = torch.library.Library("aten", "IMPL")
for _name, _meta in (("multi_margin_loss_backward", _like_self_meta),
                     ("multilabel_margin_loss_backward", _like_self_meta), ("multi_margin_loss", _multi_margin_meta),
                     ("multilabel_margin_loss_forward", _multilabel_margin_meta)):  # fmt: skip
    try:
        _LIB.impl(_name, _meta, "Meta")
    except RuntimeError:  # a torch that registers its own
        pass
