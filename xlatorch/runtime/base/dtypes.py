"""PyTorch <-> JAX dtype mapping. int64/float64 are exact: JAX x64 is enabled at import.

The precision mode is read once, at import, from the environment (torch_xla's and
lazy_tensor_core's spellings, parsed like their ``GetEnvBool``):

- ``XLA_USE_BF16`` / ``LTC_USE_BF16``: float32 and float64 are stored (and computed) as
  bfloat16 on the device.
- ``XLA_DOWNCAST_BF16`` / ``LTC_DOWNCAST_BF16``: float32 is stored as bfloat16 and
  float64 as float32. (``USE_BF16`` wins for float64 when both are set, as in torch_xla.)

Tensors keep reporting their PyTorch dtype in every mode: IR avals and meta-kernel
inference use torch dtypes; only ``to_jax`` (the device's storage dtype) changes, and
transfers convert between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xlatorch.runtime.base import config

# The dtype that represents each PyTorch dtype exactly (host arrays, CPU tensors).
EXACT: dict[torch.dtype, np.dtype] = {
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
JAX_TO_TORCH = {v: k for k, v in EXACT.items()}


def env_flag(*names: str) -> bool:
    """Whether any of the environment variables is set true: "true" or "false" (any case),
    else C's ``atoi(value) != 0``, as torch_xla's ``sys_util::GetEnvBool`` reads them."""
    return any(config.env(name) for name in names)


def storage_map(use_bf16: bool, downcast_bf16: bool) -> dict[torch.dtype, torch.dtype]:
    """PyTorch dtype -> the PyTorch dtype of its device storage, for the dtypes a mode
    narrows (torch_xla's ``MaybeDowncastToXlaDeviceType``: ``USE_BF16`` wins for float64)."""
    if use_bf16:
        return {torch.float32: torch.bfloat16, torch.float64: torch.bfloat16}
    if downcast_bf16:
        return {torch.float32: torch.bfloat16, torch.float64: torch.float32}
    return {}


USE_BF16 = env_flag("XLA_USE_BF16", "LTC_USE_BF16")
DOWNCAST_BF16 = env_flag("XLA_DOWNCAST_BF16", "LTC_DOWNCAST_BF16")
STORAGE = storage_map(USE_BF16, DOWNCAST_BF16)

# The JAX dtype that stores each PyTorch dtype on the device: what every lowering,
# parameter aval and upload uses. A plain dict, so the mode costs nothing per lookup.
TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {dt: EXACT[STORAGE.get(dt, dt)] for dt in EXACT}

# Python scalars enter graphs as 0-d parameters of these dtypes; ops cast them to
# their computation dtype, exactly as PyTorch casts a scalar argument.
PY_SCALAR_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}

# The JAX dtype a Python number (a weakly typed scalar) is packed as. A float is rounded
# to the device's precision where it meets a float tensor (weak typing), so it is packed
# no narrower than float32: an integer op given 301.0 must still see 301, not bf16's 300.
PY_SCALAR_JAX: dict[torch.dtype, np.dtype] = dict(TORCH_TO_JAX)
if TORCH_TO_JAX[torch.float64] == jnp.bfloat16:
    PY_SCALAR_JAX[torch.float64] = jnp.dtype(jnp.float32)


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype that stores a PyTorch dtype on the device; a clear error for unsupported ones."""
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"xlatorch: unsupported dtype {dtype} on the xla device") from None


def to_torch(dtype) -> torch.dtype:
    """The PyTorch dtype a JAX dtype represents exactly."""
    return JAX_TO_TORCH[jnp.dtype(dtype)]


def weak(v):
    """``v`` as a weakly typed JAX value: how Python numbers enter graphs (2.5 * a float32
    tensor stays float32, as in PyTorch)."""
    from jax._src.lax.lax import _convert_element_type

    return _convert_element_type(v, weak_type=True)


# weak_number's constants, made once each: made in a trace they cost a quarter of lowering a
# scalar add (``bench.long_graph``). Made concrete (not a tracer of the trace that asked) by a
# transfer, which compiles nothing (an eager convert would compile, and fill the persistent
# cache), they are immutable arrays any trace may hold. Keyed by repr: 0.0 and -0.0 stay apart,
# as do NaNs.
_WEAK_NUMBERS: dict = {}


def weak_number(value):
    """Python number ``value`` as a weakly typed constant of a graph, of the dtype a traced
    Python number of its type would have (``PY_SCALAR_DTYPE``)."""
    dtype = PY_SCALAR_JAX[PY_SCALAR_DTYPE[type(value)]]
    key = (dtype, repr(value))
    c = _WEAK_NUMBERS.get(key)
    if c is None:
        with jax.ensure_compile_time_eval():  # concrete even inside a trace
            c = jax.device_put(value)  # weakly typed, of Python's dtype (x64)
        if c.dtype != dtype or not (c.aval.weak_type or dtype == np.bool_):
            return weak(jnp.asarray(value, dtype))  # float32-packed floats: made in the trace
        if len(_WEAK_NUMBERS) < 4096:  # a program's defaults: a few dozen numbers
            _WEAK_NUMBERS[key] = c
    return c
