"""``torch_xla.experimental.custom_kernel``: torch_xla's kernels through JAX, each one node of
the lazy graph (``call_jax``), compiled with the PyTorch ops around it.

- ``flash_attention``: ``jax.nn.dot_product_attention`` (JAX picks its fused kernel where the
  platform has one, e.g. cuDNN on an NVIDIA GPU; XLA's composed attention on CPU), with
  torch_xla's arguments: ``causal``, segment ids, ``sm_scale``, the bias ``ab``. Differentiable
  (``jax.vjp``).
- ``gmm`` / ``tgmm`` (and ``GMM``, ``gmm_backward``): grouped matmuls for mixture-of-experts,
  ``jax.lax.ragged_dot`` / ``ragged_dot_general`` (XLA's ragged dot on every platform);
  differentiable.
- ``paged_attention``, ``multi_queries_paged_attention``, ``ragged_paged_attention``: attention
  over a paged KV cache (``pallas_kernels``). On TPU, ``paged_attention`` and
  ``ragged_paged_attention`` are the Pallas kernels JAX ships; elsewhere, and for
  ``multi_queries_paged_attention`` everywhere, ``jax.numpy`` that XLA compiles.
- ``quantized_matmul_int8``: int8-weight matmul (``pallas_kernels.quantized_matmul_kernel``).
- ``repeat_with_fixed_output_size``: ``repeat_interleave`` with a static output length.
- ``make_kernel_from_pallas`` / ``trace_pallas``: a user's Pallas kernel on xla tensors / its
  lowering. On CPU, Pallas runs in interpret mode only (``pallas_call(..., interpret=True)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from xlatorch.core.xla_builder import call_jax, j2t_autograd
from xlatorch.experimental.pallas_kernels import _attention as paged
from xlatorch.experimental.pallas_kernels._attention import DEFAULT_MASK_VALUE
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.base.record import COUNTERS

__all__ = [
    "DEFAULT_MASK_VALUE", "GMM", "convert_torch_dtype_to_jax", "flash_attention", "gmm", "gmm_backward",
    "make_kernel_from_pallas", "multi_queries_paged_attention", "paged_attention", "quantized_matmul_int8",
    "ragged_paged_attention", "repeat_with_fixed_output_size", "tgmm", "to_jax_shape_dtype_struct", "trace_pallas",
]  # fmt: skip


def _on_tpu() -> bool:
    return jax.devices()[0].platform == "tpu"


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


def _group_bounds(group_sizes, group_offset, num_local: int, m: int):
    """Row counts ``[before, group_offset .. group_offset + num_local - 1, after]``: the groups a
    shard computes, between the rows of the groups before and after it (which sum to ``m``)."""
    sizes = group_sizes.astype(jnp.int32)
    offset = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32).reshape(())
    local = jax.lax.dynamic_slice(sizes, (offset,), (num_local,))
    before = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0))
    return jnp.concatenate([before[None], local, (m - before - jnp.sum(local))[None]])


def _gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs):
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    if group_offset is None and rhs.shape[0] == group_sizes.shape[0]:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=lhs.dtype)
    # A shard of the groups: rows of other groups meet a zero group and come out zero.
    zero = jnp.zeros((1, *rhs.shape[1:]), rhs.dtype)
    bounds = _group_bounds(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])
    return jax.lax.ragged_dot(lhs, jnp.concatenate([zero, rhs, zero]), bounds, preferred_element_type=lhs.dtype)


_GMM = j2t_autograd(_gmm)


def gmm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, tiling: tuple[int, int, int] | None = None,
        group_offset: torch.Tensor | None = None, transpose_rhs: bool = False) -> torch.Tensor:  # fmt: skip
    """Grouped matmul: ``lhs[sizes[i-1]:sizes[i]] @ rhs[i]`` for each group ``i``, ``[m, n]``
    (``jax.lax.ragged_dot``); differentiable.

    Args:
      lhs: ``[m, k]``; its rows in consecutive groups of ``group_sizes[i]`` rows.
      rhs: ``[num_groups, k, n]`` (``[num_groups, n, k]`` with ``transpose_rhs``).
      group_sizes: ``[num_groups]`` integers; rows past their sum are zero.
      tiling: the TPU kernel's tiles; accepted, unused (XLA tiles the ragged dot).
      group_offset: a 0-d/1-element tensor: ``rhs`` holds groups ``group_offset ..`` only (a
        shard of the experts); rows of other groups are zero.
      transpose_rhs: ``rhs`` is ``[num_groups, n, k]``.
    """
    del tiling
    return _GMM(lhs, rhs, group_sizes, group_offset, transpose_rhs=bool(transpose_rhs))


_RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tgmm(lhs, rhs, group_sizes, group_offset, num_groups):
    bounds = _group_bounds(group_sizes, group_offset, num_groups, lhs.shape[1])
    out = jax.lax.ragged_dot_general(lhs, rhs, bounds, _RAGGED_CONTRACTING, preferred_element_type=lhs.dtype)
    return out[1:-1]


def _tgmm_fwd(lhs, rhs, group_sizes, group_offset, num_groups):
    return _tgmm(lhs, rhs, group_sizes, group_offset, num_groups), (lhs, rhs, group_sizes, group_offset)


def _tgmm_bwd(num_groups, res, ct):
    # JAX has no transpose of a ragged contraction; both gradients are ragged dots (gmm).
    lhs, rhs, group_sizes, group_offset = res
    bounds = _group_bounds(group_sizes, group_offset, num_groups, lhs.shape[1])
    zero = jnp.zeros((1, *ct.shape[1:]), ct.dtype)
    ct = jnp.concatenate([zero, ct, zero])  # [groups + 2, k, n]
    d_lhs = jax.lax.ragged_dot(rhs, jnp.swapaxes(ct, 1, 2), bounds, preferred_element_type=lhs.dtype).T
    d_rhs = jax.lax.ragged_dot(lhs.T, ct, bounds, preferred_element_type=rhs.dtype)
    return d_lhs, d_rhs, None, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


def _tgmm_call(lhs, rhs, group_sizes, group_offset, num_groups):
    return _tgmm(lhs, rhs, group_sizes, group_offset, num_groups)


_TGMM = j2t_autograd(_tgmm_call)


def tgmm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
         tiling: tuple[int, int, int] = (512, 512, 512), group_offset: torch.Tensor | None = None,
         num_actual_groups: int | None = None) -> torch.Tensor:  # fmt: skip
    """Transposed grouped matmul: ``lhs[:, sizes[i-1]:sizes[i]] @ rhs[sizes[i-1]:sizes[i]]`` for
    each group ``i``, ``[num_groups, k, n]`` (the weight gradient of ``gmm``;
    ``jax.lax.ragged_dot_general`` with a ragged contraction); differentiable.

    Args:
      lhs: ``[k, m]``; its columns in consecutive groups.
      rhs: ``[m, n]``; its rows in the same groups.
      group_sizes: ``[num_groups]`` integers.
      tiling: the TPU kernel's tiles; accepted, unused.
      group_offset, num_actual_groups: compute only groups ``group_offset .. group_offset +
        num_actual_groups - 1`` (a shard of the experts): ``[num_actual_groups, k, n]``.
    """
    del tiling
    num = group_sizes.shape[0] if num_actual_groups is None else int(num_actual_groups)
    return _TGMM(lhs, rhs, group_sizes, group_offset, num_groups=num)


def gmm_backward(grad: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
                 tiling=(512, 512, 512)) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``gmm``'s gradients ``(d lhs, d rhs)`` for the output gradient ``grad``: ``gmm(grad, rhsᵀ)``
    and ``tgmm(lhsᵀ, grad)``."""
    return gmm(grad, rhs.transpose(-1, -2), group_sizes, tiling), tgmm(lhs.t(), grad, group_sizes, tiling)


class GMM(torch.autograd.Function):
    """``gmm`` whose backward is ``gmm_backward`` (torch_xla's autograd wrapper; ``gmm`` itself is
    differentiable here too)."""

    @staticmethod
    def forward(ctx, lhs, rhs, group_sizes, tiling=(512, 512, 512)):
        ctx.save_for_backward(lhs, rhs, group_sizes)
        ctx.tiling = tiling
        return gmm(lhs, rhs, group_sizes, tiling)

    @staticmethod
    def backward(ctx, grad_output):
        lhs, rhs, group_sizes = ctx.saved_tensors
        return (*gmm_backward(grad_output, lhs, rhs, group_sizes, ctx.tiling), None, None)


def make_kernel_from_pallas(kernel: Callable, output_shape_dtype_fn: Callable | None = None) -> Callable:
    """A function of xla tensors running the JAX function ``kernel`` (a Pallas kernel's
    ``pallas_call``) as one node of the graph; ``output_shape_dtype_fn`` (torch_xla's: the
    outputs' shapes and dtypes) is not needed here: JAX infers them."""
    del output_shape_dtype_fn

    def run(*args, **kwargs):
        return call_jax(kernel, args, kwargs, name=getattr(kernel, "__name__", "pallas kernel"))

    return run


def convert_torch_dtype_to_jax(dtype: torch.dtype) -> jnp.dtype:
    """The JAX dtype of a PyTorch dtype (``torch.bfloat16`` -> ``jnp.bfloat16``)."""
    return jnp.dtype(to_jax(dtype))


def to_jax_shape_dtype_struct(tensor: torch.Tensor) -> jax.ShapeDtypeStruct:
    """``tensor``'s shape and dtype as a ``jax.ShapeDtypeStruct`` (no data)."""
    return jax.ShapeDtypeStruct(tuple(tensor.shape), convert_torch_dtype_to_jax(tensor.dtype))


_TRACED_PALLAS: dict[tuple, str] = {}


def _tpu_custom_call_config(module) -> str | None:
    """The ``backend_config`` of the first ``tpu_custom_call`` in an MLIR module (a Mosaic
    kernel's serialized body), or None."""
    stack = [module.operation]
    while stack:
        op = stack.pop()
        if op.name == "stablehlo.custom_call" and str(op.attributes["call_target_name"]) == '"tpu_custom_call"':
            return op.attributes["backend_config"].value
        for region in reversed(op.regions):
            for block in reversed(list(region.blocks)):
                stack.extend(reversed([o.operation for o in block.operations]))
    return None


def trace_pallas(kernel: Callable, *args, static_argnums=None, static_argnames=None, use_cache=False, **kwargs):
    """Lower the JAX function ``kernel`` for ``args`` (tensors stand for their shapes and
    dtypes); ``(payload, tensor_args)``.

    ``payload`` is, as in torch_xla, the serialized Mosaic kernel (the ``backend_config`` of its
    ``tpu_custom_call``) when ``kernel`` lowers to one (a Pallas kernel on TPU); otherwise
    (interpret mode, or no Pallas call) the StableHLO text of the whole lowering. Compiles
    nothing and runs nothing. xlatorch runs kernels through ``make_kernel_from_pallas`` /
    ``call_jax``, not a payload. With ``use_cache``, a repeated call returns the stored payload
    and counts ``trace_pallas_cache_hit``.
    """
    jax_args = [to_jax_shape_dtype_struct(a) if isinstance(a, torch.Tensor) else a for a in args]
    tensor_args = [a for a in args if isinstance(a, torch.Tensor)]
    key = None
    if use_cache:
        names = tuple(static_argnames) if static_argnames is not None else None
        key = (jax.config.jax_default_matmul_precision, kernel, static_argnums, names, tuple(jax_args),
               repr(sorted(kwargs.items())))  # fmt: skip
        if key in _TRACED_PALLAS:
            COUNTERS["trace_pallas_cache_hit"] += 1
            return _TRACED_PALLAS[key], tensor_args
    lowered = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).lower(*jax_args, **kwargs)
    payload = _tpu_custom_call_config(lowered.compiler_ir()) or lowered.as_text()
    if key is not None:
        _TRACED_PALLAS[key] = payload
    return payload, tensor_args


# Paged attention. The caches are inputs of the node, never copied out to the host.


def _single_query(q, k_pages, v_pages, lengths, page_indices, *, pages_per_compute_block, megacore_mode, soft_cap):
    if _on_tpu():
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

        # The kernel's index arithmetic mixes int32 refs with Python ints: trace it without x64.
        with jax.enable_x64(False):
            return kernel(q, k_pages, v_pages, lengths.astype(jnp.int32), page_indices.astype(jnp.int32),
                          pages_per_compute_block=pages_per_compute_block, megacore_mode=megacore_mode,
                          attn_logits_soft_cap=soft_cap)  # fmt: skip
    ones = jnp.ones(q.shape[:1], jnp.int32)
    return paged.multi_query(q[:, None], k_pages, v_pages, lengths, page_indices, ones, soft_cap=soft_cap)[:, 0]


def paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block, megacore_mode: str = None,
                    attn_logits_soft_cap: float = None) -> torch.Tensor:  # fmt: skip
    """Decode attention over a paged KV cache: query ``b`` (``q`` ``[batch, q_heads, head_dim]``)
    attends the first ``lengths[b]`` keys of pages ``page_indices[b]`` of ``k_pages`` /
    ``v_pages`` ``[kv_heads, total_pages, page_size, head_dim]`` (grouped-query heads). Logits
    are not scaled; ``attn_logits_soft_cap``: ``cap * tanh(s / cap)``.

    On TPU: JAX's Pallas kernel (``pages_per_compute_block`` must divide the pages per
    sequence; ``megacore_mode`` splits it across TPU v4's cores). Elsewhere ``jax.numpy``, where
    both are accepted and unused. One node of the graph; ``[batch, q_heads, head_dim]``.
    """
    if megacore_mode not in ("kv_head", "batch", None):
        raise ValueError(f"megacore_mode must be one of 'kv_head', 'batch', None; got {megacore_mode!r}")
    return call_jax(_single_query, (q, k_pages, v_pages, lengths, page_indices),
                    dict(pages_per_compute_block=int(pages_per_compute_block), megacore_mode=megacore_mode,
                         soft_cap=attn_logits_soft_cap), name="paged_attention")  # fmt: skip


def multi_queries_paged_attention(q, k_pages, v_pages, lengths, page_indices, effective_q_lens,
                                  num_kv_pages_per_compute_block, num_queries_per_compute_block, use_kernel=True,
                                  attn_logits_soft_cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """Paged attention with ``query_len`` queries per example (``q`` ``[batch, query_len, q_heads,
    head_dim]``): example ``b``'s queries are its last ``effective_q_lens[b]`` tokens (causal)
    over its first ``lengths[b]`` keys (see ``pallas_kernels.multi_queries_paged_attention_kernel``).

    ``use_kernel=False`` is torch_xla's reference: masked logits are ``-inf`` (a query with no
    key gives NaN) instead of the kernel's large negative value. Either way one node of the graph,
    ``jax.numpy`` on every platform (JAX ships no kernel for it); the block sizes tune torch_xla's
    TPU kernel and are checked, not used.
    """
    if q.dim() != 4:
        raise ValueError("multi_queries_paged_attention: q must be [batch, query_len, heads, head_dim]")
    from xlatorch.experimental.pallas_kernels.multi_queries_paged_attention_kernel import paged_attention as mq

    kwargs = dict(num_kv_pages_per_compute_block=int(num_kv_pages_per_compute_block),
                  num_queries_per_compute_block=int(num_queries_per_compute_block),
                  attn_logits_soft_cap=attn_logits_soft_cap)  # fmt: skip
    if not use_kernel:
        kwargs["mask_value"] = float("-inf")
    return call_jax(mq, (q, k_pages, v_pages, lengths, page_indices, effective_q_lens), kwargs,
                    name="multi_queries_paged_attention")  # fmt: skip


def _ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, tuning, **kwargs):
    from xlatorch.experimental.pallas_kernels import ragged_paged_attention_v2 as v2

    if tuning is None:  # torch_xla's reference path: never the TPU kernel
        gather = functools.partial(paged.gather_combined, kv_pages)
        return paged.ragged(q, gather, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs)
    return v2.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs, **dict(tuning))


def _check_ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> int:
    """torch_xla's checks of the reference path, on host copies; the number of query rows."""
    n = int(num_seqs.reshape(-1)[0])
    kv_lens, cu_q_lens = kv_lens.cpu(), cu_q_lens.cpu()
    max_seqs, pages_per_seq = page_indices.shape
    if n > max_seqs:
        raise ValueError(f"num_seqs ({n}) must be at most max_num_seqs ({max_seqs})")
    needed = (int(kv_lens[:n].max()) + kv_pages.shape[1] - 1) // kv_pages.shape[1] if n else 0
    if pages_per_seq < needed:
        raise ValueError(f"pages_per_seq ({pages_per_seq}) must be at least {needed} for the longest kv_len")
    rows = int(cu_q_lens[n])
    if rows > q.shape[0]:
        raise ValueError(f"total q tokens ({rows}) must be at most max_num_batched_tokens ({q.shape[0]})")
    for i in range(n):
        q_len, kv_len = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])
        if q_len > kv_len:
            raise ValueError(f"q_len ({q_len}) must be at most kv_len ({kv_len}) at sequence {i}")
    return rows


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0,
                           sliding_window: int | None = None, soft_cap: float | None = None, mask_value=None,
                           k_scale: float | None = None, v_scale: float | None = None, use_kernel=True,
                           num_kv_pages_per_block=None, num_queries_per_block=None,
                           vmem_limit_bytes=None) -> torch.Tensor:  # fmt: skip
    """Attention for a batch mixing prefill and decode over one paged KV cache (vLLM's layout).

    ``q`` ``[max_tokens, q_heads, head_dim]`` holds the queries of sequences ``0 ..
    num_seqs[0]-1`` back to back (sequence ``s``: rows ``cu_q_lens[s] .. cu_q_lens[s+1]-1``, its
    last tokens, causal); its keys are the first ``kv_lens[s]`` of pages ``page_indices[s]`` of
    ``kv_pages`` ``[total_pages, page_size, 2 * kv_heads, head_dim]``, whose heads alternate key,
    value. Logits are scaled by ``sm_scale``, soft-capped, limited to the last ``sliding_window``
    keys; fp8 caches are scaled by ``k_scale`` / ``v_scale``; masked logits get ``mask_value``
    (default ``DEFAULT_MASK_VALUE``).

    ``use_kernel=True``: ``[max_tokens, q_heads, head_dim]`` (rows past the last sequence are
    zero here), JAX's Pallas kernel on TPU and ``jax.numpy`` elsewhere (the block sizes and
    ``vmem_limit_bytes`` tune the TPU kernel). ``use_kernel=False``: torch_xla's reference, which
    checks the inputs on the host (a sync) and returns only the ``cu_q_lens[num_seqs]`` live rows.
    """
    kwargs = dict(sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
                  mask_value=DEFAULT_MASK_VALUE if mask_value is None else float(mask_value), k_scale=k_scale,
                  v_scale=v_scale)  # fmt: skip
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if use_kernel:
        tuning = dict(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
                      vmem_limit_bytes=120 * 1024 * 1024 if vmem_limit_bytes is None else vmem_limit_bytes)  # fmt: skip
        return call_jax(_ragged, args, dict(kwargs, tuning=tuple(sorted(tuning.items()))),
                        name="ragged_paged_attention")  # fmt: skip
    rows = _check_ragged(*args)
    return call_jax(_ragged, args, dict(kwargs, tuning=None), name="ragged_paged_attention")[:rows]


def quantized_matmul_int8(x: torch.Tensor, w: torch.Tensor, scalar: torch.Tensor,
                          zero_point: torch.Tensor | None = None, quant_block_size: torch.Tensor | None = None,
                          quantize_activation: bool = False,
                          batch_block_size: int | None = None, out_block_size: int | None = None,
                          in_block_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """``(x @ wᵀ) * scalar`` with an int8 weight ``w`` ``[n_out, n_in]`` and per-channel scales
    ``scalar`` ``[n_out]``; with ``quantize_activation``, ``x``'s rows are quantized to int8 first
    (w8a8). ``[bs, n_out]`` in ``x``'s dtype.

    With all three block sizes, or an entry of ``pallas_kernels.quantized_matmul_kernel.
    TUNED_BLOCK_SIZES`` for this TPU and shape, the product is the blocked Pallas kernel;
    otherwise one XLA dot (torch_xla's fallback for untuned shapes). One node of the graph.
    """
    from xlatorch.experimental.pallas_kernels import quantized_matmul_kernel as qmk

    blocks = (batch_block_size, out_block_size, in_block_size)
    if any(b is None for b in blocks):
        name = convert_torch_dtype_to_jax(x.dtype).name
        blocks = qmk.get_tuned_block_sizes(qmk.TUNED_BLOCK_SIZES, x.shape[0], w.shape[0], x.shape[1], name,
                                           bool(quantize_activation))  # fmt: skip
    return call_jax(qmk.quantized_matmul_int8, (x, w, scalar),
                    dict(zero_point=zero_point, quant_block_size=quant_block_size,
                         quantize_activation=bool(quantize_activation), batch_block_size=blocks[0],
                         out_block_size=blocks[1], in_block_size=blocks[2]), name="quantized_matmul_int8")  # fmt: skip


def _repeat_fixed(x, repeats, total):
    starts = jnp.cumsum(repeats) - repeats  # where each element's run begins
    return x[jnp.searchsorted(starts, jnp.arange(total), side="right") - 1]


_REPEAT_FIXED = j2t_autograd(_repeat_fixed)


def repeat_with_fixed_output_size(input: torch.Tensor, repeats: torch.Tensor, total_repeat_length: int) -> torch.Tensor:
    """``input[i]`` repeated ``repeats[i]`` times (1-d both), cut or padded to
    ``total_repeat_length`` (a static size: no sync, unlike ``repeat_interleave``). Padding
    repeats the element whose run starts last before the end (``input[-1]`` when
    ``repeats[-1] > 0``), as torch_xla's does. Differentiable in ``input``."""
    if input.dim() != 1 or repeats.dim() != 1:
        raise ValueError("repeat_with_fixed_output_size: input and repeats must be 1-d")
    return _REPEAT_FIXED(input, repeats, total=int(total_repeat_length))
