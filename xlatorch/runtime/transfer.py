"""Moving data between host (PyTorch CPU tensors) and the device (``jax.Array``)."""

from __future__ import annotations

import jax
import numpy as np
import torch

from xlatorch.runtime import checks, record, sharding
from xlatorch.runtime.dtypes import EXACT, TORCH_TO_JAX, to_jax
from xlatorch.runtime.ir import Data, Out, current_device, enable_multi_device
from xlatorch.runtime.tensor import XlaTensor, value_of

__all__ = ["to_device", "to_cpu", "jax_device"]

_devices: list = []


def jax_device(dev: int = 0):
    """The JAX device backing local device ``dev`` (``xla:0`` is the first local device)."""
    if not _devices:
        from xlatorch.runtime import distributed

        distributed.initialize()  # join the job the environment describes (a no-op alone)
        # Under SPMD, xla:0 is one device spanning them all (runtime/sharding.py).
        _devices.extend(jax.local_devices()[:1] if sharding.ENABLED[0] else jax.local_devices())
        if len(_devices) > 1:  # several local devices: nodes track which one they live on
            enable_multi_device()
        for hook in record.DEVICE_HOOKS:  # xlatorch.debug.profiler: a capture scheduled before now may start
            hook()
    return _devices[dev]


def local_device_count() -> int:
    jax_device()
    return len(_devices)


def _to_numpy(t: torch.Tensor, private: bool = False) -> np.ndarray:
    """The host array the device stores for ``t``, in its storage dtype (``private``: never
    sharing ``t``'s memory).

    A precision mode rounds float32/float64 here, on the host, so only the narrow data is
    transferred; with numpy (ml_dtypes): round to nearest even like PyTorch, but NaN keeps
    its sign (PyTorch's vectorised float -> bfloat16 makes every NaN negative).
    """
    t = t.detach().contiguous()
    a = t.view(torch.int16).numpy().view(EXACT[torch.bfloat16]) if t.dtype == torch.bfloat16 else t.numpy()
    want = TORCH_TO_JAX[t.dtype]
    if a.dtype != want:
        return a.astype(want)
    return a.copy() if private else a


_SINGLE: dict = {}  # jax device -> (its SingleDeviceSharding, [device])


def _put(a: np.ndarray, jdev):
    """``jax.device_put(a, jdev)`` without its Python wrapping (pytree flattening, dtype and
    sharding checks: ~25 us of ~30 for a small array on CPU), through the call it ends in;
    ``jax.device_put`` itself where that internal call is missing or refuses."""
    one = _SINGLE.get(jdev)
    if one is None:
        from jax.sharding import SingleDeviceSharding

        one = _SINGLE[jdev] = (SingleDeviceSharding(jdev), [jdev])
    if _FAST is not None and a.dtype in _FAST_DTYPES:
        try:
            return _FAST(_ShapedArray(a.shape, a.dtype), one[0], [a], one[1])
        except Exception:
            pass
    return jax.device_put(a, jdev)


try:
    from jax._src.core import ShapedArray as _ShapedArray
    from jax._src.interpreters.pxla import batched_device_put as _FAST
except ImportError:  # another jax: the public call
    _FAST = _ShapedArray = None
# Dtypes the device stores as they are (device_put would canonicalise others).
_FAST_DTYPES = frozenset(np.dtype(d) for d in TORCH_TO_JAX.values())


def to_device(t: torch.Tensor, dev: int | None = None) -> Data:
    """Upload a CPU tensor (to local device ``dev``, default: this thread's), stored in the
    device's dtype for it; counted in ``TransferToDeviceTime``."""
    to_jax(t.dtype)  # a clear error for unsupported dtypes
    if dev is None:
        dev = current_device()
    jdev = jax_device(dev)  # first: starting the runtime is not a transfer (and may start a capture)
    with record.TIMED("TransferToDeviceTime"):
        # jax.device_put on CPU may alias an aligned numpy array: the device value must not
        # change when the host tensor is later written in place (other platforms copy anyway).
        a = _to_numpy(t.cpu(), private=jdev.platform == "cpu")
        arr = jax.device_put(a, sharding.placement()) if sharding.ENABLED[0] else _put(a, jdev)
    record.COUNTERS["TensorToData"] += 1
    return Data(arr, (tuple(t.shape), t.dtype), dev)


def to_other_device(t: XlaTensor, dev: int) -> Data:
    """``t``'s value as device data on local device ``dev`` (a sync if pending, then one copy)."""
    v = materialized(t)
    return Data(jax.device_put(v.array, jax_device(dev)), v.aval, dev)


def _from_array(arr, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` from device data (widened if a precision mode narrowed it)."""
    checks.settle()  # the data may come from a step whose on-device checks are not read yet
    a = np.asarray(arr if arr.is_fully_addressable else sharding.host_value(arr))
    want = EXACT[dtype]
    # Always a new host array: never alias a device buffer that may be donated later.
    a = a.astype(want) if a.dtype != want else a.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_cpu(t: XlaTensor, reason: str = "to_cpu") -> torch.Tensor:
    """Download a device tensor (a graph cut if it is pending, reported as ``reason``); a view
    is applied on CPU."""
    cpu = _base_to_cpu(t._st, reason)
    vw = t._vw  # read after the sync: it may have made a lone view a plain tensor
    if vw is not None:
        from xlatorch.runtime.dispatch import replay_on_cpu

        for step in vw:
            cpu = replay_on_cpu(step, cpu)
        return cpu.clone()
    return cpu


def _base_to_cpu(st, reason: str = "to_cpu") -> torch.Tensor:
    checks.settle()  # first: an undone step gives the storage its data from before it
    if type(st.value) is Out:
        from xlatorch.runtime.graph import sync

        sync(reason, st.dev)
        if type(st.value) is Out:  # a value whose earlier sync failed: raise its error
            sync_value(st.value)
    v = st.value
    with record.TIMED("TransferFromDeviceTime"):
        return _from_array(v.array, v.aval[1])


def materialized(t: XlaTensor):
    """The tensor's device data, running its graph if needed (a view: a copy of its elements)."""
    checks.settle()
    if t._vw is not None:  # a view's value is derived from its base on every read: copy it out
        t = torch.ops.aten.clone.default(t)
    v = value_of(t)
    if type(v) is not Data:
        from xlatorch.runtime.graph import sync

        sync("materialize", t._st.dev)
        v = value_of(t)
        if type(v) is Out:
            sync_value(v)
    return v


def sync_value(v: Out) -> None:
    """Compute one value that is not pending (only failed values are): raises their error."""
    from xlatorch.runtime.emit import emit_node

    emit_node(v.node.spec, v.node.args, v.node.info)
    raise AssertionError("unreachable: a non-pending value that is not failed")
