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

import itertools
import queue
import threading

import torch
from torch.utils._pytree import tree_map

__all__ = ["MpDeviceLoader", "ParallelLoader", "PerDeviceLoader", "PerDeviceQueue"]

_END = object()


def _world():
    """Processes shard the batches; the local devices of one process split its share."""
    from xlatorch.runtime.base import topology as distributed
    from xlatorch.runtime.multi import sharding

    if sharding.is_spmd():  # one program over every process: each feeds the same global batch
        return 1, 0
    return distributed.process_world()


def _is_sharded(loader) -> bool:
    from torch.utils.data.distributed import DistributedSampler

    return isinstance(getattr(loader, "sampler", None), DistributedSampler) or isinstance(
        getattr(getattr(loader, "batch_sampler", None), "sampler", None), DistributedSampler
    )


def _rounds(loader, per_round: int):
    """This process's batches, ``per_round`` at a time: round r holds the batches its
    replicas (``per_round`` local devices) take; whole rounds only."""
    n, rank = _world()
    if n > 1 and _is_sharded(loader):
        n, rank = 1, 0  # the sampler already gives this process its own part
    size, mine = n * per_round, rank * per_round
    it = iter(loader)
    while True:
        group = []
        for _ in range(size):
            try:
                group.append(next(it))
            except StopIteration:
                return
        yield group[mine : mine + per_round]


def _shard_len(loader, per_round: int = 1) -> int:
    n, _ = _world()
    if n > 1 and _is_sharded(loader):
        n = 1
    return len(loader) // (n * per_round)


def _to_device(batch, dev: int, input_sharding=None):
    from xlatorch.runtime.execute.transfer import to_device
    from xlatorch.runtime.trace.tensor import wrap

    if input_sharding is not None:
        return _shard(_to_device(batch, dev), input_sharding)

    def send(x):
        if isinstance(x, torch.Tensor):
            return wrap(to_device(x, dev))
        if hasattr(x, "get_tensors") and hasattr(x, "from_tensors"):  # a utils.DataWrapper
            return x.from_tensors([send(t) for t in x.get_tensors()])
        return x

    return tree_map(send, batch)


def _shard(batch, spec):
    """SPMD: annotate the uploaded ``batch`` with ``spec``, an ``xs.ShardingSpec`` (every tensor of
    its rank) or a tuple / list / dict of them (None: leave that part replicated)."""
    if spec is None:
        return batch
    if hasattr(spec, "apply"):
        return tree_map(lambda t: spec.apply(t) if isinstance(t, torch.Tensor) and spec.can_apply(t) else t, batch)
    if isinstance(spec, dict):
        return {k: _shard(v, spec.get(k)) for k, v in batch.items()}
    return type(batch)(_shard(b, s) for b, s in zip(batch, spec))


class PerDeviceQueue:
    """The queues of one device of a ``ParallelLoader``: ``queue`` holds up to
    ``device_prefetch_size`` batches already on ``device``; ``cpu_loader_queue`` (up to
    ``loader_prefetch_size``) is for CPU batches waiting for their upload, where a loader stages
    them (this one uploads each batch as it reads it); ``close_queue_count`` counts closings."""

    def __init__(self, device, loader_prefetch_size: int, device_prefetch_size: int):
        self.device = device
        self.cpu_loader_queue = queue.Queue(maxsize=max(1, loader_prefetch_size))
        self.queue = queue.Queue(maxsize=max(1, device_prefetch_size))
        self.close_queue_count = itertools.count()


class PerDeviceLoader:
    """Iterates one device's batches; calls ``mark_step`` between batches."""

    def __init__(self, parallel: ParallelLoader, slot: int):
        self._parallel = parallel
        self._slot = slot
        self._since_step = parallel._batches_per_execution  # a mark_step before the first batch

    def __iter__(self):
        return self

    def __next__(self):
        import xlatorch.core.xla_model as xm

        if self._since_step >= self._parallel._batches_per_execution:
            self._since_step = 0
            xm.mark_step()
        item = self._parallel._next(self._slot)
        if item is _END:
            xm.mark_step()
            raise StopIteration
        self._since_step += 1
        return item

    next = __next__

    def __len__(self) -> int:
        return _shard_len(self._parallel._loader, len(self._parallel._devices))

    def close(self) -> None:
        self._parallel.close()

    def __del__(self):
        self.close()


class ParallelLoader:
    """Prefetches ``loader``'s batches to ``devices`` (this process's device, or the local
    devices of ``dp.DataParallel``: batch ``i`` of each round goes to device ``i``).

    ``per_device_loader(device)`` gives the iterator for a device. The prefetch thread
    stops when the data ends, when ``close()`` is called, or when the per-device
    loader is dropped; an exception raised by the data loader is re-raised by the
    iterator.
    """

    def __init__(self, loader, devices, batchdim: int = 0, batches_per_execution: int = 1,
                 loader_prefetch_size: int = 8, device_prefetch_size: int = 4,
                 host_to_device_transfer_threads: int = 1, input_sharding=None):  # fmt: skip
        from xlatorch.runtime.base.topology import device_index

        self._devices = [torch.device(d) for d in devices]
        if not self._devices:
            raise ValueError("xlatorch: ParallelLoader needs at least one device")
        self._index = [device_index(d) if len(self._devices) == 1 else (d.index or 0) for d in self._devices]
        self._loader = loader
        self._input_sharding = input_sharding
        self._batches_per_execution = batches_per_execution
        self._queues = [PerDeviceQueue(d, loader_prefetch_size, device_prefetch_size) for d in self._devices]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._worker, name="xlatorch-prefetch", daemon=True)
        self._thread.start()

    def per_device_loader(self, device) -> PerDeviceLoader:
        device = torch.device(device)
        for slot, d in enumerate(self._devices):
            if d == device or (len(self._devices) == 1 and d.type == device.type):
                return PerDeviceLoader(self, slot)
        raise ValueError(f"xlatorch: this ParallelLoader feeds {self._devices}, not {device}")

    def per_device_samples(self) -> int:
        return _shard_len(self._loader, len(self._devices))

    def _put(self, slot: int, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queues[slot].queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _worker(self) -> None:
        n = len(self._devices)
        try:
            for group in _rounds(self._loader, n):
                for slot, batch in enumerate(group):
                    if self._stop.is_set() or not self._put(
                        slot, _to_device(batch, self._index[slot], self._input_sharding)
                    ):
                        return
        except BaseException as e:  # noqa: BLE001 (re-raised in the consuming threads)
            for slot in range(n):
                self._put(slot, e)
            return
        for slot in range(n):
            self._put(slot, _END)

    def _next(self, slot: int):
        q = self._queues[slot].queue
        while True:
            try:
                item = q.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and q.empty():
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
