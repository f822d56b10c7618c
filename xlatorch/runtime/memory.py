"""Device memory: how much of a device the program's buffers use (``xm.get_memory_info``)."""

from __future__ import annotations

import os

import jax
import torch

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


def host_available_bytes() -> int | None:
    """The host's available memory (Linux's ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    from xlatorch.runtime.transfer import jax_device, local_device_count

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
