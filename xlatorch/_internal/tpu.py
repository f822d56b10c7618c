"""What a TPU host looks like (torch_xla's ``_internal.tpu``), read from JAX's devices and
the TPU environment variables instead of the TPU VM's metadata server.

Off a TPU the functions that describe the chip raise ``EnvironmentError`` (torch_xla's fail
to read the metadata server there); tests guard them with ``xr.device_type() == 'TPU'``.
"""

from __future__ import annotations

import math
import os
import re

# The variables' names (torch_xla's xla_env_vars).
_ACCELERATOR_TYPE, _WORKER_ID, _TASK_ID = "ACCELERATOR_TYPE", "WORKER_ID", "CLOUD_TPU_TASK_ID"
_PROCESS_BOUNDS, _CHIPS_PER_PROCESS = "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS"
_ADDRESSES = "TPU_PROCESS_ADDRESSES"

__all__ = ["version", "get_tpu_type", "get_tpu_env", "num_available_chips", "num_logical_cores_per_chip",
           "num_available_devices", "num_expected_global_devices", "num_local_processes", "process_bounds_size",
           "task_id", "worker_id", "get_worker_ips", "num_tpu_workers"]  # fmt: skip


def _tpu_devices() -> list:
    import jax

    try:
        return jax.devices("tpu")
    except RuntimeError:
        return []


def _kind() -> str:
    devs = _tpu_devices()
    if not devs:
        raise OSError("xlatorch: this host has no TPU (JAX finds no TPU device)")
    return devs[0].device_kind  # "TPU v4", "TPU v5 lite", "TPU v6e"


def version() -> int:
    """The TPU generation (4 for v4, 5 for v5e/v5p, 6 for v6e)."""
    m = re.search(r"v(\d)", _kind())
    if m is None:
        raise OSError(f"xlatorch: cannot read the TPU generation from {_kind()!r}")
    return int(m.group(1))


def get_tpu_type() -> str:
    """ "v4", "v5e", "v5p", "v6e"... from the device kind."""
    kind = _kind().lower()
    m = re.search(r"v(\d)([a-z]?)", kind)
    gen = m.group(0) if m else kind
    if "lite" in kind and not gen.endswith("e"):
        gen += "e"
    return gen


def get_tpu_env() -> dict:
    """The TPU environment torch_xla reads from the metadata server, here from the environment."""
    names = (_ACCELERATOR_TYPE, _PROCESS_BOUNDS, _CHIPS_PER_PROCESS, _WORKER_ID)
    return {n: os.environ[n] for n in names if n in os.environ}


def num_available_chips() -> int:
    """TPU chips attached to this host (0 without a TPU)."""
    devs = _tpu_devices()
    if not devs:
        return 0
    per_chip = num_logical_cores_per_chip()
    import jax

    return len([d for d in devs if d.process_index == jax.process_index()]) // per_chip


def num_logical_cores_per_chip() -> int:
    return 2 if version() <= 3 else 1


def num_available_devices() -> int:
    return num_available_chips() * num_logical_cores_per_chip() if _tpu_devices() else 0


def num_expected_global_devices() -> int:
    return len(_tpu_devices())


def num_local_processes() -> int:
    return max(num_available_chips(), 1)


def process_bounds_size() -> int | None:
    bounds = os.environ.get(_PROCESS_BOUNDS)
    return math.prod(int(x) for x in bounds.split(",")) if bounds else None


def task_id() -> int | None:
    v = os.environ.get(_TASK_ID)
    return int(v) if v is not None else None


def worker_id() -> int:
    import jax

    v = os.environ.get(_WORKER_ID)
    return int(v) if v is not None else jax.process_index()


def get_worker_ips() -> list[str]:
    hosts = os.environ.get(_ADDRESSES)
    if hosts:
        return [h.split(":")[0] for h in hosts.split(",")]
    return ["localhost"]


def num_tpu_workers() -> int:
    import jax

    return jax.process_count()
