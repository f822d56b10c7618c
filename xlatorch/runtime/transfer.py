"""Moving data between host (PyTorch CPU tensors) and the device (``jax.Array``)."""

from __future__ import annotations

import jax
import numpy as np
import torch

from xlatorch.debug import metrics
from xlatorch.runtime.dtypes import EXACT, TORCH_TO_JAX, to_jax
from xlatorch.runtime.ir import Data, Out
from xlatorch.runtime.tensor import XlaTensor, value_of

__all__ = ["to_device", "to_cpu", "jax_device"]

_device = None


def jax_device():
    """The JAX device backing ``xla:0`` (the first local device of the default backend)."""
    global _device
    if _device is None:
        from xlatorch.runtime import distributed

        distributed.initialize()  # join the job the environment describes (a no-op alone)
        _device = jax.local_devices()[0]
    return _device


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """The host array the device stores for ``t``, in its storage dtype.

    A precision mode rounds float32/float64 here, on the host, so only the narrow data is
    transferred; with numpy (ml_dtypes): round to nearest even like PyTorch, but NaN keeps
    its sign (PyTorch's vectorised float -> bfloat16 makes every NaN negative).
    """
    t = t.detach().contiguous()
    a = t.view(torch.int16).numpy().view(EXACT[torch.bfloat16]) if t.dtype == torch.bfloat16 else t.numpy()
    want = TORCH_TO_JAX[t.dtype]
    return a if a.dtype == want else a.astype(want)


def to_device(t: torch.Tensor) -> Data:
    """Upload a CPU tensor, stored in the device's dtype for it; counted in ``TransferToDeviceTime``."""
    to_jax(t.dtype)  # a clear error for unsupported dtypes
    with metrics.timed("TransferToDeviceTime"):
        arr = jax.device_put(_to_numpy(t.cpu()), jax_device())
    return Data(arr, (tuple(t.shape), t.dtype))


def _from_array(arr, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` from device data (widened if a precision mode narrowed it)."""
    a = np.asarray(arr)
    want = EXACT[dtype]
    # Always a new host array: never alias a device buffer that may be donated later.
    a = a.astype(want) if a.dtype != want else a.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_cpu(t: XlaTensor) -> torch.Tensor:
    """Download a device tensor (a graph cut if it is pending); a view is applied on CPU."""
    vw = t._vw
    if vw is not None:
        from xlatorch.runtime.dispatch import replay_on_cpu

        cpu = _base_to_cpu(t._st)
        for step in vw:
            cpu = replay_on_cpu(step, cpu)
        return cpu.clone()
    return _base_to_cpu(t._st)


def _base_to_cpu(st) -> torch.Tensor:
    if type(st.value) is Out:
        from xlatorch.runtime.graph import sync

        sync("to_cpu")
        if type(st.value) is Out:  # a value whose earlier sync failed: raise its error
            sync_value(st.value)
    v = st.value
    with metrics.timed("TransferFromDeviceTime"):
        return _from_array(v.array, v.aval[1])


def materialized(t: XlaTensor):
    """The tensor's device data, running its graph if needed."""
    v = value_of(t)
    if type(v) is not Data:
        from xlatorch.runtime.graph import sync

        sync("materialize")
        v = value_of(t)
        if type(v) is Out:
            sync_value(v)
    return v


def sync_value(v: Out) -> None:
    """Compute one value that is not pending (only failed values are): raises their error."""
    from xlatorch.runtime.emit import emit_node

    emit_node(v.node.spec, v.node.args, v.node.info)
    raise AssertionError("unreachable: a non-pending value that is not failed")
