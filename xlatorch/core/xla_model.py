"""``xm``: the torch_xla user API (``torch_xla.core.xla_model``)."""

from __future__ import annotations

import os
import tempfile

import jax
import torch

from xlatorch.debug import metrics
from xlatorch.debug.metrics import COUNTERS
from xlatorch.runtime import rng
from xlatorch.runtime.graph import sync as _sync

__all__ = [
    "xla_device", "get_xla_supported_devices", "xla_device_hw", "mark_step", "wait_device_ops",
    "optimizer_step", "save", "is_master_ordinal", "get_ordinal", "get_local_ordinal",
    "xrt_world_size", "set_rng_state", "get_rng_state", "master_print",
]  # fmt: skip


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list[str]:
    """The local xla devices as strings (``['xla:0']`` in one process on one device)."""
    devs = [f"xla:{i}" for i in range(torch.xla.device_count())]
    return devs[:max_devices] if max_devices else devs


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """This process's xla device (``xla:0``), or local device ``n``."""
    if n is None:
        return torch.device("xla", 0)
    if not 0 <= n < torch.xla.device_count():
        raise RuntimeError(f"xla:{n} does not exist: this process has {torch.xla.device_count()} xla device(s)")
    return torch.device("xla", n)


def xla_device_hw(device) -> str:
    """The hardware behind an xla device: 'CPU', 'GPU' or 'TPU'."""
    if isinstance(device, str):
        device = torch.device(device)
    if device.type != "xla":
        raise ValueError(f"{device} is not an xla device")
    platform = jax.local_devices()[0].platform
    return {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}.get(platform, platform.upper())


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Cut the graph: compile (once per structure) and run everything pending.

    Runs asynchronously unless ``wait``. Appends metrics to ``$XLA_METRICS_FILE`` if set.
    """
    COUNTERS["MarkStep"] += 1
    _sync("mark_step")
    if wait:
        wait_device_ops()
    metrics.write_step_metrics()


def wait_device_ops(devices=None) -> None:
    """Block until every dispatched computation has finished."""
    from xlatorch.runtime.graph import wait

    wait()


def optimizer_step(optimizer, barrier: bool = False, optimizer_args: dict | None = None, groups=None,
                   pin_layout: bool = True):  # fmt: skip
    """``optimizer.step()``, after averaging gradients across replicas (one replica here).

    With ``barrier=True`` the step is also a graph cut (``mark_step``).
    """
    from xlatorch.runtime.distributed import reduce_gradients

    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def _to_cpu(data):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, data)


def is_master_ordinal(local: bool = True) -> bool:
    """True in the process with ordinal 0 (local to this host, or global)."""
    from xlatorch import runtime as xr

    return (xr.local_ordinal() if local else xr.global_ordinal()) == 0


def get_ordinal(defval: int = 0) -> int:
    from xlatorch import runtime as xr

    return xr.global_ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    from xlatorch import runtime as xr

    return xr.local_ordinal()


def xrt_world_size(defval: int = 1) -> int:
    from xlatorch import runtime as xr

    return xr.world_size()


def save(data, file_or_path, master_only: bool = True, global_master: bool = False) -> None:
    """Move every tensor in ``data`` to CPU and ``torch.save`` it from the master ordinal only.

    The write is atomic: a temporary file in the same directory, fsync, rename.
    """
    cpu = _to_cpu(data)
    if master_only and not is_master_ordinal(local=not global_master):
        return
    if not isinstance(file_or_path, (str, os.PathLike)):
        torch.save(cpu, file_or_path)
        return
    path = os.fspath(file_or_path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(cpu, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def set_rng_state(seed: int, device=None) -> None:
    """Seed the device RNG (the same seed gives the same numbers in a fresh process)."""
    rng.set_seed(seed)


def get_rng_state(device=None) -> int:
    """The device RNG's current state; ``set_rng_state`` of it replays what follows."""
    return rng.get_seed()


def master_print(*args, fd=None, **kwargs) -> None:
    """``print`` on the master ordinal only."""
    if is_master_ordinal(local=False):
        print(*args, file=fd, **kwargs)
