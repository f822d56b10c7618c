"""The ``xla`` backend of ``torch.distributed`` (so ``DistributedDataParallel`` runs on xla tensors).

``import xlatorch.distributed.xla_backend`` registers the backend and the ``xla://``
init method; then, in every process of an ``xmp.spawn`` / ``xlatorch.launch`` job::

    dist.init_process_group("xla", init_method="xla://")
    model = DDP(model.to(xm.xla_device()), gradient_as_bucket_view=True)

Each collective becomes the same IR node as ``xm.all_reduce`` & co, so DDP's gradient
all-reduces join the step's one computation; the returned work is already complete
(the value is lazy, like every xla tensor). The c10d store that ``init_process_group``
needs is a ``TCPStore`` held by process 0 on the coordinator's host, port + 1.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

from xlatorch.runtime.base import topology as distributed
from xlatorch.runtime.trace import collectives

__all__ = ["ProcessGroupXla"]

_REDUCE = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "mul", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
           ReduceOp.BAND: "and", ReduceOp.BOR: "or", ReduceOp.AVG: "sum"}  # fmt: skip


# Defaults for Python callers (c10d always passes options).
_ALLREDUCEOPTIONS = AllreduceOptions()
_ALLREDUCECOALESCEDOPTIONS = AllreduceCoalescedOptions()
_BROADCASTOPTIONS = BroadcastOptions()
_ALLGATHEROPTIONS = AllgatherOptions()
_REDUCESCATTEROPTIONS = ReduceScatterOptions()
_ALLTOALLOPTIONS = AllToAllOptions()
_BARRIEROPTIONS = BarrierOptions()


def _done(result):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class ProcessGroupXla(dist.ProcessGroup):
    """A process group over every replica of the job; collectives are lazy IR nodes."""

    def __init__(self, prefix_store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        # A group of some replicas (new_group(ranks=[0])): collectives run inside the one
        # program every replica runs, so the others would have to join; refused when used.
        self._partial = size != distributed.world_size()

    def _whole(self, op: str) -> None:
        if self._partial:
            raise NotImplementedError(
                f"xlatorch: torch.distributed.{op} over a process group of {self._size} of the "
                f"{distributed.world_size()} replicas is not supported by the xla backend (every replica runs the "
                "same XLA program, so every replica takes part in each collective): use the default group, or "
                "xm's collectives with groups= that split all replicas into equal groups"
            )

    def getBackendName(self) -> str:
        return "xla"

    def _reduce_args(self, op):
        op = getattr(op, "op", op)
        if op not in _REDUCE:
            raise NotImplementedError(f"xlatorch: the xla backend does not support reduce op {op}")
        return _REDUCE[op], (1.0 / self._size if op == ReduceOp.AVG else 1.0)

    def allreduce(self, tensors, opts=_ALLREDUCEOPTIONS):
        self._whole("all_reduce")
        if isinstance(opts, ReduceOp):
            opts = AllreduceOptions(reduceOp=opts)
        kind, scale = self._reduce_args(opts.reduceOp)
        collectives.all_reduce(kind, list(tensors), scale=scale)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=_ALLREDUCECOALESCEDOPTIONS):
        self._whole("all_reduce_coalesced")
        kind, scale = self._reduce_args(opts.reduceOp)
        collectives.all_reduce(kind, list(tensors), scale=scale)
        return _done(tensors)

    def broadcast(self, tensors, opts=_BROADCASTOPTIONS):
        self._whole("broadcast")
        for t in tensors:
            t.copy_(collectives.broadcast(t, opts.rootRank))
        return _done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=_ALLGATHEROPTIONS):
        self._whole("all_gather")
        for outs, t in zip(output_tensors, input_tensors):
            gathered = collectives.all_gather(t.unsqueeze(0), dim=0)
            for i, o in enumerate(outs):
                o.copy_(gathered[i])
        return _done(output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=_ALLGATHEROPTIONS):
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output, input, opts=_ALLGATHEROPTIONS):
        self._whole("all_gather_into_tensor")
        output.copy_(collectives.all_gather(input, dim=0))
        return _done(output)

    def reduce_scatter(self, output_tensors, input_lists, opts=_REDUCESCATTEROPTIONS):
        self._whole("reduce_scatter")
        kind, scale = self._reduce_args(opts.reduceOp)
        for out, ins in zip(output_tensors, input_lists):
            full = torch.cat([t.unsqueeze(0) for t in ins])
            out.copy_(collectives.reduce_scatter(kind, full, scale, 0, self._size).squeeze(0))
        return _done(output_tensors)

    def _reduce_scatter_base(self, output, input, opts=_REDUCESCATTEROPTIONS):
        self._whole("reduce_scatter_tensor")
        kind, scale = self._reduce_args(opts.reduceOp)
        output.copy_(collectives.reduce_scatter(kind, input, scale, 0, self._size))
        return _done(output)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=_ALLTOALLOPTIONS):
        self._whole("all_to_all_single")
        if output_split_sizes or input_split_sizes:
            raise NotImplementedError("xlatorch: all_to_all with uneven splits is not supported")
        output.copy_(collectives.all_to_all(input, 0, 0, self._size))
        return _done(output)

    def barrier(self, opts=_BARRIEROPTIONS):
        self._whole("barrier")
        distributed.rendezvous("xlatorch.c10d.barrier")
        return _done(None)

    def size(self) -> int:
        return self._size


def _backend(process_group) -> ProcessGroupXla:
    """The xla backend behind a dispatcher-boxed ``ProcessGroup``."""
    pg = dist.ProcessGroup.unbox(process_group)
    return pg if isinstance(pg, ProcessGroupXla) else pg._get_backend(torch.device("xla"))


def _allgather_base(output, input, process_group, async_op=True, timeout=-1):
    work = _backend(process_group)._allgather_base(output, input)
    return output, work.boxed()


def _allgather_coalesced(output_lists, input_list, process_group, async_op=True):
    return _backend(process_group).allgather_coalesced(output_lists, input_list).boxed()


def _allgather_into_tensor_coalesced(outputs, inputs, process_group, async_op=True):
    backend = _backend(process_group)
    for o, i in zip(outputs, inputs):
        backend._allgather_base(o, i)
    return _done(outputs).boxed()


def _unsupported(name: str, why: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"xlatorch: torch.distributed.{name} is not supported by the xla backend: {why}")

    return refuse


_P2P = ("collectives run inside the step's one XLA program on every replica; point-to-point transfers have no "
        "counterpart there (use all_gather / all_to_all)")  # fmt: skip
_ROOTED = "use the all-replica form (all_gather, all_reduce, reduce_scatter) and read the root's part"


def _install_c10d_ops() -> None:
    """c10d's ops reach xla tensors' dispatch (not this backend's methods) for these calls."""
    from xlatorch.runtime.trace.dispatch import RUNTIME_OPS

    c10d = torch.ops.c10d
    RUNTIME_OPS.update({
        c10d._allgather_base_.default: _allgather_base,
        c10d.allgather_coalesced_.default: _allgather_coalesced,
        c10d.allgather_into_tensor_coalesced_.default: _allgather_into_tensor_coalesced,
        c10d.send.default: _unsupported("send", _P2P),
        c10d.recv_.default: _unsupported("recv", _P2P),
        c10d.recv_any_source_.default: _unsupported("recv", _P2P),
        c10d.gather_.default: _unsupported("gather", _ROOTED),
        c10d.scatter_.default: _unsupported("scatter", _ROOTED),
        c10d.reduce_.default: _unsupported("reduce", _ROOTED),
    })  # fmt: skip


def _create(prefix_store, rank, size, timeout):
    return ProcessGroupXla(prefix_store, rank, size, timeout)


def _xla_rendezvous(url: str, timeout: timedelta = timedelta(minutes=5), **kwargs):
    """``init_method="xla://"``: rank and world size from the job, a TCPStore held by process 0."""
    distributed.initialize()
    host, port = distributed.coordinator_address()
    rank, size = distributed.global_ordinal(), distributed.world_size()
    if distributed.SPMD[0]:  # one replica, several processes: a CPU group (gloo) has one rank per process
        size, rank = distributed.process_world()
    store = dist.TCPStore(host, port + 1, size, is_master=rank == 0, timeout=timeout)
    yield store, rank, size


if "xla" not in dist.Backend.backend_list:
    dist.Backend.register_backend("xla", _create, devices=["xla"])
    dist.register_rendezvous_handler("xla", _xla_rendezvous)
    _install_c10d_ops()
