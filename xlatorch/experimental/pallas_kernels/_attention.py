"""Paged attention written with ``jax.numpy``: what the paged-attention entry points compute
on every platform where JAX ships no kernel for them (CPU, GPU; TPU for the kernels that
only torch_xla ships).

One rule serves them all: a query attends the keys ``j`` of its sequence with
``lo <= j <= hi`` (``hi`` below the sequence's kv length; ``lo`` from a sliding window);
logits are ``q·k * sm_scale``, soft-capped (``cap * tanh(s / cap)``), masked with
``mask_value`` and softmaxed in float32; a query head group shares one kv head (GQA/MQA).
The paged layouts differ only in how a sequence's keys are gathered from its pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# torch_xla's and JAX's paged kernels mask with a large finite value, not -inf: a query with
# no key to attend gets the mean of the values instead of NaN.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Tokens whose keys are gathered at once in the ragged layout (bounds its memory to
# BLOCK_TOKENS x one sequence's keys, whatever the number of tokens).
BLOCK_TOKENS = 32


def attend(q, k, v, lo, hi, *, sm_scale=1.0, soft_cap=None, mask_value=DEFAULT_MASK_VALUE):
    """One query's attention. ``q``: ``[heads, dim]``; ``k``, ``v``: ``[len, kv_heads, dim]``;
    keys ``lo <= j <= hi`` are attended. Returns ``[heads, dim]`` in ``q``'s dtype."""
    heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(kv_heads, heads // kv_heads, dim)
    s = jnp.einsum("hgd,lhd->hgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    j = jnp.arange(k.shape[0])
    s = jnp.where((j >= lo) & (j <= hi), s, mask_value)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("hgl,lhd->hgd", p, v.astype(jnp.float32))
    return out.reshape(heads, dim).astype(q.dtype)


def gather_head_major(k_pages, v_pages, pages):
    """Keys and values ``[pages * page_size, kv_heads, dim]`` of the pages ``pages`` from caches
    laid out ``[kv_heads, total_pages, page_size, dim]``."""

    def one(cache):
        x = cache[:, pages]  # [kv_heads, n, page_size, dim]
        return jnp.moveaxis(x, 0, 2).reshape(-1, cache.shape[0], cache.shape[-1])

    return one(k_pages), one(v_pages)


def gather_combined(kv_pages, pages):
    """Keys and values ``[pages * page_size, kv_heads, dim]`` from one cache
    ``[total_pages, page_size, 2 * kv_heads, dim]`` whose heads alternate key, value."""
    x = kv_pages[pages]
    x = x.reshape(-1, *x.shape[2:])
    return x[:, 0::2], x[:, 1::2]


def multi_query(q, k_pages, v_pages, lengths, page_indices, effective_q_lens, *, mask_value=DEFAULT_MASK_VALUE,
                soft_cap=None):  # fmt: skip
    """Batched paged attention, ``q`` ``[batch, query_len, heads, dim]``: in example ``b``, query
    ``i`` attends keys ``j < lengths[b]`` with ``j <= i + lengths[b] - effective_q_lens[b]``
    (the queries are the last ``effective_q_lens[b]`` tokens)."""
    k, v = jax.vmap(lambda p: gather_head_major(k_pages, v_pages, p))(page_indices)
    query_len = q.shape[1]

    def example(qb, kb, vb, length, q_len):
        i = jnp.arange(query_len)
        hi = jnp.minimum(length - 1, i + length - q_len)
        per_query = jax.vmap(lambda qi, h: attend(qi, kb, vb, 0, h, soft_cap=soft_cap, mask_value=mask_value))
        return per_query(qb, hi)

    return jax.vmap(example)(q, k, v, lengths, effective_q_lens)


def ragged(q, gather, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0, sliding_window=None,
           soft_cap=None, mask_value=DEFAULT_MASK_VALUE, k_scale=None, v_scale=None):  # fmt: skip
    """Ragged paged attention: ``q`` ``[tokens, heads, dim]`` holds the queries of sequences
    ``0 .. num_seqs-1`` back to back (``cu_q_lens``: where each starts); each sequence's
    queries are its last tokens (causal: ``j <= i + kv_len - q_len``) and, with a sliding
    window ``w``, attend only ``j > i + kv_len - q_len - w``. Rows past the last sequence are
    zero. ``gather(pages)`` gives a sequence's keys and values."""
    num_tokens = q.shape[0]
    num_seqs = jnp.asarray(num_seqs).reshape(-1)[0]
    ends = jnp.where(jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    tokens = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(ends, tokens, side="right"), page_indices.shape[0] - 1)
    live = tokens < cu_q_lens[num_seqs]

    def token_at(args):
        qt, s, t = args
        k, v = gather(page_indices[s])
        if k_scale is not None:
            k = (k.astype(jnp.float32) * k_scale).astype(q.dtype)
        if v_scale is not None:
            v = (v.astype(jnp.float32) * v_scale).astype(q.dtype)
        kv_len, q_len = kv_lens[s], cu_q_lens[s + 1] - cu_q_lens[s]
        last = t - cu_q_lens[s] + kv_len - q_len  # the last key this query may see
        lo = 0 if sliding_window is None else last - sliding_window + 1
        hi = jnp.minimum(kv_len - 1, last)
        return attend(qt, k, v, lo, hi, sm_scale=sm_scale, soft_cap=soft_cap, mask_value=mask_value)

    out = jax.lax.map(token_at, (q, seq, tokens), batch_size=min(BLOCK_TOKENS, max(num_tokens, 1)))
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)
