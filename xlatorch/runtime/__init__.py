"""``xr``: the runtime API (``torch_xla.runtime``). The rest of this package is the
hand-written runtime: tensors, IR, dispatch, graph cutting, transfers, RNG, serialization."""

from __future__ import annotations

from typing import TypeVar

import jax


def device_type() -> str:
    """The platform behind the xla device: 'CPU', 'GPU' or 'TPU'."""
    _join()
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
    _join()
    return len(jax.local_devices())


addressable_runtime_device_count = addressable_device_count


def global_runtime_device_count() -> int:
    """How many devices the whole job has (every process's)."""
    _join()
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


# ---------------------------------------------------------------------------------------
# torch_xla names users call (issue 29 §4): caches, device counts and attributes.
# ---------------------------------------------------------------------------------------


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Keep compiled programs in a persistent cache at ``path`` (shared by processes and
    runs; JAX's persistent compilation cache). ``readonly``: use the entries there but add
    none. Call it before the first computation.

    Raises:
      RuntimeError: something has already been compiled.
    """
    from xlatorch.runtime.lower import compile_cache

    compile_cache.use(path, readonly)


def get_num_cached_compilation_graph() -> int:
    """How many compiled graphs the in-memory cache holds now (a graph loaded from the
    persistent cache counts once loaded)."""
    from xlatorch.runtime.lower import cache

    return len(cache.CACHE)


def global_device_count() -> int:
    """How many devices the job has, over every process."""
    _join()
    return jax.device_count()


def _join() -> None:
    """Join the job before JAX's backend starts (it sees the devices of the job then)."""
    from xlatorch.runtime.base.topology import initialize

    initialize()


def local_device_count() -> int:
    """How many devices this host has (its processes' addressable devices)."""
    return local_process_count() * addressable_device_count()


def process_count() -> int:
    """How many processes the job has."""
    return jax.process_count()


def host_index() -> int:
    """This host's index in the job (0 on one host)."""
    from xlatorch.runtime.base.topology import local_world_size

    return global_ordinal() // max(1, local_world_size())


def is_bf16_supported() -> bool:
    """Whether the xla device computes in bfloat16 (every platform JAX runs on does)."""
    return True


def runtime_device_attributes(device: str) -> dict:
    """Attributes of one runtime device (``'CPU:0'``, ``'TPU:1'``): what JAX reports of it
    (``device_kind``, ``id``, ``process_index``, ``coords`` on TPU ...)."""
    index = int(str(device).rpartition(":")[2] or 0)
    d = jax.devices()[index]
    attrs = {"name": str(device), "device_kind": d.device_kind, "id": d.id, "process_index": d.process_index}
    for name in ("coords", "core_on_chip", "num_cores"):
        if hasattr(d, name):
            attrs[name] = getattr(d, name)
    return attrs


def global_runtime_device_attributes() -> list[dict]:
    """``runtime_device_attributes`` of every device of the job, in device order."""
    return [runtime_device_attributes(f"{device_type()}:{i}") for i in range(jax.device_count())]


def get_master_ip() -> str:
    """The address of the job's first host: ``$MASTER_ADDR``, or this host when alone.

    Raises:
      RuntimeError: a job of several hosts with no ``MASTER_ADDR`` set.
    """
    import os

    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    if jax.process_count() == 1:
        return "127.0.0.1"
    raise RuntimeError(f"xlatorch: IP discovery is not supported for device {device_type()}; set MASTER_ADDR")


__all__ += ["initialize_cache", "get_num_cached_compilation_graph", "global_device_count", "local_device_count",
            "process_count", "host_index", "is_bf16_supported", "runtime_device_attributes",
            "global_runtime_device_attributes", "get_master_ip"]  # fmt: skip

# torch_xla.runtime's type variables (its decorators' signatures use them).
R = TypeVar("R")
FN = TypeVar("FN")
__all__ += ["R", "FN"]
