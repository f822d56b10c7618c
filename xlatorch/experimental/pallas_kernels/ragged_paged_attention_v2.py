"""``torch_xla.experimental.pallas_kernels.ragged_paged_attention_v2``: ragged paged attention
over vLLM's combined KV cache (``[total_pages, page_size, 2 * kv_heads, head_dim]``, heads
alternating key, value), the function behind ``custom_kernel.ragged_paged_attention``.

On TPU it is the Pallas kernel JAX ships for exactly this call
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention``); elsewhere ``jax.numpy``
(``_attention.ragged``), which XLA compiles for CPU or GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xlatorch.experimental.pallas_kernels._attention import DEFAULT_MASK_VALUE, gather_combined, ragged

__all__ = ["DEFAULT_MASK_VALUE", "ragged_paged_attention"]


def _on_tpu() -> bool:
    return jax.devices()[0].platform == "tpu"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float = 1.0,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           mask_value: float | None = DEFAULT_MASK_VALUE, k_scale: float | None = None,
                           v_scale: float | None = None, num_kv_pages_per_block: int | None = None,
                           num_queries_per_block: int | None = None, vmem_limit_bytes: int | None = None):  # fmt: skip
    """Attention of the packed queries ``q`` ``[max_tokens, q_heads, head_dim]`` of sequences
    ``0 .. num_seqs[0]-1`` (rows ``cu_q_lens[s] .. cu_q_lens[s+1]-1``, each sequence's last
    tokens, causal) over the first ``kv_lens[s]`` keys of pages ``page_indices[s]``.

    Logits are scaled by ``sm_scale``, soft-capped (``cap * tanh(s / cap)``), limited to the last
    ``sliding_window`` keys, masked with ``mask_value``; ``k_scale`` / ``v_scale`` scale a
    quantized (fp8) cache. The block sizes and ``vmem_limit_bytes`` tune the TPU kernel.

    Returns:
      ``[max_tokens, q_heads, head_dim]`` in ``q``'s dtype (rows past the last sequence: zero
      off TPU, unspecified on TPU).
    """
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    if _on_tpu():
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel

        ints = [x.astype(jnp.int32) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)]
        # The kernel's index arithmetic mixes int32 refs with Python ints: trace it without x64.
        with jax.enable_x64(False):
            return kernel(q, kv_pages, *ints, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          mask_value=mask_value, k_scale=k_scale, v_scale=v_scale,
                          num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
                          vmem_limit_bytes=vmem_limit_bytes)  # fmt: skip
    gather = functools.partial(gather_combined, kv_pages)
    return ragged(q, gather, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                  sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale,
                  v_scale=v_scale)  # fmt: skip
