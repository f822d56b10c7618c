"""``torch_xla.experimental.pallas_kernels.multi_queries_paged_attention_kernel``: paged
attention with several queries per example (chunked prefill, speculative decoding).

``paged_attention`` is ``jax.numpy`` (``_attention.multi_query``): JAX ships no kernel for
this call, so XLA compiles it on every platform. The block sizes, which tune torch_xla's TPU
kernel, are accepted and checked as that kernel checks them; they do not change the result.
"""

from __future__ import annotations

import functools

import jax

from xlatorch.experimental.pallas_kernels._attention import DEFAULT_MASK_VALUE, multi_query

__all__ = ["DEFAULT_MASK_VALUE", "MIN_BLOCK_SIZE", "paged_attention"]

MIN_BLOCK_SIZE = 128


@functools.partial(
    jax.jit,
    static_argnames=["num_kv_pages_per_compute_block", "num_queries_per_compute_block", "mask_value",
                     "attn_logits_soft_cap"],
)  # fmt: skip
def paged_attention(q, k_pages, v_pages, lengths, page_indices, effective_q_lens, *, mask_value=DEFAULT_MASK_VALUE,
                    num_kv_pages_per_compute_block: int, num_queries_per_compute_block: int = 4,
                    attn_logits_soft_cap: float | None = None) -> jax.Array:  # fmt: skip
    """Paged grouped-query attention of ``q`` ``[batch, query_len, q_heads, head_dim]`` over the
    caches ``k_pages``, ``v_pages`` ``[kv_heads, total_pages, page_size, head_dim]``.

    Example ``b`` reads its keys from pages ``page_indices[b]`` (``i32[batch, pages_per_seq]``),
    the first ``lengths[b]`` of them; its queries are its last ``effective_q_lens[b]`` tokens
    (causal). Logits are not scaled (scale ``q`` yourself); ``attn_logits_soft_cap`` caps
    them as ``cap * tanh(s / cap)``; masked logits get ``mask_value``.

    Returns:
      ``[batch, query_len, q_heads, head_dim]`` in ``q``'s dtype.
    """
    batch, query_len, q_heads, head_dim = q.shape
    kv_heads, _, _, head_dim_k = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) must equal that of k/v ({head_dim_k})")
    if q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    if lengths.shape != (batch,) or effective_q_lens.shape != (batch,) or page_indices.shape[0] != batch:
        raise ValueError("lengths, effective_q_lens and page_indices must have q's batch size")
    if num_queries_per_compute_block > query_len:
        raise ValueError(f"{num_queries_per_compute_block=} must be at most {query_len=}")
    if num_kv_pages_per_compute_block > pages_per_seq or pages_per_seq % num_kv_pages_per_compute_block:
        raise ValueError(f"{num_kv_pages_per_compute_block=} must divide {pages_per_seq=}")
    return multi_query(q, k_pages, v_pages, lengths, page_indices, effective_q_lens, mask_value=mask_value,
                       soft_cap=attn_logits_soft_cap)  # fmt: skip
