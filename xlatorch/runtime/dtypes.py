"""PyTorch <-> JAX dtype mapping. int64/float64 are exact: JAX x64 is enabled at import."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float16: jnp.dtype(jnp.float16),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.bool: jnp.dtype(jnp.bool_),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
}
JAX_TO_TORCH = {v: k for k, v in TORCH_TO_JAX.items()}

# Python scalars enter graphs as 0-d parameters of these dtypes; ops cast them to
# their computation dtype, exactly as PyTorch casts a scalar argument.
PY_SCALAR_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype that stores a PyTorch dtype; a clear error for unsupported ones."""
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"xlatorch: unsupported dtype {dtype} on the xla device") from None


def to_torch(dtype) -> torch.dtype:
    return JAX_TO_TORCH[jnp.dtype(dtype)]
