"""``torch_xla.experimental.pallas_kernels.quantized_matmul_kernel``: a matmul with an int8
weight (per output channel scales) and, optionally, int8-quantized activations (w8a8).

``quantized_matmul_int8`` computes ``(x @ wᵀ) * scalar``; with ``quantize_activation`` each
row of ``x`` is first quantized symmetrically to int8 (``scale = max|row| / 127``) and the
product accumulates in int32. With all three block sizes given, the product is a blocked
Pallas kernel (compiled by Mosaic on TPU, run in interpret mode elsewhere); without them it
is one XLA ``dot_general``. Quantizing and scaling are XLA ops around the kernel.

``TUNED_BLOCK_SIZES`` maps ``(tpu_version, batch, n_out, n_in, activation dtype name,
quantize_activation)`` to ``(batch_block, out_block, in_block)``, as torch_xla's table does.
xlatorch ships it empty (its block sizes have not been measured on TPU): without an entry,
``custom_kernel.quantized_matmul_int8`` uses the XLA path, as torch_xla does for untuned
shapes. Add measured entries to the dict to route those shapes to the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["TUNED_BLOCK_SIZES", "get_tpu_version", "get_tuned_block_sizes", "quantized_matmul_int8"]

TUNED_BLOCK_SIZES: dict[tuple, tuple[int, int, int]] = {}


def quantize_rows(x):
    """``x`` ``[rows, n]`` as int8 and the float32 ``[rows, 1]`` scales that restore it: symmetric,
    ``scale = max|row| / 127`` (an all-zero row gets scale 0 and zeros)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = amax / 127.0
    safe = jnp.where(scale == 0, 1.0, scale)
    return jnp.clip(jnp.round(x.astype(jnp.float32) / safe), -128, 127).astype(jnp.int8), scale


def _matmul_kernel(x_ref, w_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                      preferred_element_type=o_ref.dtype)  # fmt: skip


def _blocked_matmul(x, w, acc_dtype, blocks):
    """``x @ wᵀ`` (``[bs, n_in]``, ``[n_out, n_in]``) in ``acc_dtype``, by a Pallas grid of
    ``blocks = (batch_block, out_block, in_block)`` tiles, padding each dimension to a multiple."""
    bb, ob, ib = blocks
    (bs, n_in), n_out = x.shape, w.shape[0]
    pad = lambda n, b: (-n) % b  # noqa: E731
    x = jnp.pad(x, ((0, pad(bs, bb)), (0, pad(n_in, ib))))
    w = jnp.pad(w, ((0, pad(n_out, ob)), (0, pad(n_in, ib))))
    grid = (x.shape[0] // bb, w.shape[0] // ob, x.shape[1] // ib)
    out = pl.pallas_call(
        _matmul_kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((bb, ib), lambda b, o, i: (b, i)), pl.BlockSpec((ob, ib), lambda b, o, i: (o, i))],
        out_specs=pl.BlockSpec((bb, ob), lambda b, o, i: (b, o)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), acc_dtype),
        interpret=jax.devices()[0].platform != "tpu",
    )(x, w)
    return out[:bs, :n_out]


@functools.partial(jax.jit, static_argnames=["quantize_activation", "batch_block_size", "out_block_size",
                                             "in_block_size"])  # fmt: skip
def quantized_matmul_int8(x, w, scalar, zero_point=None, quant_block_size=None, quantize_activation: bool = False, *,
                          batch_block_size: int | None = None, out_block_size: int | None = None,
                          in_block_size: int | None = None) -> jax.Array:  # fmt: skip
    """``(x @ wᵀ) * scalar`` for ``x`` ``[bs, n_in]`` (float), ``w`` ``[n_out, n_in]`` (int8) and
    per-channel ``scalar`` ``[n_out]``; ``[bs, n_out]`` in ``x``'s dtype.

    Args:
      zero_point, quant_block_size: asymmetric and blockwise weights; not supported (as in
        torch_xla's kernel): must be None.
      quantize_activation: quantize ``x``'s rows to int8 first (w8a8, int32 accumulation).
      batch_block_size, out_block_size, in_block_size: the Pallas kernel's tiles (all three);
        None: one XLA ``dot_general``.
    """
    if zero_point is not None or quant_block_size is not None:
        raise NotImplementedError("quantized_matmul_int8: zero_point and quant_block_size are not supported")
    blocks = (batch_block_size, out_block_size, in_block_size)
    if quantize_activation:
        lhs, x_scale = quantize_rows(x)
        acc = jnp.int32
    else:
        lhs, x_scale, acc = x, None, jnp.float32
    if all(b is not None for b in blocks):
        out = _blocked_matmul(lhs, w, acc, blocks)
    else:
        out = jax.lax.dot_general(lhs, w.astype(lhs.dtype), (((1,), (1,)), ((), ())), preferred_element_type=acc)
    out = out.astype(jnp.float32) * scalar.astype(jnp.float32)
    if x_scale is not None:
        out = out * x_scale
    return out.astype(x.dtype)


def get_tpu_version() -> int:
    """The TPU generation behind JAX's first device (5 for "TPU v5 lite"), or -1 off TPU."""
    kind = jax.devices()[0].device_kind
    if "TPU" not in kind:
        return -1
    digits = "".join(c for c in kind.removesuffix(" lite").split("v")[-1] if c.isdigit())
    return int(digits) if digits else -1


def get_tuned_block_sizes(block_table, batch_size, n_output_features, n_input_features, activation_dtype,
                          quantize_activation):  # fmt: skip
    """``block_table``'s ``(batch_block, out_block, in_block)`` for this TPU and shape, or
    ``(None, None, None)``; ``activation_dtype`` is a dtype name (``'bfloat16'``)."""
    key = (get_tpu_version(), batch_size, n_output_features, n_input_features, activation_dtype,
           quantize_activation)  # fmt: skip
    return block_table.get(key, (None, None, None))
