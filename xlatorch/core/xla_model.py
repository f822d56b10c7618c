"""``xm``: the torch_xla user API (``torch_xla.core.xla_model``)."""

from __future__ import annotations

import contextlib
import os
import threading

import jax
import torch

from xlatorch.core import step_closures
from xlatorch.core.tensor_batches import CoalescingBuckets, ToXlaTensorArena
from xlatorch.runtime.base import record
from xlatorch.runtime.base.memory import get_memory_info, reset_peak_memory_stats
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.topology import rendezvous
from xlatorch.runtime.execute.sync import sync as _sync
from xlatorch.runtime.ir import rng
from xlatorch.runtime.trace.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    collective_permute,
    recv,
    reduce_gradients,
    reduce_scatter,
    send,
)
from xlatorch.runtime.trace.library import XlaLibrary

__all__ = [
    "fork_rng",
    "xla_device", "get_xla_supported_devices", "xla_device_hw", "set_replication", "mark_step",
    "wait_device_ops", "optimizer_step", "save", "send_cpu_data_to_device", "is_master_ordinal", "get_ordinal",
    "get_local_ordinal",
    "xrt_world_size", "set_rng_state", "get_rng_state", "master_print", "add_step_closure", "is_xla_tensor",
    "reduce_scatter_bucketized", "broadcast_master_param",
    "get_memory_info", "reset_peak_memory_stats",
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce_gradients", "rendezvous", "mesh_reduce",
    "REDUCE_SUM", "REDUCE_MUL", "REDUCE_AND", "REDUCE_OR", "REDUCE_MIN", "REDUCE_MAX",
    "send", "recv", "collective_permute", "ToXlaTensorArena", "CoalescingBuckets", "XLA_LIB", "DeviceContext",
]  # fmt: skip

REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX = "sum", "mul", "and", "or", "min", "max"

# The ``xla`` op namespace (``torch.ops.xla``), for custom ops: ``XLA_LIB.define(schema)``, then
# ``torch.library.impl(XLA_LIB, name, "XLA")`` gives the op's kernel for xla tensors.
XLA_LIB = XlaLibrary("xla", "DEF")


class DeviceContext:
    """Per-device state that lives as long as the process (one object per device name)."""

    def __init__(self, device):
        self.device = device


_DEVICE_CONTEXTS: dict = {}
_DEVICE_CONTEXTS_LOCK = threading.Lock()


def _get_device_context(device=None) -> DeviceContext:
    """The ``DeviceContext`` of ``device`` (default: this thread's device), made on first use."""
    from xlatorch.runtime.base.topology import current_device

    device = str(device) if device is not None else f"xla:{current_device()}"
    with _DEVICE_CONTEXTS_LOCK:
        ctx = _DEVICE_CONTEXTS.get(device)
        if ctx is None:
            ctx = _DEVICE_CONTEXTS[device] = DeviceContext(device)
        return ctx


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list[str]:
    """The local xla devices as strings (``['xla:0']`` in one process on one device)."""
    devs = [f"xla:{i}" for i in range(torch.xla.device_count())]
    return devs[:max_devices] if max_devices else devs


class NoSuchDevice(IndexError, RuntimeError):
    """A device index past this process's devices: an IndexError, as torch_xla raises it
    (``torch_xla.device(10)``), and a RuntimeError, as PyTorch raises an invalid ordinal."""


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """This process's xla device (``xla:0``), or local device ``n``."""
    if n is None:
        return torch.device("xla", 0)
    if not 0 <= n < torch.xla.device_count():
        raise NoSuchDevice(f"xla:{n} does not exist: this process has {torch.xla.device_count()} xla device(s)")
    return torch.device("xla", n)


def xla_device_hw(device) -> str:
    """The hardware behind an xla device: 'CPU', 'GPU' or 'TPU'."""
    if isinstance(device, str):
        device = torch.device(device)
    if device.type != "xla":
        raise ValueError(f"{device} is not an xla device")
    platform = jax.local_devices()[0].platform
    return {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}.get(platform, platform.upper())


def set_replication(device, devices) -> None:
    """Make ``device`` this thread's device, as one of the replicas ``devices`` (a list of xla
    devices, or empty / None for none). Accelerate and ``dp.DataParallel``-style drivers call it
    once per thread before the first step; it transfers and compiles nothing.

    Raises:
        ValueError: ``device`` is not an xla device, or not one of ``devices``.
    """
    from xlatorch.runtime.base.topology import device_index, set_current_device

    device = torch.device(device)
    if device.type != "xla":
        raise ValueError(f"set_replication: {device} is not an xla device")
    names = [str(torch.device(d)) for d in devices or ()]
    if names and str(device) not in names:
        raise ValueError(f"set_replication: {device} is not one of the replication devices {names}")
    set_current_device(device_index(device) if device.index else 0)  # device_index: the range check


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Cut the graph: compile (once per structure) and run everything pending.

    Runs asynchronously unless ``wait``. Appends metrics to ``$XLA_METRICS_FILE`` if set.
    """
    for hook in record.PRE_STEP_HOOKS:  # xlatorch.debug.compare (XLATORCH_COMPARE=1)
        hook()
    phase = record.PHASE
    if phase is not None:  # profiling: an xlatorch.mark_step span
        with phase("xlatorch.mark_step"):
            _mark_step(wait)
    else:
        _mark_step(wait)
    for hook in record.STEP_HOOKS:  # xlatorch.debug: the step's graph-cut table, XLA_METRICS_FILE, profiles
        hook()


def _mark_step(wait: bool) -> None:
    COUNTERS["MarkStep"] += 1
    from xlatorch.runtime.base.topology import current_device, thread_replicas

    # Under dp.DataParallel each thread steps its own device.
    _sync("mark_step", current_device() if thread_replicas() else None)
    if wait:
        wait_device_ops()
    step_closures.run()


add_step_closure = step_closures.add


def is_xla_tensor(tensor) -> bool:
    """Whether ``tensor`` is a tensor on the xla device."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xla"


def reduce_scatter_bucketized(reduce_type: str, input_list, scale: float, scatter_dim: int, shard_count: int,
                              groups=None, output=None, pin_layout: bool = False,
                              bucket_cap_mb: int = 160) -> list:  # fmt: skip
    """``reduce_scatter`` of each tensor of ``input_list``, coalesced into buckets of about
    ``bucket_cap_mb`` MB (``CoalescingBuckets``); returns the outputs in input order (written
    into ``output``'s tensors if given)."""

    def coalesced(inputs, outputs=None):
        return reduce_scatter(reduce_type, inputs, scale, scatter_dim, shard_count, groups=groups, output=outputs,
                              pin_layout=pin_layout)  # fmt: skip

    res = CoalescingBuckets(coalesced, list(input_list), output, bucket_cap_mb=bucket_cap_mb)()
    return output if output is not None else res  # the same tensors; the caller's list itself


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Overwrite every parameter of ``model`` on every replica with the master ordinal's."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(broadcast(p, 0))


def wait_device_ops(devices=None) -> None:
    """Block until every dispatched computation has finished."""
    from xlatorch.runtime.execute.sync import wait

    wait()


def _fetch_gradients(optimizer) -> list[torch.Tensor]:
    """The gradients of ``optimizer``'s parameters that have one, in parameter-group order (what
    ``reduce_gradients`` reduces; Accelerate's gradient clipping reads them)."""
    return [p.grad.data for group in optimizer.param_groups for p in group["params"]
            if isinstance(p, torch.Tensor) and p.grad is not None]  # fmt: skip


def optimizer_step(optimizer, barrier: bool = False, optimizer_args: dict | None = None, groups=None,
                   pin_layout: bool = True):  # fmt: skip
    """``optimizer.step()``, after averaging gradients across replicas (one replica here).

    With ``barrier=True`` the step is also a graph cut (``mark_step``).
    """
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


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
    """``torch.save`` of ``data`` with every device tensor moved to CPU, from the master only.

    Tensors are found wherever ``torch.save`` finds them (dicts, state dicts, lists,
    tuples, namedtuples, objects). Each storage is downloaded once and device tensors
    that alias (views, ``detach``, tied weights) are saved as CPU tensors that alias, as
    eager PyTorch saves them; the file loads anywhere, without xlatorch. Every process
    syncs what is pending (one graph cut, the same on every replica); only the master
    ordinal (local, or global with ``global_master``) writes unless ``master_only`` is
    False. To a path the write is atomic (temporary file beside it, fsync, rename, fsync
    of the directory): a crash leaves the previous file intact, never a partial one.
    """
    from xlatorch.runtime.execute.serialization import atomic_write, cpu_pickle_module
    from xlatorch.runtime.multi.sharding import gathered

    _sync("save")
    with gathered(data):  # SPMD over several processes: shards split across them, gathered by all
        if master_only and not is_master_ordinal(local=not global_master):
            return
        pickle_module = cpu_pickle_module()
        if isinstance(file_or_path, (str, os.PathLike)):
            atomic_write(file_or_path, lambda f: torch.save(data, f, pickle_module=pickle_module))
        else:
            torch.save(data, file_or_path, pickle_module=pickle_module)


def _maybe_convert_to_cpu(data, convert: bool = True):
    """``data`` with every xla tensor synced and (if ``convert``) replaced by a CPU copy; containers
    are rebuilt (lists, tuples, dicts, namedtuples), everything else is kept. A tensor that occurs
    several times gets one copy. Downloads; Hugging Face's ``Trainer`` saves models with it."""
    _sync("save")
    if not convert:
        return data
    return _map_tensors(data, is_xla_tensor, lambda t: t.cpu())


def send_cpu_data_to_device(datas, device, input_sharding=None):
    """``datas`` with every plain CPU tensor (not a ``Parameter``) uploaded to ``device``;
    containers are rebuilt (lists, tuples, dicts, namedtuples), everything else is kept. A tensor
    that occurs several times is uploaded once. A bare tensor comes back in a one-element list,
    as in torch_xla. ``input_sharding`` (an ``xs.ShardingSpec``) annotates each upload it applies
    to. Transfers; compiles nothing."""
    device = torch.device(device)

    def send(t):
        x = t.to(device)
        if input_sharding is not None and input_sharding.can_apply(x):
            x = input_sharding.apply(x)
        return x

    if type(datas) is torch.Tensor:
        datas = [datas]
    return _map_tensors(datas, lambda v: type(v) is torch.Tensor and v.device.type == "cpu", send)


def _map_tensors(data, select, fn):
    from torch.utils._pytree import tree_map

    done = {}  # id -> result: a tensor reached twice maps to one result, as torch_xla's arena does

    def one(v):
        if not select(v):
            return v
        if id(v) not in done:
            done[id(v)] = (v, fn(v))  # v kept alive so its id is not reused during the walk
        return done[id(v)][1]

    return tree_map(one, data)


def set_rng_state(seed: int, device=None) -> None:
    """Seed the device RNG (the same seed gives the same numbers in a fresh process)."""
    rng.set_seed(seed)


def get_rng_state(device=None) -> int:
    """The device RNG's current state; ``set_rng_state`` of it replays what follows."""
    return rng.get_seed()


@contextlib.contextmanager
def fork_rng(device=None, enabled: bool = True):
    """A context in which the device RNG may be used and after which its state is what it was
    before (``enabled=False``: a plain context)."""
    if not enabled:
        yield
        return
    state = get_rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)


def master_print(*args, fd=None, **kwargs) -> None:
    """``print`` on the master ordinal only."""
    if is_master_ordinal(local=False):
        print(*args, file=fd, **kwargs)


def mesh_reduce(tag: str, data, reduce_fn):
    """``reduce_fn`` of every replica's ``data`` (tensors travel as CPU tensors, through the host)."""
    from torch.utils._pytree import tree_map

    from xlatorch.runtime.base.topology import exchange

    cpu = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, data)
    return reduce_fn(exchange(tag, cpu))


# ---------------------------------------------------------------------------------------
# torch_xla names users call (issue 29 §4): progress tracking, StableHLO of pending
# tensors, host-to-device pytrees, device descriptions. Kept together, after the rest.
# ---------------------------------------------------------------------------------------

import io as _io  # noqa: E402
import time as _time  # noqa: E402
from typing import TypedDict as _TypedDict  # noqa: E402

__all__ += [
    "RateTracker", "get_stablehlo", "get_stablehlo_bytecode", "xla_device_kind", "collective_broadcast",
    "xla_rendezvous", "all_reduce_bucketized_gradients",
    "xla_real_devices", "xla_replication_devices", "unlazy", "check_view_sharing",
    "all_gather_bucketized", "do_on_ordinals", "MemoryInfo",
]  # fmt: skip


class MemoryInfo(_TypedDict):
    """What ``get_memory_info`` returns: bytes used and the device's limit."""

    bytes_used: int
    bytes_limit: int
    peak_bytes_used: int


class RateTracker:
    """Items per second, as a training loop reports them: ``add(n)`` after each batch,
    ``rate()`` the rate since the last ``rate()`` (smoothed exponentially by
    ``smooth_factor``, default ``$RATE_TRACKER_SMOOTHING`` or 0.4), ``global_rate()`` the
    rate since creation. Host-side; nothing syncs."""

    def __init__(self, smooth_factor: float | None = None):
        if smooth_factor is None:
            smooth_factor = float(os.environ.get("RATE_TRACKER_SMOOTHING", "0.4"))
        self._smooth_factor = smooth_factor
        self._start_time = _time.time()
        self._partial_time = self._start_time
        self._partial_count = 0.0
        self._partial_rate = None
        self._count = 0.0

    def add(self, count: float) -> None:
        """Count ``count`` more items."""
        self._count += count

    def rate(self) -> float:
        """Items per second since the previous call, smoothed with the previous rate."""
        now = _time.time()
        delta = now - self._partial_time
        if delta <= 0:
            return 0.0
        rate = self._count / delta
        if self._partial_rate is not None:
            rate = (1 - self._smooth_factor) * rate + self._smooth_factor * self._partial_rate
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = rate
        return rate

    def global_rate(self) -> float:
        """Items per second since the tracker was made."""
        delta = _time.time() - self._start_time
        return (self._partial_count + self._count) / delta if delta > 0 else 0.0


def _pending_tensors(tensors, who: str) -> list:
    if tensors is None:
        raise ValueError(f"xlatorch: {who}() needs the tensors whose graph to lower (torch_xla's default, "
                         "every live tensor, is not supported)")  # fmt: skip
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def get_stablehlo(tensors=None) -> str:
    """The StableHLO (MLIR text) of the graph computing ``tensors``, as a sync would compile
    it. Does not sync or compile."""
    from xlatorch.runtime.execute.lowered import lower

    return lower(_pending_tensors(tensors, "get_stablehlo"), "xm.get_stablehlo")[0].as_text(dialect="stablehlo")


def get_stablehlo_bytecode(tensors=None) -> bytes:
    """``get_stablehlo``'s module as MLIR bytecode. Does not sync or compile."""
    from xlatorch.runtime.execute.lowered import lower

    lowered = lower(_pending_tensors(tensors, "get_stablehlo_bytecode"), "xm.get_stablehlo_bytecode")[0]
    buf = _io.BytesIO()
    lowered.compiler_ir("stablehlo").operation.write_bytecode(buf)
    return buf.getvalue()


def collective_broadcast(tensors, root_ordinal: int = 0, groups=None, pin_layout: bool = True) -> None:
    """Give every replica's ``tensors`` (in place) the values of replica ``root_ordinal``'s: one
    all-reduce of each tensor, zeroed on the other replicas (the same graph on every replica:
    whether this one is the root enters as data)."""
    from xlatorch import runtime as xr

    with torch.no_grad():
        for t in tensors:
            root = torch.tensor(xr.global_ordinal() == root_ordinal, device=t.device)
            t.copy_(torch.where(root, t, torch.zeros_like(t)))
        all_reduce(REDUCE_SUM, list(tensors), groups=groups, pin_layout=pin_layout)


def xla_rendezvous(payload: bytes = b"", ordinals=None, tag: str | None = None) -> list[bytes]:
    """Share ``payload`` with the replicas in ``ordinals`` (default: all): every replica's
    payload, by ordinal (``rendezvous`` under the tag ``tag``, default ``"xla_rendezvous"``)."""
    return rendezvous(tag or "xla_rendezvous", payload, ordinals)


def all_reduce_bucketized_gradients(gradients, scale: float, groups, pin_layout: bool, bucket_cap_mb: int = 0):
    """Sum ``gradients`` (in place) over the replicas, times ``scale``. torch_xla cuts them into
    buckets of ``bucket_cap_mb`` to bound its collectives' size; here they join the step's one
    program, where XLA schedules the all-reduces itself."""
    all_reduce(REDUCE_SUM, list(gradients), scale=scale, groups=groups, pin_layout=pin_layout)


def xla_device_kind(device=None) -> str:
    """The kind of hardware behind ``device`` (JAX's ``device_kind``: 'cpu', 'NVIDIA H100
    80GB HBM3', 'TPU v5 lite' ...)."""
    return jax.local_devices()[0].device_kind


def xla_real_devices(devices=None) -> list[str]:
    """The runtime devices (``'CPU:0'``, ``'CUDA:0'``, ``'TPU:0'``) behind ``devices``
    (``xla:N`` names; default every local xla device)."""
    from xlatorch.runtime import device_type

    kind = device_type()
    if devices is None:
        return [f"{kind}:{i}" for i in range(len(jax.local_devices()))]
    return [f"{kind}:{torch.device(d).index or 0}" for d in devices]


def xla_replication_devices(local_devices=None) -> list[str]:
    """The runtime devices of every replica of the job, in ordinal order."""
    from xlatorch.runtime import device_type

    return [f"{device_type()}:{i}" for i in range(xrt_world_size())]


def unlazy(tensors) -> None:
    """Compute ``tensors`` now (a sync of the device's pending graph) and wait for them."""
    _sync("unlazy")
    wait_device_ops()


def check_view_sharing(obj) -> None:
    """Raise ``RuntimeError`` where two xla tensors in ``obj`` (any nesting) share storage:
    saving such a structure would write the shared data twice."""
    seen: dict = {}

    def visit(v):
        if isinstance(v, torch.Tensor) and v.device.type == "xla":
            key = id(getattr(v, "_st", v))  # the storage a tensor shares with its views
            if key in seen and seen[key] is not v:
                raise RuntimeError(f"xla tensors share storage (views of one another): shapes "
                                   f"{tuple(seen[key].shape)} and {tuple(v.shape)}")  # fmt: skip
            seen[key] = v
        return v

    torch.utils._pytree.tree_map(visit, obj)


def all_gather_bucketized(
    input_list, dim: int = 0, groups=None, output=None, pin_layout: bool = False, bucket_cap_mb: int = 160
) -> list:
    """``all_gather`` of each tensor of ``input_list`` (into ``output``'s tensors where given),
    in buckets of about ``bucket_cap_mb`` MB (``CoalescingBuckets``); the step's one program
    holds them all and XLA schedules them."""

    def gather(inputs, outputs=None):
        if isinstance(inputs, torch.Tensor):
            return all_gather(inputs, dim=dim, groups=groups, output=outputs, pin_layout=pin_layout)
        outs = outputs or [None] * len(inputs)
        return [all_gather(t, dim=dim, groups=groups, output=o, pin_layout=pin_layout) for t, o in zip(inputs, outs)]

    res = CoalescingBuckets(gather, list(input_list), output, bucket_cap_mb=bucket_cap_mb)()
    return output if output is not None else res  # the same tensors; the caller's list itself


def do_on_ordinals(target, data=(), ordinals=(0,)) -> None:
    """Call ``target(*data)`` on the replicas whose ordinal is in ``ordinals``; every replica
    then waits for the others (a rendezvous)."""
    if get_ordinal() in ordinals:
        target(*data)
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")


def optimization_barrier_(tensors) -> None:
    """In place: ``tensors`` pass through one XLA optimization barrier, so XLA neither moves
    computation across this point nor merges what follows with what came before (a
    recomputation stays a recomputation). Records one node; no sync."""
    from xlatorch.runtime.trace.barrier import optimization_barrier_ as barrier

    barrier(list(tensors))


__all__ += ["optimization_barrier_"]
