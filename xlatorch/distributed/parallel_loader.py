"""``pl``: data loaders that prefetch batches to the device (torch_xla's ``parallel_loader``).

A background thread pulls batches from the CPU ``DataLoader`` and uploads them, so
the upload of batch i+1 overlaps step i. Iterating calls ``mark_step`` before each
batch (every ``batches_per_execution`` batches) and once at the end, so a plain loop
over the loader is one graph per step.

In a job with several replicas, each replica takes a distinct shard of the batches:
batch ``i`` goes to replica ``i % world_size``, and every replica gets the same
number of batches (a final incomplete round is dropped, so no replica waits in a
collective for a step the others never run). A loader whose sampler is a
``DistributedSampler`` is already sharded and is used as is. Shuffling loaders
should be seeded alike in every replica (``torch.manual_seed``) for the shards to be
disjoint.
"""

from __future__ import annotations

import queue
import threading

import torch
from torch.utils._pytree import tree_map

__all__ = ["MpDeviceLoader", "ParallelLoader", "PerDeviceLoader"]

_END = object()


def _world():
    from xlatorch.runtime import distributed

    return distributed.world_size(), distributed.global_ordinal()


def _is_sharded(loader) -> bool:
    from torch.utils.data.distributed import DistributedSampler

    return isinstance(getattr(loader, "sampler", None), DistributedSampler) or isinstance(
        getattr(getattr(loader, "batch_sampler", None), "sampler", None), DistributedSampler
    )


def _shard(loader):
    """This replica's batches: every ``world_size``-th, in whole rounds only."""
    n, rank = _world()
    if n == 1 or _is_sharded(loader):
        yield from loader
        return
    it = iter(loader)
    while True:
        mine = None
        for i in range(n):
            try:
                b = next(it)
            except StopIteration:
                return
            if i == rank:
                mine = b
        yield mine


def _shard_len(loader) -> int:
    n, _ = _world()
    return len(loader) if n == 1 or _is_sharded(loader) else len(loader) // n


def _to_device(batch, device):
    from xlatorch.runtime.tensor import wrap
    from xlatorch.runtime.transfer import to_device

    return tree_map(lambda t: wrap(to_device(t)) if isinstance(t, torch.Tensor) else t, batch)


class PerDeviceLoader:
    """Iterates one device's batches; calls ``mark_step`` between batches."""

    def __init__(self, parallel: ParallelLoader, device):
        self._parallel = parallel
        self._device = device
        self._since_step = parallel._batches_per_execution  # a mark_step before the first batch

    def __iter__(self):
        return self

    def __next__(self):
        import xlatorch.core.xla_model as xm

        if self._since_step >= self._parallel._batches_per_execution:
            self._since_step = 0
            xm.mark_step()
        item = self._parallel._next()
        if item is _END:
            xm.mark_step()
            raise StopIteration
        self._since_step += 1
        return item

    next = __next__

    def __len__(self) -> int:
        return _shard_len(self._parallel._loader)

    def close(self) -> None:
        self._parallel.close()

    def __del__(self):
        self.close()


class ParallelLoader:
    """Prefetches ``loader``'s batches to ``devices`` (one device per process here).

    ``per_device_loader(device)`` gives the iterator for a device. The prefetch thread
    stops when the data ends, when ``close()`` is called, or when the per-device
    loader is dropped; an exception raised by the data loader is re-raised by the
    iterator.
    """

    def __init__(self, loader, devices, batchdim: int = 0, batches_per_execution: int = 1,
                 loader_prefetch_size: int = 8, device_prefetch_size: int = 4,
                 host_to_device_transfer_threads: int = 1, input_sharding=None):  # fmt: skip
        devices = [torch.device(d) for d in devices]
        if len(devices) != 1:
            raise ValueError(f"xlatorch: ParallelLoader drives this process's one device, got {devices}")
        self._loader = loader
        self._device = devices[0]
        self._batches_per_execution = batches_per_execution
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, device_prefetch_size))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._worker, name="xlatorch-prefetch", daemon=True)
        self._thread.start()

    def per_device_loader(self, device) -> PerDeviceLoader:
        if torch.device(device) != self._device:
            raise ValueError(f"xlatorch: this ParallelLoader feeds {self._device}, not {device}")
        return PerDeviceLoader(self, self._device)

    def per_device_samples(self) -> int:
        return _shard_len(self._loader)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _worker(self) -> None:
        try:
            for batch in _shard(self._loader):
                if self._stop.is_set() or not self._put(_to_device(batch, self._device)):
                    return
        except BaseException as e:  # noqa: BLE001 (re-raised in the consuming thread)
            self._put(e)
            return
        self._put(_END)

    def _next(self):
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return _END
        if isinstance(item, BaseException):
            self.close()
            raise RuntimeError(f"xlatorch: the data loader raised in the prefetch thread: {item!r}") from item
        return item

    def close(self) -> None:
        """Stop the prefetch thread (waits for it; batches in flight are dropped)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


class MpDeviceLoader:
    """``for batch in MpDeviceLoader(loader, device)``: a ``ParallelLoader`` per iteration."""

    def __init__(self, loader, device, **kwargs):
        self._loader = loader
        self._device = device
        self._kwargs = kwargs

    def __iter__(self):
        return ParallelLoader(self._loader, [self._device], **self._kwargs).per_device_loader(self._device)

    def __len__(self) -> int:
        return _shard_len(self._loader)
