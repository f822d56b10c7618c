"""``xmp``: start one process per device and join them into one job (``torch_xla``'s
``xla_multiprocessing``).

``spawn(fn, args, nprocs)`` starts ``nprocs`` processes on this host, each joining
JAX's distributed runtime (process 0 hosts the coordination service on a free
loopback port) before calling ``fn(index, *args)``. If a worker raises or dies, the
others are stopped and ``spawn`` raises ``WorkerError`` carrying the worker's index
and traceback.

Multi-host: run ``spawn`` on every host with the same ``nprocs`` and set
``XLATORCH_COORDINATOR`` (host:port reachable by every host, on host 0),
``XLATORCH_NUM_HOSTS`` and ``XLATORCH_HOST_INDEX``; global ordinals are
``host_index * nprocs + local index``, and ``fn`` receives the global ordinal.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback

__all__ = ["spawn", "WorkerError", "MpModelWrapper", "MpSerialExecutor", "device_kind_handler_dict",
           "create_optimized_replica_groups"]  # fmt: skip


class WorkerError(RuntimeError):
    """A spawned worker raised or died; ``index`` is its local index."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_nprocs() -> int:
    """Processes per host: ``$CPU_NUM_DEVICES`` on CPU, else the local device count."""
    n = os.environ.get("CPU_NUM_DEVICES")
    if n:
        return int(n)
    import jax

    return jax.local_device_count()


def _watch_launcher(watch) -> None:
    """End this worker when its launcher dies (even by SIGKILL, which runs none of the
    launcher's cleanup). ``watch`` is the read end of a pipe whose only write end the
    launcher holds: nothing is ever sent, so the read returns when that end closes, with
    the launcher's death, whatever started this worker (a ``spawn`` or ``fork`` child's
    parent is the launcher, a ``forkserver`` child's is the fork server). ``os._exit``
    works even while the main thread is blocked in a collective or a device call."""
    try:
        watch.recv_bytes()
    except (EOFError, OSError):
        pass
    sys.stderr.write("xlatorch: the launcher of this worker died; exiting\n")
    sys.stderr.flush()
    os._exit(1)


def _adopt(environ: dict) -> None:
    """Make this process's environment the launcher's at ``spawn`` plus the job's variables,
    as a ``spawn`` child has it: a ``forkserver`` child starts with the fork server's, from
    whenever that server started."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def _worker(index: int, fn, args, env: dict, conn, watch, inherited: int | None) -> None:
    """The body of a spawned process: join the job, run ``fn``, report a failure to the parent."""
    _adopt(env)
    if inherited is not None:  # a ``fork`` child has the launcher's write end too: only the launcher keeps it
        os.close(inherited)
    threading.Thread(target=_watch_launcher, args=(watch,), daemon=True, name="xlatorch-launcher-watch").start()
    try:
        from xlatorch.runtime.base import topology as distributed

        distributed.LOST_HOOKS.append(lambda msg: conn.send(("LostProcess", msg)))
        distributed.initialize()
        try:
            fn(distributed.global_ordinal(), *args)
        except SystemExit as e:  # sys.exit(0) / sys.exit() in a worker: it is done, as torch_xla's are
            if e.code not in (0, None):
                raise
        distributed.shutdown()  # a barrier: process 0 hosts the coordination service
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises)
        try:
            conn.send((type(e).__name__, traceback.format_exc()))
        finally:
            conn.close()
        sys.stderr.flush()
        os._exit(1)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the job is over; skip teardown of the runtime's background threads


_LAUNCHED: list = []  # the write ends of the jobs started with ``join=False``


def _job_env(nprocs: int) -> list[dict]:
    hosts = int(os.environ.get("XLATORCH_NUM_HOSTS", "1"))
    host = int(os.environ.get("XLATORCH_HOST_INDEX", "0"))
    coordinator = os.environ.get("XLATORCH_COORDINATOR") or f"127.0.0.1:{_free_port()}"
    if hosts > 1 and not os.environ.get("XLATORCH_COORDINATOR"):
        raise RuntimeError("xlatorch: a multi-host job (XLATORCH_NUM_HOSTS > 1) needs XLATORCH_COORDINATOR")
    return [
        {
            "XLATORCH_COORDINATOR": coordinator,
            "XLATORCH_WORLD_SIZE": str(hosts * nprocs),
            "XLATORCH_RANK": str(host * nprocs + i),
            "XLATORCH_LOCAL_RANK": str(i),
            "XLATORCH_LOCAL_WORLD_SIZE": str(nprocs),
        }
        for i in range(nprocs)
    ]


def spawn(fn, args=(), nprocs: int | None = None, join: bool = True, daemon: bool = False,
          start_method: str = "spawn"):  # fmt: skip
    """Run ``fn(index, *args)`` in ``nprocs`` processes joined into one job; wait for all of them.

    ``nprocs=None`` uses ``$CPU_NUM_DEVICES`` on CPU, else the local device count.
    Raises ``WorkerError`` (index, traceback) as soon as any worker fails; the
    others are terminated, so nothing hangs and no process is left behind.

    ``start_method``: ``"spawn"`` (a fresh interpreter per worker), ``"forkserver"`` (forks of
    a server process, fast once ``multiprocessing.set_forkserver_preload`` names torch and
    JAX) or ``"fork"`` (only from a launcher that has not started a device yet). Whichever,
    a worker has the launcher's environment as it is at this call, and ends when the
    launcher dies.
    """
    n = nprocs or default_nprocs()
    if n == 1 and int(os.environ.get("XLATORCH_NUM_HOSTS", "1")) == 1:
        fn(0, *args)  # one replica: run in this process, as torch_xla does
        return None
    ctx = multiprocessing.get_context(start_method)
    procs, conns = [], []
    envs = _job_env(n)
    watch, alive = ctx.Pipe(duplex=False)  # ``alive`` stays here: the workers exit when it closes
    inherited = alive.fileno() if ctx.get_start_method() == "fork" else None
    for i, env in enumerate(envs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(i, fn, args, {**os.environ, **env}, send, watch, inherited),
                        daemon=daemon, name=f"xlatorch-worker-{i}")  # fmt: skip
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    watch.close()
    if not join:
        _LAUNCHED.append(alive)  # for the life of this process, as the workers' parent would be
        return procs
    hosts = int(os.environ.get("XLATORCH_NUM_HOSTS", "1"))
    names = [f"xlatorch worker {i}" + (f" (process {e['XLATORCH_RANK']} of the job, host "
                                       f"{os.environ.get('XLATORCH_HOST_INDEX', '0')})" if hosts > 1 else "")
             for i, e in enumerate(envs)]  # fmt: skip
    try:
        _join(procs, conns, names)
    finally:
        alive.close()
    return None


def _join(procs, conns, names=None) -> None:
    alive = {p.sentinel: i for i, p in enumerate(procs)}
    try:
        while alive:
            for s in multiprocessing.connection.wait(list(alive)):
                i = alive.pop(s)
                p = procs[i]
                p.join()
                if p.exitcode != 0:
                    raise WorkerError(i, _failure(names[i] if names else f"xlatorch worker {i}", p.exitcode, conns[i]))
    finally:
        _stop(procs)


def _failure(who: str, code: int, conn) -> str:
    if conn.poll(1.0):
        try:
            kind, tb = conn.recv()
            if kind == "LostProcess":  # another host's process is gone (topology._lost)
                return f"{who} stopped: {tb}"
            return f"{who} raised {kind}:\n{tb}"
        except EOFError:
            pass
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"{who} died with signal {name}"
    return f"{who} exited with code {code}"


def _stop(procs, grace: float = 3.0) -> None:
    """Terminate workers still running (a failed job), then kill those that ignore it."""
    running = [p for p in procs if p.is_alive()]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in running:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


class MpModelWrapper:
    """torch_xla's wrapper sharing one model's weights across spawned processes.

    With ``spawn`` start method each process unpickles its own copy; ``to(device)``
    moves it to the process's device.
    """

    def __init__(self, model):
        self._model = model

    def to(self, device):
        return self._model.to(device)


class MpSerialExecutor:
    """Runs a function in each local process one at a time (torch_xla API)."""

    def run(self, fn):
        from xlatorch.runtime.base import topology as distributed

        result = None
        for turn in range(distributed.local_world_size()):
            if turn == distributed.local_ordinal():
                result = fn()
            distributed.rendezvous(f"xlatorch.serial.{turn}")
        return result


# Replica orders for collectives on small TPU slices: each visits the chips once along a ring of
# the torus, so neighbours in the order are neighbours on the interconnect. Device ids number the
# chips x-fastest; bounds are (x, y, z) chips.
def _tpu_bounds() -> tuple[int, int, int]:
    from xlatorch import runtime as xr

    coords = [tuple(d.get("coords", (0, 0, 0))) for d in xr.global_runtime_device_attributes()]
    return tuple(max(c[i] for c in coords) + 1 for i in range(3))


def _v5p_replica_groups() -> list | None:
    """A 2x2x2 v5p slice: the ring JAX's mesh_utils uses for it; other shapes: None."""
    if _tpu_bounds() == (2, 2, 2):
        from jax._src.mesh_utils import _V5P_2x2x2_ORDER

        return [list(_V5P_2x2x2_ORDER)]
    return None


def _v6e_replica_groups() -> list | None:
    """A 2x4 v6e slice: along y at x=0, then back along y at x=1; other shapes: None."""
    bx, by, bz = _tpu_bounds()
    if (bx, by) == (2, 4):
        return [[x + 2 * y for x, ys in ((0, range(4)), (1, range(3, -1, -1))) for y in ys]]
    return None


# TPU generation -> the replica groups of its slice's best order (None where the default is best).
device_kind_handler_dict: dict = {"v5p": _v5p_replica_groups, "v6e": _v6e_replica_groups}

_TPU_TYPES = {"TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
              "TPU v5": "v5p", "TPU v4": "v4", "TPU v4 lite": "v4", "TPU v3": "v3", "TPU v2": "v2"}  # fmt: skip


def create_optimized_replica_groups() -> list | None:
    """Replica groups (one group of every replica, reordered) whose collectives follow the TPU
    slice's interconnect ring, for the slices ``device_kind_handler_dict`` knows; None
    elsewhere (other TPUs and shapes, GPU, CPU): the default order is used."""
    import jax

    kind = jax.devices()[0].device_kind
    handler = device_kind_handler_dict.get(_TPU_TYPES.get(kind, kind))
    return handler() if handler is not None else None
