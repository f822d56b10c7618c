"""Moving data between host (PyTorch CPU tensors) and the device (``jax.Array``): uploads
(``to_device``) and downloads of device data (``from_array``). Reading a tensor, which may
first need its graph run, is ``materialize.py``."""

from __future__ import annotations

import jax
import numpy as np
import torch
from torch.nn.parameter import UninitializedTensorMixin

from xlatorch.runtime.base import config, fork, record, topology
from xlatorch.runtime.base.dtypes import EXACT, TORCH_TO_JAX, to_jax
from xlatorch.runtime.base.topology import current_device, jax_device, put
from xlatorch.runtime.execute import dry, settle
from xlatorch.runtime.ir.values import UPLOAD, Data
from xlatorch.runtime.multi import sharding
from xlatorch.runtime.plan.stages import small_integral
from xlatorch.runtime.trace.modules import UNINITIALIZED
from xlatorch.runtime.trace.tensor import nested_error

__all__ = ["to_device", "upload", "from_array"]


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


def to_device(t: torch.Tensor, dev: int | None = None) -> Data:
    """Upload a CPU tensor (to local device ``dev``, default: this thread's), stored in the
    device's dtype for it; counted in ``TransferToDeviceTime``."""
    if isinstance(t, UninitializedTensorMixin):
        raise RuntimeError(UNINITIALIZED)
    to_jax(t.dtype)  # a clear error for unsupported dtypes
    if t.is_nested:
        raise nested_error("cannot make")
    if t.layout is not torch.strided:
        raise RuntimeError(
            f"xlatorch: a {t.layout} tensor cannot be moved to the xla device, which holds dense arrays only "
            f"(sparse and other layouts run on the CPU); convert it with .to_dense() first, or keep it on the CPU"
        )
    if t.dim() > 64:
        raise RuntimeError(
            f"xlatorch: only tensors with up to 64 dims are supported on the xla device (its arrays are numpy's "
            f"and XLA's); this one has {t.dim()}: merge dimensions with .reshape() first, or keep it on the CPU"
        )
    if dev is None:
        dev = current_device()
    aval = (tuple(t.shape), t.dtype)
    arr = upload(t, dev)
    # Small integer data (targets, token ids) is held on the host too: a step's checks on it
    # are decided there (plan/prechecks.py), and a stage on the host reads it without a download.
    # (A dry run keeps it too: which reads wait for the device is what it predicts.)
    keep = config.CHECKS and small_integral(aval) and not topology.SPMD[0]
    return Data(arr, aval, dev, t.detach().cpu().clone() if keep else None)


def upload(t: torch.Tensor, dev: int):
    """``t``'s device array on local device ``dev`` (``to_device``; and ``Data.array``'s first
    read of a value made on the host); counted in ``TransferToDeviceTime``."""
    if dry.ACTIVE[0]:  # xlatorch.check: the shape and dtype only
        return dry.DryArray(t.shape, TORCH_TO_JAX[t.dtype], host=t.detach().cpu())
    fork.check("a copy to the xla device")
    jdev = jax_device(dev)  # first: starting the runtime is not a transfer (and may start a capture)
    with record.TIMED("TransferToDeviceTime"):
        # jax.device_put on CPU may alias an aligned numpy array: the device value must not
        # change when the host tensor is later written in place (other platforms copy anyway).
        a = _to_numpy(t.cpu(), private=jdev.platform == "cpu")
        arr = jax.device_put(a, sharding.placement()) if topology.SPMD[0] else put(a, jdev)
    record.COUNTERS["TensorToData"] += 1
    return arr


UPLOAD[0] = upload


def from_array(arr, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` from device data (widened if a precision mode narrowed it)."""
    fork.check("a copy from the xla device")
    settle.settle()  # the data may come from a step whose on-device checks are not read yet
    a = np.asarray(arr if arr.is_fully_addressable else sharding.host_value(arr))
    want = EXACT[dtype]
    # Always a new host array: never alias a device buffer that may be donated later.
    a = a.astype(want) if a.dtype != want else a.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
