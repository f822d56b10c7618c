"""``torch_xla.backends``: settings of the XLA backend, as ``torch.backends.*`` for others."""

from __future__ import annotations

from xlatorch.runtime.lower import precision as _precision

__all__ = ["set_mat_mul_precision", "get_mat_mul_precision"]


def set_mat_mul_precision(precision: str) -> None:
    """Set the precision of float32 matmuls and convolutions in every graph compiled from now
    on: 'default' (fastest; one bfloat16 pass on TPU, TF32 on recent GPUs), 'high' (three
    bfloat16 passes, about 14 bits) or 'highest' (full float32). Lowers to XLA's dot
    precision; graphs compiled under another setting compile again.

    Raises:
      ValueError: ``precision`` is not one of the three.
    """
    _precision.set_precision(precision)


def get_mat_mul_precision() -> str:
    """The current matmul precision: 'default', 'high' or 'highest'."""
    return _precision.get_precision()
