"""Neural-network lowerings: convolution, pooling, normalisation, losses, activations.

Backward ops whose math is the vector-Jacobian product of a forward written here
use ``jax.vjp`` of that forward, so the two can never disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from xlatorch.lowering import rng
from xlatorch.lowering.pointwise import HALF, rounded
from xlatorch.lowering.pointwise import wide as _wide


def _conv_dn(nd):
    sp = "DHW"[-nd:] if nd <= 3 else None
    return lax.conv_dimension_numbers((1,) * (nd + 2), (1,) * (nd + 2), (f"NC{sp}", f"OI{sp}", f"NC{sp}"))


def _conv(x, w, stride, padding, dilation, groups, wide=False):
    nd = x.ndim - 2
    pads = [(p, p) for p in padding] if len(padding) == nd else [(padding[0], padding[0])] * nd
    return lax.conv_general_dilated(
        x, w, window_strides=stride, padding=pads, rhs_dilation=dilation,
        dimension_numbers=_conv_dn(nd), feature_group_count=groups,
        preferred_element_type=_acc(x),
    ).astype(_acc(x) if wide and _acc(x) else x.dtype)  # fmt: skip


def _acc(x):
    """Accumulate low-precision convolutions in float32 (as PyTorch's CPU and cuDNN kernels do)."""
    return jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None


def _expand(v, nd):
    return tuple(v) * nd if len(v) == 1 else tuple(v)


def _conv_transpose(x, w, stride, padding, dilation, output_padding, groups, wide=False):
    """PyTorch's transposed convolution: the gradient of ``_conv`` w.r.t. its input, as a forward op.

    ``w`` is laid out (in, out / groups, *kernel). The input is dilated by the stride
    (``lhs_dilation``) and convolved at stride 1 with the spatially flipped kernel, its
    in/out channels swapped within each group; each side is padded by
    ``dilation * (kernel - 1) - padding`` (negative pads crop), and the high side also by
    ``output_padding``.
    """
    nd = x.ndim - 2
    cin, cout_g, k = w.shape[0], w.shape[1], w.shape[2:]
    w = w.reshape((groups, cin // groups, cout_g) + k).swapaxes(1, 2).reshape((groups * cout_g, cin // groups) + k)
    w = jnp.flip(w, axis=tuple(range(2, nd + 2)))
    pads = [(d * (n - 1) - p, d * (n - 1) - p + op) for n, p, d, op in zip(k, padding, dilation, output_padding)]
    return lax.conv_general_dilated(
        x, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=_conv_dn(nd), feature_group_count=groups, preferred_element_type=_acc(x),
    ).astype(_acc(x) if wide and _acc(x) else x.dtype)  # fmt: skip


def _conv_fn(nd, stride, padding, dilation, transposed, output_padding, groups, wide=False):
    """``(x, w) -> y`` for a (transposed) convolution with these static parameters (``wide``:
    a half float result left in float32)."""
    st, pd, dl = _expand(stride, nd), _expand(padding, nd), _expand(dilation, nd)
    if transposed:
        opd = _expand(output_padding, nd)
        return lambda x, w: _conv_transpose(x, w, st, pd, dl, opd, groups, wide)
    return lambda x, w: _conv(x, w, st, pd, dl, groups, wide)


def convolution(out, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution, plain or transposed, 1-3 spatial dims, batched or not. A half float
    convolution adds its bias in float32 and rounds once, as CPU's kernel (rounding the sum
    before the bias made 28% of a bfloat16 Conv1d's outputs differ)."""
    batched = input.ndim == weight.ndim
    x = input if batched else input[None]
    nd = x.ndim - 2
    fn = _conv_fn(nd, stride, padding, dilation, transposed, output_padding, groups, wide=bias is not None)
    y = fn(x, weight.astype(x.dtype))
    if bias is not None:
        y = (y + bias.astype(y.dtype).reshape((1, -1) + (1,) * nd)).astype(x.dtype)
    return y if batched else y[0]


def convolution_backward(out, grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):  # fmt: skip
    """aten.convolution_backward: the VJP of the same forward, so the two always agree."""
    nd = input.ndim - 2
    fn = _conv_fn(nd, stride, padding, dilation, transposed, output_padding, groups)
    _, vjp = jax.vjp(fn, input, weight)
    gi, gw = vjp(grad_output.astype(input.dtype))
    gb = jnp.sum(grad_output, axis=(0,) + tuple(range(2, grad_output.ndim))) if bias_sizes is not None else None
    return gi, gw, gb


def _on_vectors(fn, *xs):
    """``fn`` of 0-d arrays applied as to 1-element vectors: PyTorch lets dim 0 (or -1) name
    a 0-d tensor's only element, jax has no axis there."""
    if xs[0].ndim:
        return fn(*xs)
    return fn(*(x.reshape(1) for x in xs)).reshape(())


def softmax(out, self, dim):
    """aten._softmax (0-d inputs included); half dtypes in float32, rounded once, as on CPU."""
    return _on_vectors(lambda x: jax.nn.softmax(x, axis=dim), _wide(self.astype(out.dtype))).astype(out.dtype)


def log_softmax(out, self, dim):
    """aten._log_softmax (0-d inputs included); half dtypes in float32, rounded once, as on CPU,
    except along the last dim, where CPU's kernel keeps each row's sum of exponentials and its
    log in the tensor's dtype: ``x - max - round(log(round(sum)))`` (rounding once had made 6% of
    a bfloat16 log_softmax differ from CPU's, and so the loss of a bfloat16 GPT)."""
    x = _wide(self.astype(out.dtype))
    if out.dtype not in HALF or x.ndim == 0 or dim % x.ndim != x.ndim - 1:
        return _on_vectors(lambda v: jax.nn.log_softmax(v, axis=dim), x).astype(out.dtype)
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    log_sum = rounded(jnp.log(rounded(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True), out.dtype)), out.dtype)
    return (shifted - log_sum).astype(out.dtype)


def log_softmax_backward(out, grad_output, output, dim, input_dtype):
    """g - exp(y) * sum(g), in float32 for bfloat16/float16 and rounded once, as on CPU."""
    return _on_vectors(lambda g, y: g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True),
                       _wide(grad_output), _wide(output)).astype(out.dtype)  # fmt: skip


def softmax_backward(out, grad_output, output, dim, input_dtype):
    """aten._softmax_backward_data: y * (g - sum(g * y)), in float32 for bfloat16/float16 and
    rounded once, as CPU's kernel computes it."""
    g, y = _wide(grad_output), _wide(output)
    return _on_vectors(lambda g, y: y * (g - jnp.sum(g * y, axis=dim, keepdims=True)), g, y).astype(out.dtype)


def _nll_parts(self, target, weight, ignore_index):
    batched = self.ndim == 2
    x = self if batched else self[None]
    t = target if batched else target[None]
    valid = t != ignore_index
    tc = jnp.where(valid, t, 0)
    w = weight[tc] if weight is not None else jnp.ones(tc.shape, x.dtype)
    w = jnp.where(valid, w, 0).astype(x.dtype)
    return batched, x, tc, w


def nll_loss_forward(out, self, target, weight, reduction, ignore_index):
    batched, x, tc, w = _nll_parts(self, target, weight, ignore_index)
    picked = -jnp.take_along_axis(x, tc[:, None], axis=1)[:, 0] * w
    total = jnp.sum(w)
    if reduction == 0:
        loss = picked if batched else picked[0]
    elif reduction == 1:
        loss = jnp.sum(picked) / total
    else:
        loss = jnp.sum(picked)
    return loss, total


def nll_loss_backward(out, grad_output, self, target, weight, reduction, ignore_index, total_weight):
    batched, x, tc, w = _nll_parts(self, target, weight, ignore_index)
    g = grad_output if reduction == 0 else jnp.broadcast_to(grad_output, w.shape)
    if reduction == 0 and not batched:
        g = g.reshape((1,))
    scale = -w * g
    if reduction == 1:
        scale = scale / total_weight
    grad = jnp.zeros(x.shape, x.dtype).at[jnp.arange(x.shape[0]), tc].set(scale.astype(x.dtype))
    return grad if batched else grad[0]


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean, rstd


def native_layer_norm(out, input, normalized_shape, weight, bias, eps):
    x = _wide(input)
    y, mean, rstd = _layer_norm(x, normalized_shape, weight, bias, eps)
    return y, mean, rstd


def native_layer_norm_backward(out, grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    """CPU's kernel's formulas, per row of the normalized dims (N elements), in float32 for
    bfloat16 / float16 inputs: with g = dy * gamma, ds = sum(g * x), db = sum(g),
    b = (db * mean - ds) * rstd^3 / N, c = -b * mean - db * rstd / N: dx = rstd * g + b * x + c;
    dgamma = sum over rows of dy * (x - mean) * rstd, dbeta = sum of dy. A few elementwise ops
    and reductions: differentiating the forward with ``jax.vjp`` cost 20x the lowering time."""
    x = _wide(input)
    dy = _wide(grad_out).astype(x.dtype)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    rows = tuple(range(x.ndim - len(normalized_shape)))
    mean, rstd = mean.astype(x.dtype), rstd.astype(x.dtype)
    g = dy * weight.astype(x.dtype) if weight is not None else dy
    n = 1
    for d in normalized_shape:
        n *= d
    scale = 1.0 / n if n else 0.0
    ds = jnp.sum(g * x, axis=axes, keepdims=True)
    db = jnp.sum(g, axis=axes, keepdims=True)
    b = (db * mean - ds) * rstd * rstd * rstd * scale
    c = -b * mean - db * rstd * scale
    gi = (rstd * g + b * x + c).astype(input.dtype)
    gw = jnp.sum(dy * (x - mean) * rstd, axis=rows).astype(weight.dtype) if weight is not None else None
    gb = jnp.sum(dy, axis=rows).astype(bias.dtype) if bias is not None else None
    return gi, gw, gb


# C's M_SQRT2, M_2_SQRTPI, M_SQRT1_2 (the constants of CPU's GELU kernels)
_SQRT2, _2_SQRTPI, _SQRT1_2 = 1.41421356237309504880, 1.12837916709551257390, 0.70710678118654752440


def gelu(out, self, approximate):
    """GELU by CPU's kernel's formula, ``x * 0.5 * (1 + erf(x / sqrt(2)))`` (``tanh``: ``0.5 * x *
    (1 + tanh(b * (x + k * x**3)))``); half dtypes in float32, rounded once. JAX's ``erfc`` form
    is more accurate for negative ``x``, where ``1 + erf`` cancels, and so further from CPU's:
    7.5% of bfloat16 results differed by one rounding, 4.9% with this one (the rest: XLA's and
    CPU's float32 ``erf`` differ, up to 2e-3 relative in ``1 + erf`` below x = -3)."""
    x = _wide(self)
    if approximate == "tanh":
        beta, kappa = _SQRT2 * _2_SQRTPI * 0.5, 0.044715
        return (0.5 * x * (1 + jnp.tanh(beta * (x + kappa * (x * x * x))))).astype(self.dtype)
    return (x * 0.5 * (1 + lax.erf(x * _SQRT1_2))).astype(self.dtype)


def gelu_backward(out, grad_output, self, approximate):
    """GELU's gradient by CPU's kernel's formulas; half dtypes in float32, rounded once."""
    x, dy = _wide(self), _wide(grad_output.astype(self.dtype))
    if approximate == "tanh":
        beta, kappa = _SQRT2 * _2_SQRTPI * 0.5, 0.044715
        x_sq = x * x
        t = jnp.tanh(beta * (x + kappa * (x_sq * x)))
        d = 0.5 * (1 + t) + (0.5 * x) * (1 - t * t) * (beta * (1 + 3 * kappa * x_sq))
    else:
        d = 0.5 * (1 + lax.erf(x * _SQRT1_2)) + x * (_2_SQRTPI * _SQRT1_2 * 0.5 * jnp.exp(x * x * -0.5))
    return (dy * d).astype(self.dtype)


def embedding_dense_backward(out, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    d = grad_output.shape[-1]
    ix = indices.reshape(-1)
    g = grad_output.reshape(ix.shape[0], d)
    if padding_idx >= 0:
        g = jnp.where((ix == padding_idx)[:, None], 0, g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[ix].add(1)
        g = g / counts[ix][:, None]
    return jnp.zeros((num_weights, d), grad_output.dtype).at[ix].add(g)


def native_dropout(out, input, p, train, seed):
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(rng.key(seed), 1.0 - p, input.shape)
    scale = jnp.where(p < 1, 1.0 / (1.0 - p), 0.0).astype(input.dtype)
    return jnp.where(keep, input * scale, 0).astype(input.dtype), keep


def native_dropout_backward(out, grad_output, mask, scale):
    return grad_output * mask.astype(grad_output.dtype) * scale
