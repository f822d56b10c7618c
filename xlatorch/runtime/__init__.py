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
    from xlatorch.runtime.base.topology import world_size as ws

    return ws()


def global_ordinal() -> int:
    """This process's replica index in the job."""
    from xlatorch.runtime.base.topology import global_ordinal as g

    return g()


def local_ordinal() -> int:
    """This process's replica index on this host."""
    from xlatorch.runtime.base.topology import local_ordinal as lo

    return lo()


def addressable_device_count() -> int:
    """How many devices this process can address."""
    return len(jax.local_devices())


addressable_runtime_device_count = addressable_device_count


def global_runtime_device_count() -> int:
    """How many devices the whole job has (every process's)."""
    return jax.device_count()


def local_process_count() -> int:
    """How many processes of the job run on this host."""
    from xlatorch.runtime.base.topology import local_world_size

    return local_world_size()


def process_index() -> int:
    """This process's index in the job."""
    return global_ordinal()


def use_spmd(auto: bool = False) -> None:
    """Run SPMD: from now on ``xla:0`` is one device spanning every device of the job, and
    each step is one program that XLA's partitioner splits by the tensors' shardings
    (``xlatorch.distributed.spmd``). Call it before the device's first use. On CPU,
    ``$CPU_NUM_DEVICES`` sets this process's device count. ``auto`` (torch_xla's
    auto-sharding) is not supported.
    """
    if auto:
        raise NotImplementedError("xlatorch: use_spmd(auto=True) (automatic sharding) is not supported")
    from xlatorch.runtime.multi.sharding import use_spmd as _use

    _use()


def is_spmd() -> bool:
    """Whether ``use_spmd()`` was called."""
    from xlatorch.runtime.multi.sharding import is_spmd as _is

    return _is()


_PLATFORMS = {"CPU": "cpu", "GPU": "cuda", "CUDA": "cuda", "ROCM": "rocm", "TPU": "tpu"}


def set_device_type(pjrt_device: str, _source: str | None = None) -> None:
    """Choose the platform behind the xla device ('CPU', 'GPU', 'TPU'), before its first use.

    Raises ``RuntimeError`` once the device has been used with another platform, or when the
    platform cannot start here (``GPU`` without a CUDA GPU or JAX's CUDA plugin), and
    ``ValueError`` for a name that is not a platform.
    """
    name = pjrt_device.upper()
    if name not in _PLATFORMS:
        raise ValueError(f"xlatorch: unknown device type {pjrt_device!r} (one of {', '.join(sorted(_PLATFORMS))})")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        current = device_type()
        if {"CUDA": "GPU", "ROCM": "GPU"}.get(name, name) != current:
            raise RuntimeError(f"xlatorch: the xla device already runs on {current}; set_device_type({pjrt_device!r}) "
                               "must come before the device's first use (or set PJRT_DEVICE)")  # fmt: skip
        return
    if _PLATFORMS[name] == "cuda":
        _check_cuda(_source or f"set_device_type({pjrt_device!r})")
    jax.config.update("jax_platforms", _PLATFORMS[name])


def _check_cuda(source: str) -> None:
    """Raise a clear error now where JAX would start no CUDA backend: it skips the platform
    without a visible NVIDIA GPU, and every device op then fails a bare ``assert``."""
    try:
        from jax._src import hardware_utils, xla_bridge

        xla_bridge._discover_and_register_pjrt_plugins()  # what JAX does when its backend first starts
        plugin = "cuda" in xla_bridge._backend_factories
        gpu = hardware_utils.has_visible_nvidia_gpu()
    except Exception:  # noqa: BLE001 - another jax: it reports the platform itself
        return
    missing = [m for m, ok in (("JAX's CUDA plugin is not installed", plugin),
                               ("no NVIDIA GPU is visible to this process", gpu)) if not ok]  # fmt: skip
    if not missing:
        return
    raise RuntimeError(
        f"xlatorch: {source} asks for a CUDA device, but none is available: {' and '.join(missing)}. "
        "On a machine with an NVIDIA GPU and its driver, install xlatorch's cuda extra "
        "(pip install -e '.[cuda]' in its checkout: jax[cuda12]); otherwise set PJRT_DEVICE=CPU, or unset it"
    )


def _from_environment() -> None:
    """``PJRT_DEVICE`` (torch_xla's variable) picks the platform, as ``set_device_type``."""
    from xlatorch.runtime.base import config

    name = config.env("PJRT_DEVICE")
    if name:
        set_device_type(name, f"PJRT_DEVICE={name}")


__all__ = ["device_type", "set_device_type", "world_size", "global_ordinal", "local_ordinal", "process_index",
           "local_process_count", "addressable_device_count", "addressable_runtime_device_count",
           "global_runtime_device_count", "use_spmd", "is_spmd"]  # fmt: skip
