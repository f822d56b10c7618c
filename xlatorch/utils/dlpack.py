"""``torch_xla.utils.dlpack``: device data shared with JAX and other DLPack libraries, without a copy.

``to_jax`` / ``from_jax`` hand a materialized xla tensor's device buffer to JAX and back;
``to_dlpack`` / ``from_dlpack`` do the same through DLPack (``torch.from_dlpack`` of the
capsule gives a CPU tensor sharing it, on the CPU platform). A buffer handed out is never
donated to a later step (donation would free it under its new owner): an in-place update
of the tensor then writes a new buffer, and what was handed out keeps the old values.
"""

from __future__ import annotations

from typing import Any

import jax
import torch

from xlatorch.runtime.base.dtypes import to_torch
from xlatorch.runtime.execute.materialize import materialized
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.trace.tensor import XlaTensor, wrap

__all__ = ["to_dlpack", "from_dlpack", "to_jax", "from_jax"]


def to_jax(t: torch.Tensor) -> jax.Array:
    """The xla tensor's device data as a ``jax.Array`` (its graph runs first if it is pending).

    No copy (a view is copied out first). Under a storage precision mode (``XLA_USE_BF16``)
    the array has the stored dtype."""
    if type(t) is not XlaTensor:
        raise TypeError(f"xlatorch: to_jax takes an xla tensor, got one on '{t.device}'")
    data = materialized(t)
    data.holders += 1  # shared from now on: never donated (see the module docstring)
    return data.array


def from_jax(array: jax.Array) -> torch.Tensor:
    """An xla tensor holding ``array`` (a single-device ``jax.Array`` on this process's
    device), without a copy."""
    if not isinstance(array, jax.Array):
        array = jax.numpy.asarray(array)
    devices = array.devices()
    if len(devices) != 1:
        raise ValueError(f"xlatorch: from_jax takes an array on one device, this one spans {len(devices)}")
    data = Data(array, (tuple(array.shape), to_torch(array.dtype)))
    data.holders += 1  # the caller keeps the array: never donated
    return wrap(data)


def to_dlpack(xla_tensor: Any):
    """A DLPack capsule of the xla tensor's device buffer (no copy)."""
    return to_jax(xla_tensor).__dlpack__()


def from_dlpack(ext_tensor: Any) -> torch.Tensor:
    """An xla tensor sharing the buffer of a DLPack object (anything with ``__dlpack__``: a CPU
    tensor, a numpy array, a JAX array) where the platform allows, else a copy."""
    return from_jax(jax.dlpack.from_dlpack(ext_tensor))
