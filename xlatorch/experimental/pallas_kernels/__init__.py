"""``torch_xla.experimental.pallas_kernels``: the JAX functions behind
``torch_xla.experimental.custom_kernel``'s paged attention and int8 matmul, taking and returning
``jax.Array``s (call them from JAX, or on xla tensors through ``call_jax``).

torch_xla ships these as TPU-only Pallas kernels. Here each is written with ``jax.numpy``
(XLA compiles it for CPU, GPU or TPU), or as a portable Pallas kernel that runs in interpret
mode off TPU; where JAX itself ships a TPU kernel for the same call, the TPU path uses it.

- ``multi_queries_paged_attention_kernel``: ``paged_attention`` (several queries per example),
  ``DEFAULT_MASK_VALUE``.
- ``ragged_paged_attention_kernel``: ``ragged_paged_attention`` (mixed prefill and decode over
  separate K and V caches), ``make_sequence_metadata``, ``DEFAULT_MASK_VALUE``.
- ``ragged_paged_attention_v2``: ``ragged_paged_attention`` over vLLM's combined KV cache (JAX's
  kernel on TPU).
- ``quantized_matmul_kernel``: ``quantized_matmul_int8``, ``TUNED_BLOCK_SIZES``,
  ``get_tuned_block_sizes``, ``get_tpu_version``.
"""
