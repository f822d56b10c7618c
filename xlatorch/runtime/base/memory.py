"""Device memory: how much of a device the program's buffers use (``xm.get_memory_info``)."""

from __future__ import annotations

import os

import jax
import torch

from xlatorch.runtime.base.topology import jax_device, local_device_count

__all__ = ["get_memory_info", "available_bytes"]

_peaks: dict[int, int] = {}  # local device -> largest bytes_used reported (CPU only)


def _index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    dev = torch.device(device) if isinstance(device, str) else device
    if not isinstance(dev, torch.device) or dev.type != "xla":
        raise ValueError(f"xlatorch: get_memory_info needs an xla device (e.g. 'xla:0'), got {device!r}")
    return dev.index or 0


def _live_bytes(jdev) -> int:
    """Bytes of every live JAX buffer on ``jdev``: device data of tensors, pending outputs."""
    total = 0
    for a in jax.live_arrays():
        devs = a.sharding.device_set
        if jdev not in devs:
            continue
        if len(devs) == 1:
            total += a.nbytes
        else:  # a global array of a replicated step: only this device's block
            total += sum(s.data.nbytes for s in a.addressable_shards if s.device == jdev)
    return total


def available_bytes(jdev) -> int | None:
    """Bytes a new allocation on ``jdev`` can still take: the runtime's limit minus its use
    (GPU, TPU), or on CPU the host's available memory (``MemAvailable``); None if unknown."""
    stats = jdev.memory_stats()
    if stats and "bytes_in_use" in stats:
        limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
        return None if not limit else limit - stats["bytes_in_use"]
    return host_available_bytes()


# A container's memory limit and use (cgroup v2, then v1): the host's figures ignore it.
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _cgroup() -> tuple[int, int] | None:
    """(limit, use) of this process's memory cgroup, or None where it sets no limit."""
    for limit_file, use_file in CGROUP_FILES:
        try:
            with open(limit_file) as f:
                text = f.read().strip()
            if not text.isdigit() or int(text) >= 1 << 60:  # "max", or v1's "no limit"
                return None
            with open(use_file) as f:
                return int(text), int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def host_memory() -> tuple[int | None, int]:
    """(available bytes or None if unknown, total bytes) of the host, within this process's
    container limit where one is set (``MemAvailable`` and physical memory otherwise)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    cg = _cgroup()
    if cg is not None:
        limit, used = cg
        total = min(total, limit)
        free = max(limit - used, 0) if free is None else min(free, max(limit - used, 0))
    return free, total


def host_available_bytes() -> int | None:
    """The host's available memory (within a container's limit), or None if unknown."""
    return host_memory()[0]


def get_memory_info(device=None) -> dict[str, int]:
    """Memory use of an xla device, in torch_xla's keys (new and old).

    ``bytes_used``, ``bytes_limit``, ``peak_bytes_used``, plus ``kb_total`` and ``kb_free``.
    Where the runtime reports memory (GPU, TPU) these are its figures. On CPU, which does
    not, ``bytes_used`` sums the live device buffers (tensors' data and results not yet
    read), ``bytes_limit`` is the host's physical memory, and ``peak_bytes_used`` is the
    largest ``bytes_used`` this function has returned (no per-step tracking: buffers are
    not counted while steps run). Does not sync: pending tensors have no buffers yet.

    Args:
      device: an xla device (``torch.device('xla', 0)``, ``'xla:0'``, or its index);
        default ``xla:0``.

    Raises:
      ValueError: for a device that is not an xla device.
    """
    index = _index(device)
    if not 0 <= index < local_device_count():
        raise ValueError(f"xlatorch: xla:{index} does not exist ({local_device_count()} local xla device(s))")
    jdev = jax_device(index)
    stats = jdev.memory_stats()
    if stats and "bytes_in_use" in stats:
        used = stats["bytes_in_use"]
        limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit") or 0
        peak = stats.get("peak_bytes_in_use", used)
    else:
        used = _live_bytes(jdev)
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        peak = _peaks[index] = max(_peaks.get(index, 0), used)
    return {
        "bytes_used": used,
        "bytes_limit": limit,
        "peak_bytes_used": peak,
        "kb_total": limit // 1024,
        "kb_free": max(limit - used, 0) // 1024,
    }
