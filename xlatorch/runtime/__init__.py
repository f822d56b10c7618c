"""``xr``: the runtime API (``torch_xla.runtime``). The rest of this package is the
hand-written runtime: tensors, IR, dispatch, graph cutting, transfers, RNG, serialization."""

from __future__ import annotations

import jax


def device_type() -> str:
    """The platform behind the xla device: 'CPU', 'GPU' or 'TPU'."""
    p = jax.local_devices()[0].platform
    return {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}.get(p, p.upper())


def world_size() -> int:
    """Number of replicas (processes) in the job."""
    from xlatorch.runtime.distributed import world_size as ws

    return ws()


def global_ordinal() -> int:
    """This process's replica index in the job."""
    from xlatorch.runtime.distributed import global_ordinal as g

    return g()


def local_ordinal() -> int:
    """This process's replica index on this host."""
    from xlatorch.runtime.distributed import local_ordinal as lo

    return lo()


def addressable_device_count() -> int:
    return len(jax.local_devices())


__all__ = ["device_type", "world_size", "global_ordinal", "local_ordinal", "addressable_device_count"]
