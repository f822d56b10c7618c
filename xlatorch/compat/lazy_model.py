"""``lazy_tensor_core.core.lazy_model`` (``ltm``): lazy_tensor_core's names for ``xm``'s functions.

The functions are ``xm``'s own (``xlatorch.core.xla_model``), re-exported; only the three
``lazy_*`` names differ. ``ltm.lazy_device()`` is the ``xla`` device: tensors on it report
``device='xla:0'``, not lazy_tensor_core's ``lazy:0``. PyTorch's built-in ``lazy`` device
type belongs to its own TorchScript lazy backend (``torch._lazy``), whose kernels would
run a tensor that claimed it, and there is one PrivateUse1 name per process (``xla``).
"""

from __future__ import annotations

import torch

from xlatorch.core.xla_model import (
    add_step_closure,
    all_gather,
    all_reduce,
    all_to_all,
    get_local_ordinal,
    get_memory_info,
    get_ordinal,
    get_rng_state,
    get_xla_supported_devices,
    is_master_ordinal,
    mark_step,
    master_print,
    mesh_reduce,
    optimizer_step,
    rendezvous,
    save,
    set_rng_state,
    wait_device_ops,
    xla_device,
    xla_device_hw,
    xrt_world_size,
)

__all__ = [
    "lazy_device", "get_lazy_supported_devices", "lazy_device_hw", "mark_step", "optimizer_step", "save",
    "wait_device_ops", "add_step_closure", "get_ordinal", "get_local_ordinal", "is_master_ordinal",
    "xrt_world_size", "master_print", "all_reduce", "all_gather", "all_to_all", "rendezvous", "mesh_reduce",
    "set_rng_state", "get_rng_state", "get_memory_info",
]  # fmt: skip


def lazy_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """This process's lazy device: the ``xla`` device (``xla:0``), or local device ``n``
    (``xm.xla_device``)."""
    return xla_device(n, devkind)


def get_lazy_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list[str]:
    """The local devices as strings, ``['xla:0']`` with one (``xm.get_xla_supported_devices``)."""
    return get_xla_supported_devices(devkind, max_devices)


def lazy_device_hw(device) -> str:
    """The hardware behind a device: 'CPU', 'GPU' or 'TPU' (``xm.xla_device_hw``)."""
    return xla_device_hw(device)
