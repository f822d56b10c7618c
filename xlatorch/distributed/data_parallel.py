"""``dp.DataParallel``: one model replica per local device, each trained in its own thread
(torch_xla's older multi-device API; processes, ``xmp.spawn``, are preferred).

``DataParallel(network, device_ids)`` builds a replica per device (the same initial
weights on each); ``model_parallel(loop_fn, loader)`` runs ``loop_fn(model, loader,
device, context)`` in one thread per device, where ``loader`` yields
``(step, batch)`` pairs of that device's shard, and returns each thread's result.
``xm.optimizer_step`` in the loop averages gradients over the replicas inside the
step's computation (one SPMD execution over the local devices). ``device_ids=[]``
runs ``loop_fn`` once on the CPU.

On CPU, several local devices come from
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set before the first device
use). PyTorch's autograd engine supports a single device of a Python backend, so
every device tensor reports ``xla:0``; each lives on its replica's device.
"""

from __future__ import annotations

import copy
import threading

import torch

__all__ = ["DataParallel", "Context"]


class Context:
    """Per-replica state for ``loop_fn`` (torch_xla's ``context`` argument)."""

    def __init__(self, device):
        self.device = device
        self._values: dict = {}

    def getattr_or(self, name, defval):
        if name not in self._values:
            self._values[name] = defval() if callable(defval) else defval
        return self._values[name]


class _Steps:
    """``(step, batch)`` pairs over a per-device loader, as the older API's loops expect."""

    def __init__(self, loader):
        self._loader = loader

    def __iter__(self):
        return enumerate(self._loader)

    def __len__(self):
        return len(self._loader)


class DataParallel:
    def __init__(self, network, device_ids=None):
        import xlatorch.core.xla_model as xm

        if device_ids is None:
            device_ids = xm.get_xla_supported_devices()
        self._devices = [torch.device(d) for d in device_ids]
        base = network() if isinstance(network, type) or not isinstance(network, torch.nn.Module) else network
        if not self._devices:
            self._models = [base]
            self._contexts = [Context(torch.device("cpu"))]
            return
        from xlatorch.runtime.base.topology import enable_multi_device

        enable_multi_device()
        self._models = [copy.deepcopy(base).to(d) for d in self._devices]
        self._contexts = [Context(d) for d in self._devices]

    @property
    def models(self) -> list:
        return self._models

    @property
    def devices(self) -> list:
        return self._devices

    def __call__(self, loop_fn, loader, fixed_batch_size: bool = False, batchdim: int = 0):
        if not self._devices:  # native CPU
            return [loop_fn(self._models[0], _Steps(loader), torch.device("cpu"), self._contexts[0])]
        from xlatorch.distributed.parallel_loader import ParallelLoader
        from xlatorch.runtime.base import topology as distributed
        from xlatorch.runtime.base.topology import set_current_device
        from xlatorch.runtime.multi import replication

        para = ParallelLoader(loader, self._devices)
        results: list = [None] * len(self._devices)
        errors: list = []
        replication.reset()
        distributed.set_thread_replicas(len(self._devices))

        def run(i):
            set_current_device(self._devices[i].index or 0)
            try:
                results[i] = loop_fn(self._models[i], _Steps(para.per_device_loader(self._devices[i])),
                                     self._devices[i], self._contexts[i])  # fmt: skip
            except BaseException as e:  # noqa: BLE001 (re-raised by the calling thread)
                errors.append((i, e))
                replication.abort(e)
            else:
                replication.leave(self._devices[i].index or 0)

        threads = [threading.Thread(target=run, args=(i,), name=f"xlatorch-replica-{i}")
                   for i in range(len(self._devices))]  # fmt: skip
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            distributed.set_thread_replicas(0)
            para.close()
        if errors:
            i, e = errors[0]
            raise RuntimeError(f"xlatorch: DataParallel replica {i} ({self._devices[i]}) failed: {e!r}") from e
        return results
