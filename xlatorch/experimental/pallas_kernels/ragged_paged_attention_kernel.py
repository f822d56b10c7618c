"""``torch_xla.experimental.pallas_kernels.ragged_paged_attention_kernel``: paged attention over
sequences of different query lengths packed in one batch (prefill and decode mixed).

``ragged_paged_attention`` is ``jax.numpy`` (``_attention.ragged``): this layout (separate
key and value caches, heads first) has no kernel in JAX, so XLA compiles it on every
platform. As torch_xla's, it is wrapped in ``checkify``: it returns ``(error, output)``, and
``error.throw()`` raises when the inputs break the kernel's contract.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from xlatorch.experimental.pallas_kernels._attention import DEFAULT_MASK_VALUE, gather_head_major, ragged

__all__ = ["DEFAULT_MASK_VALUE", "MIN_BLOCK_SIZE", "make_sequence_metadata", "ragged_paged_attention"]

MIN_BLOCK_SIZE = 128


def make_sequence_metadata(*, cu_q_lens, m: int, tm: int, start_sequence, num_sequences: int):
    """The work list of a kernel that walks ``m`` packed query rows in tiles of ``tm`` rows, one
    (sequence, tile) pair per step: a tile holding the end of one sequence and the start of the
    next is visited once for each.

    Args:
      cu_q_lens: where each sequence's rows start (``[num_seqs + 1]``, cumulative).
      m, tm: the number of rows and the tile size (``tm`` divides ``m``).
      start_sequence: the first sequence to visit (a 0-d or 1-element array).
      num_sequences: how many sequences to visit.

    Returns:
      ``((seq_ids, physical_q_tile_ids), num_logical_q_tiles)``: for step ``i``, the sequence and
      the tile of rows it works on (arrays of ``m // tm + num_sequences - 1`` entries, the most
      steps there can be; entries past ``num_logical_q_tiles`` repeat the last step).
    """
    if m % tm:
        raise ValueError(f"{m} must be divisible by the tile size {tm}")
    first = jnp.asarray(start_sequence).reshape(-1)[0].astype(jnp.int32)
    bounds = jax.lax.dynamic_slice(jnp.asarray(cu_q_lens, jnp.int32), (first,), (num_sequences + 1,))
    starts, ends = bounds[:-1], bounds[1:]
    first_tile = starts // tm
    tiles = jnp.where(ends > starts, (ends - 1) // tm - first_tile + 1, 0)  # an empty sequence has no step
    done = jnp.cumsum(tiles)
    total = done[-1]
    step = jnp.minimum(jnp.arange(m // tm + num_sequences - 1), total - 1)
    local = jnp.searchsorted(done, step, side="right")
    tile = first_tile[local] + step - (done - tiles)[local]
    return (first + local, tile), total


@checkify.checkify
@functools.partial(
    jax.jit, static_argnames=["num_kv_pages_per_block", "num_queries_per_block", "mask_value", "num_seqs", "sm_scale"]
)
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           mask_value=DEFAULT_MASK_VALUE, num_kv_pages_per_block: int = 128,
                           num_queries_per_block: int = 128, sm_scale: float = 1.0):  # fmt: skip
    """Attention of the packed queries ``q`` ``[num_tokens, q_heads, head_dim]`` of ``num_seqs``
    sequences over the caches ``k_pages``, ``v_pages`` ``[kv_heads, total_pages, page_size,
    head_dim]``.

    Sequence ``s``'s queries are ``q[cu_q_lens[s]:cu_q_lens[s+1]]``, its last tokens; its keys
    the first ``kv_lens[s]`` of pages ``page_indices[s]`` (causal). Logits are scaled by
    ``sm_scale``; masked ones get ``mask_value``. The block sizes tune torch_xla's TPU kernel
    and do not change the result.

    Returns:
      ``(checkify error, [num_tokens, q_heads, head_dim] output)``; rows past the last
      sequence are zero.
    """
    num_tokens, q_heads, _ = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    if q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    live = jnp.arange(kv_lens.shape[0]) < num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    checkify.check(cu_q_lens[num_seqs] <= num_tokens, "cu_q_lens[num_seqs] must be at most the number of tokens")
    bad = live & (q_lens > kv_lens)
    first = jnp.argmax(bad)
    checkify.check(~jnp.any(bad), "cur_q_len must be less or equal to cur_kv_len. Got {} and {}", q_lens[first],
                   kv_lens[first])  # fmt: skip
    needed = (kv_lens + page_size - 1) // page_size
    checkify.check(
        jnp.all(~live | (needed <= page_indices.shape[1])), "a sequence's kv_len needs more pages than given"
    )
    gather = functools.partial(gather_head_major, k_pages, v_pages)
    return ragged(q, gather, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, mask_value=mask_value)
