"""Where the program runs: this process's devices, and the replica world (joining JAX's
distributed runtime, ordinals, rendezvous).

One process drives one device and is one replica. Processes join through
``jax.distributed.initialize`` (the PJRT coordination service; collectives over gloo
on CPU, NCCL on GPU, ICI on TPU), after which the global device mesh spans every
process and graphs containing collectives run as one SPMD program on it
(``runtime/trace/collectives.py``, ``runtime/execute/sync.py``).

The job is described by environment variables, set by ``xmp.spawn`` for the
processes it starts, or by the user / cluster for multi-host jobs:

- ``XLATORCH_COORDINATOR`` host:port of process 0's coordination service
- ``XLATORCH_WORLD_SIZE`` number of processes in the job
- ``XLATORCH_RANK`` this process's global ordinal
- ``XLATORCH_LOCAL_RANK`` / ``XLATORCH_LOCAL_WORLD_SIZE`` ordinal and count on this host

or by ``torchrun`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
"""

from __future__ import annotations

import base64
import os
import pickle
import sys
import threading
import time

from xlatorch.runtime.base import config, record

__all__ = [
    "initialize", "shutdown", "is_initialized", "coordinator_address", "world_size", "global_ordinal",
    "local_ordinal", "local_world_size",
    "rendezvous", "RendezvousTimeout", "jax_device", "put", "Groups", "local_device_count", "current_device",
    "set_current_device", "device_index", "enable_multi_device", "SPMD",
]  # fmt: skip

# SPMD[0]: the process runs SPMD (``xr.use_spmd()``: xla:0 is one device over every device of
# the job, runtime/multi/sharding.py); read on hot paths as a plain list item.
SPMD = [False]
_world = {"size": 1, "rank": 0, "local_rank": 0, "local_size": 1, "joined": False}
_rdv_counts: dict[str, int] = {}


def initialize() -> None:
    """Join the job described by the environment (a no-op in a one-process job).

    Must run before the process first touches its device: JAX's backend is
    created once, and a joined process sees the global mesh.
    """
    if _world["joined"]:
        return
    _from_torchrun()
    size = config.env("XLATORCH_WORLD_SIZE") or 1
    rank = config.env("XLATORCH_RANK") or 0
    local_rank, local_size = config.env("XLATORCH_LOCAL_RANK"), config.env("XLATORCH_LOCAL_WORLD_SIZE")
    _world.update(size=size, rank=rank, local_rank=rank if local_rank is None else local_rank,
                  local_size=local_size or size, joined=True)  # fmt: skip
    if size == 1:
        _cpu_devices()
        return
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    coordinator = config.env("XLATORCH_COORDINATOR")
    if coordinator is None:
        raise RuntimeError(f"xlatorch: XLATORCH_WORLD_SIZE={size} needs XLATORCH_COORDINATOR=HOST:PORT "
                           "(process 0's coordination service)")  # fmt: skip
    timeout = config.env("XLATORCH_INIT_TIMEOUT")
    heartbeat = config.env("XLATORCH_HEARTBEAT_TIMEOUT")
    # JAX's own heartbeat check aborts with a C++ stack trace naming no one: ours fires first.
    jax.distributed.initialize(coordinator, num_processes=size, process_id=rank, initialization_timeout=timeout,
                               heartbeat_timeout_seconds=2 * heartbeat + 10)  # fmt: skip
    threading.Thread(target=_watch_peers, args=(size, rank, heartbeat), daemon=True, name="xlatorch-peers").start()


# Called with the message when this process learns that the job lost a process (the launcher of
# an xmp worker reports it: xla_multiprocessing.py); then the process exits.
LOST_HOOKS: list = []
_ALIVE = "xlatorch/alive/"


def _watch_peers(size: int, rank: int, timeout: int) -> None:
    """Each process of the job counts up a key of the job's key-value store every second and
    reads the others': one whose count has not moved for ``timeout`` seconds is lost (it died,
    or its host is gone), and so is the coordination service when the store fails. A process
    waiting in a collective with it would otherwise wait for JAX's heartbeat check."""
    from jax._src import distributed as jd

    client = jd.global_state.client
    last: dict[int, tuple[str, float]] = {}
    beat = 0
    while True:
        now = time.monotonic()
        try:
            if _done[0]:
                client.key_value_set(_ALIVE + str(rank), "done", allow_overwrite=True)
                return
            beat += 1
            client.key_value_set(_ALIVE + str(rank), str(beat), allow_overwrite=True)
            # One read of every process's key (not one per process: the coordinator answers
            # every process of the job each second).
            beats = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(_ALIVE)}
            for r in range(size):
                if r == rank:
                    continue
                v = beats.get(str(r), "")  # "": it has not beaten once yet
                if v == "done":
                    continue
                if r not in last or last[r][0] != v:
                    last[r] = (v, now)
                elif now - last[r][1] > timeout:
                    _lost(r, f"its heartbeat stopped {timeout}s ago")
        except Exception as e:  # noqa: BLE001 (the store is gone: process 0 hosts it)
            if _done[0]:
                return
            _lost(0, f"the job's coordination service (in process 0) stopped answering: {e}")
        time.sleep(1.0)


_done = [False]  # this process is leaving the job normally (shutdown)


def _lost(who: int, why: str) -> None:
    """The job lost process ``who``: say which, and exit (a process blocked in a collective with
    it would otherwise wait)."""
    per_host = max(_world["local_size"], 1)
    me = _world["rank"]
    msg = (f"xlatorch: the job lost process {who} (host {who // per_host}): {why} (it died, or its host is "
           f"gone); process {me} (host {me // per_host}) stops")  # fmt: skip
    try:
        for hook in LOST_HOOKS:
            hook(msg)
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def _cpu_devices() -> None:
    """A one-process job on CPU has ``$CPU_NUM_DEVICES`` devices, as torch_xla's PJRT CPU client
    has (SPMD's mesh, ``dp.DataParallel``'s replicas; several processes take it as their count)."""
    n = config.env("CPU_NUM_DEVICES")
    if n:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            import jax

            jax.config.update("jax_num_cpu_devices", n)


def _from_torchrun() -> None:
    """Processes started by ``torchrun`` join through its variables; the coordinator listens on
    ``MASTER_PORT + 1`` (``MASTER_PORT`` itself is torch.distributed's store)."""
    env = os.environ
    described = config.env("XLATORCH_WORLD_SIZE") is not None  # by xmp.spawn or the user
    if described or not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} <= set(env):
        return
    env["XLATORCH_COORDINATOR"] = f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}"
    env["XLATORCH_WORLD_SIZE"] = env["WORLD_SIZE"]
    env["XLATORCH_RANK"] = env["RANK"]
    env["XLATORCH_LOCAL_RANK"] = env.get("LOCAL_RANK", env["RANK"])
    env["XLATORCH_LOCAL_WORLD_SIZE"] = env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])


def coordinator_address() -> tuple[str, int]:
    """(host, port) of the job's coordination service (``127.0.0.1`` and a free port alone)."""
    addr = config.env("XLATORCH_COORDINATOR")
    if not addr:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = os.environ["XLATORCH_COORDINATOR"] = f"127.0.0.1:{s.getsockname()[1]}"
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def shutdown() -> None:
    """Leave the job: waits until every process has arrived (JAX's shutdown barrier)."""
    if _world["size"] > 1 and _world["joined"]:
        import jax

        _done[0] = True
        try:  # the others stop watching this process's heartbeat
            from jax._src import distributed as jd

            jd.global_state.client.key_value_set(_ALIVE + str(_world["rank"]), "done", allow_overwrite=True)
        except Exception:  # noqa: BLE001 (the store is gone: nothing watches any more)
            pass
        jax.distributed.shutdown()


def is_initialized() -> bool:
    return _world["joined"]


_threads = {"count": 0}  # > 0 while dp.DataParallel runs one replica per local device in threads


def set_thread_replicas(count: int) -> None:
    """``dp.DataParallel``: ``count`` replicas are this process's first ``count`` local devices,
    one thread each (0: back to one replica per process)."""
    _threads["count"] = count


def thread_replicas() -> int:
    return _threads["count"]


def process_world() -> tuple[int, int]:
    """(number of processes in the job, this process's index), whatever threads run inside."""
    return _world["size"], _world["rank"]


def set_spmd(on: bool) -> None:
    """Under SPMD the job is one replica: one program over every device (``runtime/multi/sharding.py``)."""
    SPMD[0] = on


def start_spmd(join: bool = True) -> None:
    """Enter SPMD before the device's first use: ``$CPU_NUM_DEVICES`` CPU devices (as torch_xla's
    PJRT CPU client has), the job joined (``join``; else at the device's first use), and
    ``XLA_USE_SPMD=1`` set as torch_xla's ``use_spmd`` leaves it (processes started from here
    inherit it)."""
    _cpu_devices()  # every process of a multi-process SPMD job too
    if join:
        initialize()  # a multi-process job joins before JAX's backend starts
    SPMD[0] = True
    os.environ["XLA_USE_SPMD"] = "1"


def world_size() -> int:
    """Number of replicas in the job: processes, or the devices of ``dp.DataParallel`` (1 under SPMD:
    one program over every device, as torch_xla counts it)."""
    if SPMD[0]:
        return 1
    return _threads["count"] or _world["size"]


def global_ordinal() -> int:
    """This replica's index in the job (under ``dp.DataParallel``, this thread's device)."""
    if _threads["count"]:
        return current_device()
    return _world["rank"]


def local_ordinal() -> int:
    """This replica's index on its host."""
    if _threads["count"]:
        return global_ordinal()
    return _world["local_rank"]


def local_world_size() -> int:
    return _world["local_size"]


class RendezvousTimeout(RuntimeError):
    """Not every replica reached a rendezvous in time."""


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def rendezvous(tag: str, payload: bytes = b"", replicas=None, timeout: float | None = None) -> list[bytes]:
    """Wait until every replica reaches ``tag``; returns every replica's ``payload``, by ordinal.

    Uses the coordination service's key-value store (host side, no device work).
    Raises ``RendezvousTimeout`` naming the tag and the missing replicas after
    ``timeout`` seconds (default ``$XLATORCH_RENDEZVOUS_TIMEOUT`` or 300).
    """
    n = world_size()
    if n == 1:
        return [payload]
    if timeout is None:
        timeout = config.env("XLATORCH_RENDEZVOUS_TIMEOUT")
    count = _rdv_counts[tag] = _rdv_counts.get(tag, 0) + 1
    key = f"xlatorch/rendezvous/{tag}/{count}"
    client = _client()
    client.key_value_set(f"{key}/{global_ordinal()}", base64.b64encode(payload).decode())
    ranks = range(n) if not replicas else replicas
    out = []
    for r in ranks:
        try:
            v = client.blocking_key_value_get(f"{key}/{r}", int(timeout * 1000))
        except Exception as e:
            raise RendezvousTimeout(
                f"xlatorch: rendezvous '{tag}' timed out after {timeout:g}s: replica {r} of {n} did not arrive "
                f"({type(e).__name__})"
            ) from None
        out.append(base64.b64decode(v))
    return out


def exchange(tag: str, obj) -> list:
    """Every replica's ``obj`` (picklable), by ordinal."""
    return [pickle.loads(b) for b in rendezvous(tag, pickle.dumps(obj))]


# --- this process's devices -----------------------------------------------------------------

_devices: list = []
# Called once when the process finds several local devices (runtime/ir/values.py: nodes then
# track which device they live on).
MULTI_DEVICE_HOOKS: list = []
_thread = threading.local()
# CLOSED[0]: the process is exiting (``close``); read where work for the device starts.
CLOSED = [False]


def close() -> None:
    """The process is exiting (runtime/execute/settle.py): from now on a thread other than the
    main one that comes for the device waits for the process to end (``park``)."""
    CLOSED[0] = True


def park() -> None:
    """After ``close``, outside the main thread: wait, without the GIL, until the process ends.

    Such a thread must not enter jaxlib any more: coming back from a call that released the
    GIL while Python finalizes aborts the process (runtime/execute/settle.py, ``_at_exit``).
    """
    if CLOSED[0] and threading.current_thread() is not threading.main_thread():
        threading.Event().wait()


def jax_device(dev: int = 0):
    """The JAX device backing local device ``dev`` (``xla:0`` is the first local device)."""
    if CLOSED[0]:  # every upload asks for its device first
        park()
    if not _devices:
        import jax

        initialize()  # join the job the environment describes (a no-op alone)
        # Under SPMD, xla:0 is one device spanning them all (runtime/multi/sharding.py).
        _devices.extend(jax.local_devices()[:1] if SPMD[0] else jax.local_devices())
        if len(_devices) > 1:  # several local devices: nodes track which one they live on
            enable_multi_device()
        for hook in record.DEVICE_HOOKS:  # xlatorch.debug.profiler: a capture scheduled before now may start
            hook()
    return _devices[dev]


def put(a, target):
    """Host array ``a`` (numpy) on ``target``, a JAX device (None: the default one) or a fully
    replicated sharding (an SPMD program's scalars): what ``jax.device_put(a, target)`` does
    without its Python wrapping (pytree flattening, dtype and sharding checks: ~45 us of ~50
    for a small array on this project's CPU machine), through the call it ends in;
    ``jax.device_put`` itself where that internal call is missing or refuses. On CPU the device
    array may alias ``a``: it must not be written afterwards."""
    if _PUT[0] is None:
        _PUT[0] = _fast_put()
    fast, placed, exact = _PUT[0]
    if fast is not None and target is not None and a.dtype in exact:
        where = placed.get(target)
        if where is None:
            where = placed[target] = _placement(target)
        if where:
            try:
                return fast(a.shape, a.dtype, where[0], [a] * len(where[1]), where[1])
            except Exception:
                pass
    import jax

    return jax.device_put(a, target)


def _placement(target) -> tuple:
    """``(sharding, its devices)`` that ``put`` hands the internal call, one copy of the array
    per device; () where it must not (a sharding that splits the array)."""
    from jax.sharding import Sharding, SingleDeviceSharding

    if not isinstance(target, Sharding):
        return SingleDeviceSharding(target), [target]
    try:
        if target.is_fully_replicated:
            return target, list(target._addressable_device_assignment)
    except AttributeError:  # another jax
        pass
    return ()


class Groups:
    """An executable's packed scalar groups on ``target`` (``put``'s), run after run: a group
    whose bytes equal the last run's is not sent again (its device copy is reused; packed
    scalars are never donated), a changed one is. A training step's groups mostly stay the same
    (an optimizer's hyperparameters; not Adam's bias corrections)."""

    __slots__ = ("target", "last")

    def __init__(self, target):
        self.target = target
        self.last = None  # (the last run's bytes per group, their device arrays)

    def same(self, seen: list) -> bool:
        """Whether ``seen`` (each group's ``tobytes()``) is what the last run sent."""
        last = self.last
        return last is not None and last[0] == seen

    def send(self, packed: list, seen: list) -> list:
        """The device arrays of this run's groups ``packed`` (bytes ``seen``)."""
        last = self.last  # one read and one write: replica threads may share an executable
        if last is None:
            vals = [put(p, self.target) for p in packed]
        else:
            vals = last[1]
            changed = [g for g, b in enumerate(seen) if b != last[0][g]]
            if changed:
                vals = list(vals)
                for g in changed:
                    vals[g] = put(packed[g], self.target)
        self.last = (seen, vals)
        return vals


_PUT: list = [None]  # (fast call or None, target -> _placement(target), dtypes stored as they are)


def _fast_put():
    import numpy as np

    from xlatorch.runtime.base.dtypes import TORCH_TO_JAX

    try:
        from jax._src.core import ShapedArray
        from jax._src.interpreters.pxla import batched_device_put
    except ImportError:  # another jax: the public call
        return None, {}, frozenset()

    def fast(shape, dtype, sharding, xs, devices):
        return batched_device_put(ShapedArray(shape, dtype), sharding, xs, devices)

    # Dtypes the device stores as they are (device_put would canonicalise others).
    return fast, {}, frozenset(np.dtype(d) for d in TORCH_TO_JAX.values())


def enable_multi_device() -> None:
    """From now on values track which local device they live on (``dp.DataParallel``)."""
    for hook in MULTI_DEVICE_HOOKS:
        hook()


def local_device_count() -> int:
    """How many local xla devices this process has (starting the runtime if needed)."""
    jax_device()
    return len(_devices)


def current_device() -> int:
    """The local device index new values go to in this thread (``dp.DataParallel`` sets it)."""
    return getattr(_thread, "device", 0)


def set_current_device(index: int) -> None:
    _thread.device = index


def device_index(device) -> int:
    """The local device a ``torch.device('xla', i)`` names. Device tensors all report ``xla:0``
    to PyTorch (its autograd engine supports one device of a Python backend), so index 0
    (or none) means this thread's device; ``xla:i`` for i > 0 names device i."""
    index = getattr(device, "index", None) if device is not None else None
    if index:
        n = local_device_count()
        if index >= n:  # as CUDA's "invalid device ordinal", never a silent xla:0
            raise RuntimeError(
                f"xlatorch: invalid device ordinal: xla:{index} (this process has {n} xla device(s): "
                f"{', '.join(f'xla:{i}' for i in range(n))})"
            )
    return index or current_device()
