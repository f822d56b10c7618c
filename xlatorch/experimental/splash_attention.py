"""``torch_xla.experimental.splash_attention``: block-sparse attention (causal, local
sliding window, segment ids, logit soft cap), as in MaxText.

On TPU it is JAX's splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``),
vmapped over the batch; elsewhere the same function written with ``jax.numpy``, which XLA
compiles for CPU or GPU. Either way it is one node of the lazy graph with autograd: the
backward is ``jax.vjp`` of the forward (``j2t_autograd``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import torch

from xlatorch.core.xla_builder import j2t_autograd
from xlatorch.experimental.pallas_kernels._attention import DEFAULT_MASK_VALUE

__all__ = ["SplashAttentionConfig", "splash_attention"]


@dataclasses.dataclass(eq=True, frozen=True)
class SplashAttentionConfig:
    """torch_xla's splash settings: the kernel's block sizes and layouts (TPU tuning; they do
    not change results), the SPMD ``mesh`` (a string) and partition specs, and the local
    sliding window (``attentiontype_local_sliding`` with ``slide_window_size``: a query at
    ``i`` attends keys ``i - w ..  i + w``, further limited by ``causal``)."""

    sa_block_q: int = 2048
    sa_block_kv: int = 2048
    sa_block_kv_compute: int = 2048
    sa_block_q_dkv: int = 2048
    sa_block_kv_dkv: int = 2048
    sa_block_kv_dkv_compute: int = 2048
    sa_block_q_dq: int = 2048
    sa_block_kv_dq: int = 2048
    sa_use_fused_bwd_kernel: bool = True
    sa_q_layout: str = "HEAD_DIM_MINOR"
    sa_k_layout: str = "HEAD_DIM_MINOR"
    sa_v_layout: str = "HEAD_DIM_MINOR"
    mesh: str | None = None
    qkv_partition_spec: tuple = (("data", "fsdp"), None, None, None)
    segment_ids_partition_spec: tuple = (("data", "fsdp"), None)
    attentiontype_local_sliding: bool = False
    slide_window_size: int | None = None

    def to_json(self) -> str:
        """The config as a JSON string (what ``splash_attention`` takes)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: str) -> SplashAttentionConfig:
        """The config a ``to_json`` string holds (JSON lists back to tuples)."""

        def tuples(x):
            return tuple(tuples(i) for i in x) if isinstance(x, list) else x

        return cls(**{k: tuples(v) for k, v in json.loads(data).items()})


def _window(config: SplashAttentionConfig) -> int | None:
    if not config.attentiontype_local_sliding:
        return None
    if config.slide_window_size is None:
        raise ValueError("splash_attention: slide_window_size must be set for local sliding attention")
    return int(config.slide_window_size)


def _reference(q, k, v, segment_ids, *, causal, window, soft_cap):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    i = jnp.arange(q.shape[2])[:, None]
    j = jnp.arange(k.shape[2])[None, :]
    keep = jnp.ones((q.shape[2], k.shape[2]), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (i - window <= j) & (j <= i + window)
    keep = keep[None, None]
    if segment_ids is not None:
        keep = keep & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    p = jax.nn.softmax(jnp.where(keep, s, DEFAULT_MASK_VALUE), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32)).astype(q.dtype)


def _tpu_kernel(q, k, v, segment_ids, *, causal, window, soft_cap, config, interpret=False):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    q_len, kv_len = q.shape[2], k.shape[2]
    fused = config.sa_use_fused_bwd_kernel
    blocks = sk.BlockSizes(
        block_q=min(config.sa_block_q, q_len), block_kv=min(config.sa_block_kv, kv_len),
        block_kv_compute=min(config.sa_block_kv_compute, kv_len), block_q_dkv=min(config.sa_block_q_dkv, q_len),
        block_kv_dkv=min(config.sa_block_kv_dkv, kv_len),
        block_kv_dkv_compute=min(config.sa_block_kv_dkv_compute, q_len),
        block_q_dq=None if fused else min(config.sa_block_q_dq, q_len),
        block_kv_dq=None if fused else min(config.sa_block_kv_dq, q_len), use_fused_bwd_kernel=fused,
        q_layout=sk.QKVLayout[config.sa_q_layout], k_layout=sk.QKVLayout[config.sa_k_layout],
        v_layout=sk.QKVLayout[config.sa_v_layout],
    )  # fmt: skip
    mask = sm.CausalMask(shape=(q_len, kv_len)) if causal else sm.FullMask(_shape=(q_len, kv_len))
    if window is not None:
        mask &= sm.LocalMask(shape=(q_len, kv_len), window_size=(window, window), offset=0)
    kernel = sk.make_splash_mha(mask=sm.MultiHeadMask(masks=(mask,) * q.shape[1]), head_shards=1, q_seq_shards=1,
                                block_sizes=blocks, attn_logits_soft_cap=soft_cap, interpret=interpret)  # fmt: skip
    segments = None if segment_ids is None else sk.SegmentIds(segment_ids, segment_ids)
    return jax.vmap(kernel)(q, k, v, segment_ids=segments)


def _splash(q, k, v, segment_ids, *, causal, soft_cap, config_json):
    config = SplashAttentionConfig.from_json(config_json)
    args = dict(causal=causal, window=_window(config), soft_cap=soft_cap)
    if jax.devices()[0].platform == "tpu":
        return _tpu_kernel(q, k, v, segment_ids, config=config, **args)
    return _reference(q, k, v, segment_ids, **args)


_SPLASH = j2t_autograd(_splash)


def splash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: str | SplashAttentionConfig,
                     decoder_segment_ids: torch.Tensor | None = None, causal: bool = True,
                     attn_logits_soft_cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """``softmax(q kᵀ + masks) v`` on ``[batch, heads, seq, head_dim]`` xla tensors; logits are not
    scaled (scale ``q`` yourself), as in the splash kernel. Differentiable.

    Args:
      config: a ``SplashAttentionConfig`` or its ``to_json()`` string (torch_xla passes the string).
      decoder_segment_ids: ``[batch, seq]``: a query attends only keys of its own segment.
      causal: a query attends keys at its position and before.
      attn_logits_soft_cap: logits become ``cap * tanh(s / cap)`` before masking.
    """
    if isinstance(config, SplashAttentionConfig):
        config = config.to_json()
    _window(SplashAttentionConfig.from_json(config))  # the config's errors at the call, not at the sync
    if decoder_segment_ids is not None and decoder_segment_ids.dim() == 0:
        decoder_segment_ids = None
    soft_cap = None if attn_logits_soft_cap is None else float(attn_logits_soft_cap)
    return _SPLASH(q, k, v, decoder_segment_ids, causal=bool(causal), soft_cap=soft_cap, config_json=config)
