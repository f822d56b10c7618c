"""``torch_xla.experimental.custom_kernel``: attention and grouped matmul through JAX's kernels,
and a user's Pallas kernel, as nodes of the lazy graph (``call_jax``).

- ``flash_attention``: ``jax.nn.dot_product_attention`` (JAX picks its fused kernel where the
  platform has one, e.g. cuDNN on an NVIDIA GPU; XLA's composed attention on CPU), with
  torch_xla's arguments: ``causal``, segment ids, ``sm_scale``, the bias ``ab``. Differentiable
  (``jax.vjp``).
- ``gmm``: grouped matmul for mixture-of-experts, ``jax.lax.ragged_dot``; differentiable.
- ``make_kernel_from_pallas``: a Pallas kernel (a JAX function calling ``pl.pallas_call``) as
  a function of xla tensors. On CPU, Pallas runs in interpret mode only: write the kernel's
  ``pallas_call`` with ``interpret=True`` there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from xlatorch.core.xla_builder import call_jax, j2t_autograd

__all__ = ["flash_attention", "gmm", "make_kernel_from_pallas"]


def _attention(q, k, v, ab, q_segment_ids, kv_segment_ids, causal, sm_scale):
    # torch_xla's layout is [batch, heads, seq, dim]; JAX's is [batch, seq, heads, dim].
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    mask = None
    if q_segment_ids is not None:
        mask = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    out = jax.nn.dot_product_attention(q, k, v, bias=ab, mask=mask, scale=sm_scale, is_causal=causal)
    return jnp.swapaxes(out, 1, 2)


_ATTENTION = j2t_autograd(_attention)


def flash_attention(q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, *, ab=None,
                    partition_spec=None, mesh=None):  # fmt: skip
    """Attention ``softmax(q kᵀ * sm_scale + ab + masks) v`` on ``[batch, heads, seq, dim]`` tensors.

    Args:
      q, k, v: queries, keys, values (xla tensors).
      causal: a query attends to the keys at its position and before.
      q_segment_ids, kv_segment_ids: ``[batch, seq]`` ids: a query attends only to keys of its
        segment (both or neither).
      sm_scale: the logits' scale (torch_xla's default 1.0, not ``1/sqrt(dim)``).
      ab: a bias added to the logits, ``[batch, heads, q_seq, kv_seq]``.
      partition_spec, mesh: torch_xla's SPMD arguments; not supported yet (must be None).
    """
    if partition_spec is not None or mesh is not None:
        raise NotImplementedError("xlatorch: flash_attention under SPMD (partition_spec, mesh) is not supported yet")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention takes both q_segment_ids and kv_segment_ids, or neither")
    return _ATTENTION(q, k, v, ab, q_segment_ids, kv_segment_ids, causal=bool(causal), sm_scale=float(sm_scale))


def _gmm(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


_GMM = j2t_autograd(_gmm)


def gmm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, tiling=(512, 512, 512)) -> torch.Tensor:
    """Grouped matmul: the rows of ``lhs`` ``[m, k]`` in group ``g`` (consecutive, ``group_sizes[g]``
    of them) times ``rhs[g]`` ``[k, n]``; ``[m, n]``. ``tiling`` is the TPU kernel's, accepted."""
    del tiling
    return _GMM(lhs, rhs, group_sizes)


def make_kernel_from_pallas(kernel: Callable, output_shape_dtype_fn: Callable | None = None) -> Callable:
    """A function of xla tensors running the JAX function ``kernel`` (a Pallas kernel's
    ``pallas_call``) as one node of the graph; ``output_shape_dtype_fn`` (torch_xla's: the
    outputs' shapes and dtypes) is not needed here: JAX infers them."""
    del output_shape_dtype_fn

    def run(*args, **kwargs):
        return call_jax(kernel, args, kwargs, name=getattr(kernel, "__name__", "pallas kernel"))

    return run
