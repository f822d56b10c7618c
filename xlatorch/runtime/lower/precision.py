"""The precision of float32 matmuls and convolutions: XLA's dot precision, set for every
graph lowered from now on (``torch_xla.backends.set_mat_mul_precision``).

It is JAX's ``jax_default_matmul_precision``, which every ``dot_general`` and convolution
lowered without an explicit precision takes. The executables in memory were lowered under
the old setting and their keys do not name it, so a change drops them (they compile again,
with the new precision; JAX's persistent cache keys by the lowered module, which names it).
"""

from __future__ import annotations

import jax

from xlatorch.runtime.lower import cache

__all__ = ["LEVELS", "set_precision", "get_precision"]

# torch_xla's names -> XLA's: 'default' one bfloat16 pass (TPU), 'high' three (bf16_3x),
# 'highest' full float32 (six passes on TPU; no TF32 on GPU).
LEVELS = {"default": "default", "high": "high", "highest": "highest"}
_current = ["highest" if jax.config.jax_default_matmul_precision in ("highest", "float32") else "default"]


def set_precision(precision: str) -> None:
    """Lower every later float32 matmul and convolution at ``precision``.

    Raises:
      ValueError: ``precision`` is not 'default', 'high' or 'highest'.
    """
    if precision not in LEVELS:
        raise ValueError(f"Invalid precision: {precision!r}. Must be one of default, high, highest.")
    if precision == _current[0]:
        return
    jax.config.update("jax_default_matmul_precision", LEVELS[precision])
    _current[0] = precision
    cache.CACHE.clear()


def get_precision() -> str:
    """The precision float32 matmuls are lowered at: 'default', 'high' or 'highest'."""
    return _current[0]
