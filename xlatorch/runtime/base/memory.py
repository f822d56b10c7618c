"""Device memory: how much of a device the program's buffers use (``xm.get_memory_info``)."""

from __future__ import annotations

import os

import jax
import torch

from xlatorch.runtime.base.topology import jax_device, local_device_count

__all__ = ["get_memory_info", "reset_peak_memory_stats", "available_bytes", "executing", "LIVE"]

# Bytes of the device data leaves alive, per local device (``ir/values.Data`` adds its bytes
# when made and takes them off when collected): what is on the device before a graph runs.
LIVE: dict[int, int] = {}
# Per local device: the largest ``LIVE`` + new buffers of a graph seen at an execution, and
# bytes_used reported, since the start or the last ``reset_peak_memory_stats``.
_peaks: dict[int, int] = {}
_base: dict[int, int] = {}  # GPU/TPU: the runtime's peak_bytes_in_use at the last reset


def executing(dev: int, new: int) -> None:
    """A graph allocating ``new`` bytes is about to run on local device ``dev``: count its
    peak (what is on the device now plus its new buffers). A few integer operations."""
    b = LIVE.get(dev, 0) + new
    if b > _peaks.get(dev, 0):
        _peaks[dev] = b


def _index(device, fn: str) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    dev = torch.device(device) if isinstance(device, str) else device
    if not isinstance(dev, torch.device) or dev.type != "xla":
        raise ValueError(f"xlatorch: {fn} needs an xla device (e.g. 'xla:0'), got {device!r}")
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
    Where the runtime reports memory (GPU, TPU) these are its figures, and
    ``peak_bytes_used`` is the runtime's peak since ``reset_peak_memory_stats`` (until
    the runtime's peak passes its value at the reset: the largest of the use seen since and
    the estimate below). On CPU, which reports nothing, ``bytes_used`` sums the live device
    buffers (tensors' data and results not yet read), ``bytes_limit`` is the host's physical
    memory, and ``peak_bytes_used`` is the largest, since the start or the last reset, of
    ``bytes_used`` as returned here and, at each graph execution, the tensors' device data
    alive before it (``LIVE``) plus the graph's new buffers (outputs not aliased to donated inputs, and
    temporaries: XLA's memory analysis). Does not sync: pending tensors have no buffers yet.

    Args:
      device: an xla device (``torch.device('xla', 0)``, ``'xla:0'``, or its index);
        default ``xla:0``.

    Raises:
      ValueError: for a device that is not an xla device.
    """
    index = _checked_index(device, "get_memory_info")
    jdev = jax_device(index)
    stats = jdev.memory_stats()
    if stats and "bytes_in_use" in stats:
        used = stats["bytes_in_use"]
        limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit") or 0
        peak = stats.get("peak_bytes_in_use", used)
        if index in _base and peak <= _base[index]:  # no new peak since the reset
            peak = _peaks[index] = max(_peaks.get(index, 0), used)
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


def reset_peak_memory_stats(device=None) -> None:
    """Start ``get_memory_info``'s ``peak_bytes_used`` again from the device's current use
    (torch.cuda's name; torch_xla has none). Does not sync.

    Args:
      device: an xla device (``torch.device('xla', 0)``, ``'xla:0'``, or its index);
        default ``xla:0``.

    Raises:
      ValueError: for a device that is not an xla device.
    """
    index = _checked_index(device, "reset_peak_memory_stats")
    jdev = jax_device(index)
    stats = jdev.memory_stats()
    if stats and "bytes_in_use" in stats:
        _base[index] = stats.get("peak_bytes_in_use", stats["bytes_in_use"])
        _peaks[index] = stats["bytes_in_use"]
    else:
        _peaks[index] = _live_bytes(jdev)


def _checked_index(device, fn: str) -> int:
    index = _index(device, fn)
    if not 0 <= index < local_device_count():
        raise ValueError(f"xlatorch: xla:{index} does not exist ({local_device_count()} local xla device(s))")
    return index
