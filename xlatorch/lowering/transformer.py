"""PyTorch's Transformer inference fast path: the fused ops ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` call in eval mode under ``torch.no_grad()`` (the xla device is
PyTorch's privateuse1 backend, which the fast path accepts), and the small ops they reach.

Each follows CPU's kernel (aten/src/ATen/native/transformers/attention.cpp, transformer.cpp,
SoftMax.cpp) step by step: the same products, the same order of additions of biases and
residuals, half floats rounded where CPU stores them. The attention's masked softmax is CPU's:
a mask element that is not zero masks its score out (an additive float mask is read as a
boolean one), and a row whose elements are all masked is NaN.

PyTorch has no meta kernel for ``_transform_bias_rescale_qkv``, ``_masked_softmax``,
``_masked_softmax_backward`` and ``_add_relu.Scalar``: the device reads every result's shape
and dtype from one, so they are registered here, each raising CPU's error where CPU's kernel
refuses the shapes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from xlatorch.lowering import nn
from xlatorch.lowering.pointwise import HALF, accumulated, rounded
from xlatorch.lowering.pointwise import wide as _wide


def _matmul(a, b):
    """``a @ b`` as CPU's gemm: half floats accumulate in float32 and round once."""
    if a.dtype in HALF:
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return jnp.matmul(a, b)


def _linear(x, weight, bias):
    """``addmm(bias, x, weight.t())`` over the last dim of ``x``: half floats add the bias to the
    float32 sums and round once, as CPU's ``addmm``."""
    acc = accumulated(x.dtype)
    return (jnp.matmul(x, weight.T, preferred_element_type=acc) + bias.astype(acc)).astype(x.dtype)


def _inv_sqrt(dim_per_head: int, dtype):
    """CPU's ``1.0 / std::sqrt(static_cast<scalar_t>(dim_per_head))``, stored as ``scalar_t``."""
    d = np.asarray(dim_per_head, dtype=np.float32).astype(dtype)  # scalar_t(dim_per_head)
    return np.asarray(1.0 / float(np.sqrt(np.float32(d))), dtype=np.float64).astype(dtype)


def transform_bias_rescale_qkv(out, qkv, qkv_bias, num_heads):
    """aten._transform_bias_rescale_qkv: ``qkv`` [B, T, 3D] plus its bias, split into q, k, v
    of [B, heads, T, D / heads], q then multiplied by ``1 / sqrt(D / heads)`` (CPU: the sum
    stored in the tensor's dtype, then the product)."""
    b, t, d3 = qkv.shape
    d = d3 // 3
    dh = d // num_heads
    x = (qkv + qkv_bias).reshape(b, t, 3, num_heads, dh).transpose(2, 0, 3, 1, 4)
    q = x[0] * jnp.asarray(_inv_sqrt(dh, np.dtype(qkv.dtype)))
    return q.astype(qkv.dtype), x[1], x[2]


def _expand_mask(x, mask, dim, mask_type):
    """CPU's masked softmax mask as an elementwise mask of ``x``'s shape: ``mask_type`` 0 an
    attention mask [L, L] of 4-d scores [B, H, L, L], 1 a padding mask [B, L], 2 (or any other
    shapes) a mask of ``x``'s own shape."""
    mask = mask.astype(bool)
    if mask.ndim != 2 or x.ndim != 4 or mask_type == 2:
        return mask
    if mask_type == 1:
        return jnp.broadcast_to(mask[:, None, None, :], x.shape)
    return jnp.broadcast_to(mask[None, None], x.shape)


def _masked_softmax(x, masked, dim):
    """CPU's ``host_softmax`` with a mask (True: masked out): the max and the sum over the
    unmasked elements, masked ones 0, each element ``exp(x - max) * (1 / sum)``; a row all
    masked is 0 * (1 / 0), NaN. Half floats: ``x - max`` and ``exp`` rounded as CPU stores
    them, the sum in float32."""
    half = x.dtype if x.dtype in HALF else None
    w = _wide(x)
    mx = jnp.max(jnp.where(masked, -jnp.inf, w), axis=dim, keepdims=True)
    z = jnp.where(masked, 0, rounded(jnp.exp(rounded(w - mx, half)), half))
    return (z * (1 / jnp.sum(z, axis=dim, keepdims=True))).astype(x.dtype)


def masked_softmax(out, self, mask, dim=None, mask_type=None):
    """aten._masked_softmax (CPU's kernel, ``dim`` None: the last)."""
    x = self.reshape(1) if self.ndim == 0 else self
    d = x.ndim - 1 if dim is None else dim % x.ndim
    return _masked_softmax(x, _expand_mask(x, mask, d, mask_type), d).reshape(out.shape)


def masked_softmax_backward(out, grad_output, output, mask, dim=None):
    """aten._masked_softmax_backward: ``y * (g - sum(g * y))`` over the unmasked elements, 0 at
    masked ones (the mask has the gradient's shape). Half floats as CPU's kernel: each product
    ``g * y`` rounded to the dtype before the float32 sum, the rest in float32, rounded once."""
    shape = grad_output.shape or (1,)
    g, y, m = grad_output.reshape(shape), output.reshape(shape), mask.reshape(shape)
    half = g.dtype if g.dtype in HALF else None
    d = g.ndim - 1 if dim is None else dim % g.ndim
    s = jnp.sum(jnp.where(m, 0, rounded(_wide(g) * _wide(y), half)), axis=d, keepdims=True)
    return jnp.where(m, 0, _wide(y) * (_wide(g) - s)).astype(out.dtype).reshape(out.shape)


def _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
               mask_type):  # fmt: skip
    """CPU's ``native_multi_head_attention_cpu``: the projection's result [B, T, D] and the
    per-head attention weights [B, heads, T, T]."""
    d = embed_dim
    if query is key and key is value:  # self-attention: one product, as CPU's
        qkv = _matmul(query, qkv_weight.T)
    else:
        ws = (qkv_weight[:d], qkv_weight[d : 2 * d], qkv_weight[2 * d :])
        qkv = jnp.concatenate([_matmul(t, w.T) for t, w in zip((query, key, value), ws)], axis=-1)
    q, k, v = transform_bias_rescale_qkv(None, qkv, qkv_bias, num_head)
    scores = _matmul(q, jnp.swapaxes(k, -1, -2))
    if mask is None:
        weights = nn.softmax(scores, scores, -1)
    else:
        weights = _masked_softmax(scores, _expand_mask(scores, mask, 3, mask_type), -1)
    ctx = _matmul(weights, v)  # [B, heads, T, D / heads]
    b, t = query.shape[0], query.shape[1]
    proj = _linear(ctx.transpose(0, 2, 1, 3).reshape(b * t, d), proj_weight, proj_bias)
    return proj.reshape(b, t, -1), weights


def native_multi_head_attention(out, query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True,
                                mask_type=None):  # fmt: skip
    """aten._native_multi_head_attention, as CPU's kernel: the weights averaged over heads by a
    sum then a division (each rounded, as CPU's ``sum(1)`` then ``/=``). Without
    ``need_weights`` the weights are the empty tensor PyTorch's meta kernel describes, made None
    as CPU's by ``runtime/device.py``."""
    if query.size == 0 or qkv_weight.shape[0] == 0:
        return jnp.zeros(out[0].shape, out[0].dtype), jnp.zeros(out[1].shape, out[1].dtype)
    proj, weights = _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                               proj_bias, mask, mask_type)  # fmt: skip
    if not need_weights:
        return proj, jnp.zeros(out[1].shape, out[1].dtype)
    if average_attn_weights:
        summed = jnp.sum(_wide(weights), axis=1).astype(weights.dtype)
        weights = (_wide(summed) / num_head).astype(weights.dtype)
    return proj, weights


def _layer_norm(x, embed_dim, eps, weight, bias):
    return nn.native_layer_norm(None, x, [embed_dim], weight, bias, eps)[0].astype(x.dtype)


def _ffn(x, w1, b1, w2, b2, use_gelu):
    """CPU's ``ffn``: ``_addmm_activation`` (exact GELU or ReLU of ``addmm``) then ``addmm``."""
    h = _linear(x, w1, b1)
    h = nn.gelu(h, h, "none") if use_gelu else jnp.maximum(h, jnp.zeros((), h.dtype))
    return _linear(h, w2, b2)


def transformer_encoder_layer_fwd(out, src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                                  norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None,
                                  mask_type=None):  # fmt: skip
    """aten._transformer_encoder_layer_fwd as CPU's ``transformer_encoder_layer_forward``:
    attention (without weights) plus the input, then the feed-forward block plus its input,
    each block's layer norm before it (``norm_first``) or after the residual sum."""
    if src.size == 0:
        return src
    x = _layer_norm(src, embed_dim, eps, norm_weight_1, norm_bias_1) if norm_first else src
    x, _ = _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type)
    x = x + src
    if not norm_first:
        x = _layer_norm(x, embed_dim, eps, norm_weight_1, norm_bias_1)
    res = x
    if norm_first:
        x = _layer_norm(x, embed_dim, eps, norm_weight_2, norm_bias_2)
    x = _ffn(x, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, use_gelu) + res
    if not norm_first:
        x = _layer_norm(x, embed_dim, eps, norm_weight_2, norm_bias_2)
    return x


# The upper bound CPU's add_relu clamps to: the largest value of ``self``'s dtype (not the
# result's: int8 + int16 is clamped to 127); +inf becomes the largest float.
_ADD_RELU_MAX = {
    jnp.dtype(jnp.int8): 2**7 - 1, jnp.dtype(jnp.int16): 2**15 - 1, jnp.dtype(jnp.int32): 2**31 - 1,
    jnp.dtype(jnp.int64): 2**63 - 1, jnp.dtype(jnp.float32): float(np.finfo(np.float32).max),
    jnp.dtype(jnp.float64): float(np.finfo(np.float64).max),
}  # fmt: skip


def add_relu(out, self, other, alpha=1):
    """aten._add_relu (Tensor and Scalar ``other``): ``self + alpha * other`` in the result's
    dtype (integers wrap), clamped to [0, the largest value of ``self``'s dtype] as CPU's
    ``add_clamp`` kernel. NaN stays NaN, as CPU's vectorised loop gives (its scalar tail, the
    last few elements of a row, gives 0)."""
    a = jnp.asarray(self).astype(out.dtype)
    b = jnp.asarray(other).astype(out.dtype)
    r = a + b * jnp.asarray(alpha).astype(out.dtype)
    hi = _ADD_RELU_MAX[jnp.dtype(self.dtype)]
    if jnp.issubdtype(out.dtype, jnp.integer):
        hi = min(hi, int(jnp.iinfo(out.dtype).max))
    return jnp.minimum(jnp.maximum(r, jnp.zeros((), out.dtype)), jnp.asarray(hi, out.dtype))


# --- meta kernels PyTorch lacks ---------------------------------------------------------


def _transform_bias_rescale_qkv_meta(qkv, qkv_bias, num_heads):
    b, t, d3 = qkv.shape
    d = d3 // 3
    torch._check(d % num_heads == 0, lambda: "Expected D % num_head == 0 to be true, but got false.")
    torch._check(d3 % 3 == 0, lambda: "Expected _3D % 3 == 0 to be true, but got false.")
    shape = (b, num_heads, t, d // num_heads)
    return qkv.new_empty(shape), qkv.new_empty(shape), qkv.new_empty(shape)


def _masked_softmax_meta(self, mask, dim=None, mask_type=None):
    torch._check(mask.dtype == torch.bool, lambda: "Mask should be a boolean tensor")
    mt = 2 if mask.dim() != 2 or self.dim() != 4 else mask_type
    torch._check(mt is not None, lambda: "Mask Type should be defined")
    torch._check(
        mt in (0, 1, 2), lambda: "Mask Type should be 0 (src_mask) or 1 (src_key_padding_mask), or 2 (default_mask)"
    )
    if mt == 2:
        torch._check(self.shape == mask.shape, lambda: "For mask_type == 2 mask shape should match input shape")
    elif mt == 1:
        torch._check(self.shape[0] == mask.shape[0] and self.shape[2] == mask.shape[1],
                     lambda: "For mask_type == 1 mask shape should be (B, L)")  # fmt: skip
    elif mt == 0:
        torch._check(self.shape[2] == mask.shape[0] and self.shape[2] == mask.shape[1],
                     lambda: "For mask_type == 0 mask shape should be (L, L)")  # fmt: skip
    return self.new_empty(self.shape)


def _masked_softmax_backward_meta(grad_output, output, mask, dim=None):
    torch._check(grad_output.shape == mask.shape, lambda: "Mask shape should match grad shape")
    torch._check(mask.dtype == torch.bool, lambda: "Mask should be a boolean tensor")
    return grad_output.new_empty(grad_output.shape or (1,))  # CPU's result of a 0-d gradient is 1-d


def _add_relu_scalar_meta(self, other, alpha=1):
    """CPU's ``add_relu(self, wrapped_scalar_tensor(other))``: the number promotes as a number."""
    return torch.ops.aten.add.Scalar(self, other, alpha)


_LIB = torch.library.Library("aten", "IMPL")
for _name, _meta in (("_transform_bias_rescale_qkv", _transform_bias_rescale_qkv_meta),
                     ("_masked_softmax", _masked_softmax_meta),
                     ("_masked_softmax_backward", _masked_softmax_backward_meta),
                     ("_add_relu.Scalar", _add_relu_scalar_meta)):  # fmt: skip
    try:
        _LIB.impl(_name, _meta, "Meta")
    except RuntimeError:  # a later torch registers its own meta kernel for it
        pass
