"""Graph cutting: collect pending values, key the graph, compile on a miss, execute.

At a sync every live storage with a pending value becomes an output of one
computation. The graph's key is its structure (node hashes plus how nodes share
operands) and its leaves' avals; device data and host scalars are parameters, so
a fixed-shape step hits the cache from its second occurrence on. Executables are
called asynchronously: nothing here waits for results.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings

import jax
import torch

from xlatorch.runtime import births, checks, compiler, failure, ir, record, sharding, stages
from xlatorch.runtime.dtypes import to_jax
from xlatorch.runtime.emit import hlo_scopes
from xlatorch.runtime.execution import EXECUTIONS, uninterrupted
from xlatorch.runtime.failure import FailedValueError
from xlatorch.runtime.ir import Data
from xlatorch.runtime.plan import LoweringError, collect, lower_fn, pack, plan
from xlatorch.runtime.record import COUNTERS
from xlatorch.runtime.tensor import (
    CHECKED_SINCE_SYNC,
    DEFERRED,
    LOCK,
    PENDING,
    _in_backward,
    pending_storages,
    reroot_lone_views,
)

__all__ = ["sync", "CACHE", "set_cache_size"]

CACHE: dict = {}  # graph key -> Executable
# At most this many executables stay in memory (``XLATORCH_EXECUTABLE_CACHE_SIZE``): the
# least recently used is dropped (counter ``CompileCacheEviction``) and, if met again,
# compiled anew, which the persistent compilation cache turns into a load from disk.
# A steady-state program uses a handful; a program sweeping input shapes would otherwise
# keep every one (0.5 MB for a small graph, more for a large one).
#
# A loop over more graphs than that (a dynamic-cache ``generate()`` of 600 tokens compiles a
# stage per length) would drop each graph just before it comes back, and compile all of
# them at every call. So, unless the user set the limit, each graph met again after it was
# dropped raises it by one, up to ``CACHE_SIZE_MAX`` (counter ``CompileCacheGrown``), while
# the host has a quarter of its memory available (executables live in host memory): a sweep
# that never comes back stays within the limit; a loop gets room for exactly what it reuses.
_USER_SIZE = os.environ.get("XLATORCH_EXECUTABLE_CACHE_SIZE")
CACHE_SIZE = int(_USER_SIZE or "512")
CACHE_SIZE_MAX = 8 * CACHE_SIZE
_fixed = [bool(_USER_SIZE)]  # the user's limit is kept as given
_dropped: dict = {}  # hash of a dropped graph's key -> None, oldest first (bounded)
_uses = itertools.count()


def set_cache_size(n: int) -> None:
    """Keep at most ``n`` compiled graphs in memory (evicting the least recently used now);
    the limit is then fixed (it no longer grows for a loop that needs more)."""
    global CACHE_SIZE
    CACHE_SIZE = max(1, int(n))
    _fixed[0] = True
    _evict()


def _evict() -> None:
    while len(CACHE) > CACHE_SIZE:
        oldest = min(CACHE, key=lambda k: CACHE[k].used)
        if CACHE.pop(oldest, None) is None:  # another device's thread dropped it (ir._multi syncs unlocked)
            continue
        COUNTERS["CompileCacheEviction"] += 1
        if not _fixed[0]:
            _dropped[hash(oldest)] = None
            if len(_dropped) > CACHE_SIZE_MAX:
                _dropped.pop(next(iter(_dropped)), None)


def _grow_if_dropped(key) -> None:
    """At a miss: a graph dropped from memory and met again means the program loops over
    more graphs than the limit: one more place, for it (not past ``CACHE_SIZE_MAX``)."""
    global CACHE_SIZE
    if _dropped and _dropped.pop(hash(key), 0) is None and CACHE_SIZE < CACHE_SIZE_MAX and _host_room():
        CACHE_SIZE += 1
        COUNTERS["CompileCacheGrown"] += 1


def _host_room() -> bool:
    """Whether a quarter of the host's memory (a container's, where limited) is still
    available (True where unknown)."""
    from xlatorch.runtime.memory import host_memory

    free, total = host_memory()
    return free is None or free * 4 >= total


# Donation is offered whenever shapes match; XLA declining it (layouts) is not the user's concern.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


class Executable:
    """A compiled graph: ``compiled(arrays, packed)`` runs it for this process's device; a
    graph whose collectives span several local devices (``threads`` > 1) runs once for all
    of them through ``run_all([(arrays, packed) per device])``."""

    __slots__ = ("compiled", "run_all", "threads", "xla", "checks", "used", "need", "fast")

    def __init__(self, compiled, run_all=None, threads=0, xla=None):
        self.compiled = compiled
        self.run_all = run_all
        self.threads = threads
        self.xla = xla  # the jax Compiled (memory_analysis, as_text) for xlatorch.debug
        self.checks = None  # a checks.Table when the graph has on-device checks (an extra last output)
        self.used = 0  # when it last ran (for the in-memory cache's eviction)
        self.need = _bytes_needed(xla)  # new buffers a run allocates (outputs + temporaries)
        self.fast = 0  # compiled to compile fast: the runs left before it is compiled to run fast


class OutOfMemory(torch.OutOfMemoryError):
    """A graph's buffers do not fit in the device's free memory (checked before it runs; the
    exception PyTorch raises for a CUDA out-of-memory, a ``RuntimeError``)."""


def _bytes_needed(compiled) -> int:
    try:
        m = compiled.memory_analysis()
        return int(m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # not every backend reports it
        return 0


_BIG = 1 << 28  # graphs allocating more than this are checked against free memory before they run


def _check_memory(exe, gdev) -> None:
    if exe.need <= _BIG:
        return
    from xlatorch.runtime.memory import available_bytes
    from xlatorch.runtime.transfer import jax_device

    free = available_bytes(jax_device(gdev))
    if free is not None and exe.need > free:
        raise OutOfMemory(
            f"RESOURCE_EXHAUSTED: this step's graph needs {exe.need / 2**30:.2f} GiB of new buffers on xla:{gdev}, "
            f"and {free / 2**30:.2f} GiB are free; the tensors computed by it were not computed"
        )


def sync(reason: str = "mark_step", dev: int | None = None) -> None:
    """Materialise every live pending tensor (of local device ``dev``, default: all devices),
    with one (cached) XLA execution per device."""
    lock = None if ir._multi else LOCK  # see tensor.LOCK
    if lock is not None:
        lock.acquire()
    try:
        phase = record.PHASE
        if phase is not None:  # profiling: spans for the sync, its compile and execution
            with phase("xlatorch.sync", reason=reason):
                _sync(reason, dev, record.TIMED)
        else:  # otherwise that test is all the profiler costs a sync
            _sync(reason, dev, record.timed)
    finally:
        if lock is not None:
            lock.release()


def _sync(reason, dev, timed) -> None:
    if DEFERRED and _in_backward() == -1:
        error = DEFERRED.pop(threading.get_ident(), None)
        if error is not None:
            raise error
    # Creation order: the same for every replica running the same program whichever way it
    # reached this sync (a replicated graph must be the same program on every replica).
    storages = pending_storages()
    if dev is None:
        devs = {st.dev for st in storages}
        if len(devs) > 1:
            for d in sorted(devs):
                sync(reason, d)
            return
        everything = True
    else:
        everything = all(st.dev == dev for st in storages)
        storages = [st for st in storages if st.dev == dev]
    if not storages:
        if everything:
            PENDING.clear()
            CHECKED_SINCE_SYNC.clear()
        checks.settle()  # a sync reads the previous step's checks even when it has nothing to run
        return
    t0 = time.perf_counter_ns()
    reroot_lone_views(storages)
    roots = [st.value for st in storages]
    nodes, leaves, enc, root_refs, any_failed = collect(roots)
    if any_failed:
        healthy, failed = failure.split_failed(storages, nodes)
        if failed is not None:  # run what does not depend on the failure, then report it
            sync(reason, dev)
            error = FailedValueError(f"xlatorch: a tensor's value could not be computed: {failed}")
            error.__cause__ = failed
            ok = {id(st) for st in healthy}
            failure.raise_owned(error, [st for st in storages if id(st) not in ok])
            return
        storages = healthy
    for hook in record.SYNC_HOOKS:  # xlatorch.debug: the graph-cut report
        hook(reason, len(nodes))
    try:
        _run_storages(storages, nodes, leaves, enc, root_refs, reason, dev, timed, everything, t0)
    except LoweringError as le:
        # One op could not be lowered: it fails, what depends on it carries the error, the
        # rest of the step runs.
        n = nodes[le.k]
        err = le.error
        err.add_note(f"xlatorch: raised while lowering {_op_name(n)}; the tensors computed from it carry this error")
        failure.fail_node(n, err)
        try:
            sync(reason, dev)
        except FailedValueError as fe:
            if failure.cause(fe) is not err:
                raise
        err.__suppress_context__ = True
        failure.raise_owned(err, [st for st in storages if failure.is_failed_storage(st)])
    except OutOfMemory as oom:
        _isolate(storages, nodes, oom, reason, dev)
        raise


def _op_name(n) -> str:
    from xlatorch.runtime.source import fmt_src

    name = n.spec.name.removesuffix(".default")
    src = getattr(n, "src", None)
    return f"aten::{name}" + (f" at {fmt_src(src, full=True)}" if src is not None else "")


def _isolate(storages, nodes, error, reason, dev) -> None:
    """After ``error`` stopped a graph before it ran: run its independent parts one by one.

    Parts that run are committed; a part that fails again keeps, for each tensor the step
    updated in place, its data from before the step, and the rest of its tensors carry
    the error."""
    parts = failure.components(storages, nodes)
    if len(parts) == 1:
        failure.give_back_or_fail(storages, error)
        return
    for part in parts:
        try:
            _run_part(part, reason, dev)
        except OutOfMemory as e:
            failure.give_back_or_fail(part, e)


def _run_part(part, reason, dev, once=False) -> None:
    t0 = time.perf_counter_ns()
    nodes, leaves, enc, root_refs, _ = collect([st.value for st in part])
    _run_storages(part, nodes, leaves, enc, root_refs, reason, dev, record.timed, False, t0, once)


def _run_storages(storages, nodes, leaves, enc, root_refs, reason, dev, timed, everything, t0, once=False) -> None:
    """Compile (once) and run the graph computing ``storages``' pending values; commit them
    (``once``: a graph expected to run once, compiled to compile fast, ``runtime/compiler.py``)."""
    roots = [st.value for st in storages]
    gdev = storages[0].dev
    keep = ()
    in_graph = False  # a checked step undoes itself in the graph (runtime/checks.py)
    if checks.ENABLED and any(n.info.checked for n in nodes):
        keep = checks.undoable(storages, nodes, leaves)
        in_graph = keep.in_graph = any(k is not None for k in keep) and checks.undo_in_graph(gdev)
    data = [v for v in leaves if type(v) is Data]
    # Donate buffers no live tensor holds any more, when an output can reuse them. Not the
    # data a failed check gives back, unless the graph gives it back itself (``in_graph``):
    # reading it after the step's outputs are written would make XLA copy every updated buffer.
    out_avals = {r.aval for r in roots}
    held = () if in_graph else {id(leaves[k[0]]) for k in keep if k is not None and k[0] >= 0}
    donate = tuple(i for i, v in enumerate(data) if v.holders == 0 and v.aval in out_avals and id(v) not in held)
    spmd = sharding.prepare(data, storages) if sharding.ENABLED[0] else None  # (mesh, key part, outs)
    key = (tuple(enc), root_refs, tuple(v.sig for v in leaves), donate, gdev, keep, spmd and spmd[1], in_graph)
    exe = CACHE.get(key)  # one lookup on a hit: hashing the key walks the whole graph's encoding
    if exe is None and held and checks.undo_in_graph(gdev, [v for v in leaves if id(v) in held]):
        return _run_storages(storages, nodes, leaves, enc, root_refs, reason, dev, timed, everything, t0, once)
    if exe is None:
        checks.settle()  # the previous step's check rows, before anything here runs on the device
    if exe is None and spmd is None:
        if births.ENABLED:
            order = births.hoist(storages, nodes, key, lambda part: _run_part(part, reason, dev, once=True))
            if order is not None:  # optimizer state computed first: this graph is the next step's
                nodes, leaves, enc, root_refs, _ = collect([st.value for st in order])
                return _run_storages(order, nodes, leaves, enc, root_refs, reason, dev, timed, everything, t0)
        # A graph whose shapes changed since it last ran may run as stages.
        stage = stages.split(nodes, enc, root_refs, gdev, reason)
        if stage is not None and _run_stages(storages, nodes, leaves, enc, root_refs, stage, gdev, everything, timed):
            _traced(t0)
            return
    packed, leaf_kinds = pack(leaves)
    try:
        if exe is None or exe.fast:
            args = (key, nodes, leaves, leaf_kinds, root_refs, data, packed, donate, gdev, keep, timed)
            exe = _executable(*args, spmd=spmd, once=once)
        else:
            COUNTERS["CachedCompile"] += 1
    except LoweringError:
        raise  # the caller fails just that node
    except Exception as e:
        failure.fail_storages(storages, e)
        raise
    _check_memory(exe, gdev)
    record.add_sample("TensorsGraphSize", len(nodes))
    exe.used = next(_uses)
    # The previous step's check rows, read as late as possible: the host prepared this step
    # while it ran. A failure found here raises before this step runs or donates anything.
    checks.settle()
    # From here the step's buffers are donated: it runs and commits whole, or fails whole.
    try:
        with uninterrupted():
            _run_and_commit(exe, storages, data, packed, gdev, nodes, keep, everything, timed)
    finally:
        _traced(t0)


def _traced(t0) -> None:
    global _last_sync
    now = time.perf_counter_ns()
    if _last_sync:
        # Host time of the step outside the sync itself: op tracing plus the user's Python.
        record.add_sample("LazyTracing", t0 - _last_sync)
    _last_sync = now


def _executable(
    key, nodes, leaves, leaf_kinds, root_refs, data, packed, donate, gdev, keep, timed, cut=None, spmd=None, once=False
):
    """The executable cached under ``key``, compiled on a miss (``once``: for a graph expected
    to run once or a few times, ``runtime/compiler.py``)."""
    exe = CACHE.get(key)
    if exe is not None:
        COUNTERS["CachedCompile"] += 1
        if exe.fast:
            exe.fast -= 1
            if not exe.fast:  # expected to run once, it keeps running: compile it to run fast
                try:
                    with timed("CompileTime"):
                        args = (nodes, leaves, leaf_kinds, root_refs, data, packed, donate, gdev, keep, cut, spmd)
                        better = _compile(*args)
                except Exception:  # an optimization only: the graph runs as compiled before
                    return exe
                COUNTERS["OptimizedRecompile"] += 1
                better.used = next(_uses)
                exe = CACHE[key] = better
        return exe
    COUNTERS["UncachedCompile"] += 1
    COUNTERS["CreateCompileHandles"] += 1  # torch_xla's name for the same event
    _grow_if_dropped(key)
    with timed("CompileTime") as tm:
        exe = _compile(nodes, leaves, leaf_kinds, root_refs, data, packed, donate, gdev, keep, cut, spmd, once)
    if once and compiler.options(True) != compiler.options() and compiler.worth_optimizing(exe.xla):
        exe.fast = compiler.RUNS_BEFORE_OPTIMIZING
    record.add_sample("InputOutputAliasCount", len(donate))  # buffers the executable may reuse
    exe.used = next(_uses)
    CACHE[key] = exe
    if len(CACHE) > CACHE_SIZE:
        _evict()
    for hook in record.COMPILE_HOOKS:  # xlatorch.debug: the compile explainer
        hook(key, nodes, leaves, root_refs, exe, time.perf_counter_ns() - tm.t0, cut)
    return exe


def _run_stages(storages, nodes, leaves, enc, root_refs, stage, gdev, everything, timed) -> bool:
    """Run the graph as the stages ``stages.split`` gave its nodes, then commit the step
    whole. Nothing is donated and nothing committed before the last stage has run, so on
    any failure (a check that fires, an error) this returns False having changed nothing,
    and the caller runs the graph whole, which reports it as usual."""
    checks.settle()  # before the try below: an earlier step's error is not a stage's to swallow
    t_run = time.perf_counter_ns()
    cut: dict = {}  # id(Out) -> Data: values computed by the stages so far
    outs = ()
    whole = type(stage) is stages.Whole  # a tiny graph: on the host, or whole as usual
    borrowed = type(stage) is stages.Borrowed  # runs only if it compiles nothing, else whole as before
    parts = stages.stages(enc, root_refs, stage)
    try:
        for s, ks, refs in parts if borrowed else ():
            if s & 1 and _stage_key(stages.encode(nodes, leaves, enc, stage, ks, refs, {}), gdev) not in CACHE:
                return False
        for s, ks, refs in parts:
            roots = [nodes[r // 4096].outs[r % 4096] for r in refs]
            sn = [nodes[k] for k in ks]
            if not s & 1:  # a stage of changing nodes: on the host if it may
                uploaded = stages.on_host(sn, cut, roots, gdev, whole)
                if uploaded is not None:
                    for o, d in zip(roots, uploaded):
                        cut[id(o)] = d
                    continue
                if whole or borrowed:
                    return False
            sl, senc, srefs = stages.encode(nodes, leaves, enc, stage, ks, refs, cut)
            data = [v for v in sl if type(v) is Data]
            packed, kinds = pack(sl)
            key = _stage_key((sl, senc, srefs), gdev)
            exe = _executable(key, sn, sl, kinds, srefs, data, packed, (), gdev, (), timed, cut, once=not s & 1)
            _check_memory(exe, gdev)
            record.add_sample("TensorsGraphSize", len(sn))
            exe.used = next(_uses)
            with timed("ExecuteDispatchTime"):
                outs = exe.compiled([d.array for d in data], packed)
            if exe.checks is not None:
                if checks.failure(exe.checks.rows, outs[-1], checks.where(exe.checks.rows, sn)) is not None:
                    return False
                outs = outs[:-1]
            for o, arr in zip(roots, outs):
                cut[id(o)] = Data(arr, o.aval, gdev)
    except Exception:
        return False
    COUNTERS["GraphOnHost" if whole else "StagedSync"] += 1
    with uninterrupted():
        _commit(storages, [cut[id(st.value)].array for st in storages], gdev, everything, t_run)
    return True


def _stage_key(encoded, gdev) -> tuple:
    """A stage's executable-cache key, from ``stages.encode``: no donation, no kept data."""
    sl, senc, srefs = encoded
    return (tuple(senc), srefs, tuple(v.sig for v in sl), (), gdev, (), None)


def _commit(storages, outs, gdev, everything, t_run) -> None:
    """Give each storage its result: they are no longer pending."""
    for st, arr in zip(storages, outs):
        st.set(Data(arr, st.value.aval, gdev))
        st.prev = None
    if everything:
        PENDING.clear()
        CHECKED_SINCE_SYNC.clear()
    else:
        for st in storages:
            PENDING.pop(st.sid, None)
    _last[:] = outs
    EXECUTIONS.started(outs, t_run)


def _run_and_commit(exe, storages, data, packed, gdev, nodes, keep, everything, timed):
    """Execute, then give each storage its result. With on-device checks, their rows are
    read now (``XLATORCH_CHECKS=sync``, a graph run for several devices) or when the
    results are next needed (``checks.settle``); a row that is set undoes the step and
    raises. Raises (after ``_fail``) if the execution fails."""
    try:
        t_run = time.perf_counter_ns()
        with timed("ExecuteDispatchTime"):
            arrays = [d.array for d in data]
            if exe.threads:
                from xlatorch.runtime.replication import run_replicated

                outs = run_replicated(exe, gdev, arrays, packed)
            else:
                outs = exe.compiled(arrays, packed)
    except Exception as e:
        failure.fail_storages(storages, e)
        raise
    if exe.checks is None:
        _commit(storages, outs, gdev, everything, t_run)
        return
    table = exe.checks
    # Per root: the data from before the step a failed check gives back, kept by the sync
    prevs = [None if k is None else st.prev for st, k in zip(storages, keep)] if keep else [None] * len(storages)
    _commit(storages, outs[:-1], gdev, everything, t_run)
    names = checks.where(table.rows, nodes)
    news = [st.value for st in storages]
    if table.in_graph:  # or its committed data, which holds it when its rows fired (the graph undid it)
        prevs = [d if back and keep[i][0] >= 0 else prevs[i] for i, (d, back) in enumerate(zip(news, table.undo))]
    u = checks.Unsettled(table, outs[-1], names, storages, news, prevs, keep.between if keep else ())
    if checks.DEFER and not exe.threads and not ir._multi and checks.deferrable(storages):
        checks.defer(u)  # the host goes on tracing while this runs
    else:
        checks.undo(u)  # reading the rows waits for this execution


_last_sync = 0
_last: list = []  # the newest execution's outputs, for wait()


def wait() -> None:
    """Block until the newest execution (and so every earlier one) has finished."""
    jax.block_until_ready(list(_last))
    EXECUTIONS.flush()
    checks.settle()


def _compile(
    nodes, leaves, leaf_kinds, root_refs, data, packed, donate, dev=0, keep=(), cut=None, spmd=None, once=False
):
    table = checks.Table()
    exe = _compile_fn(nodes, leaves, leaf_kinds, root_refs, data, packed, donate, dev, table, keep, cut, spmd, once)
    if table.rows:
        exe.checks = table
    return exe


def _compile_fn(
    nodes, leaves, leaf_kinds, root_refs, data, packed, donate, dev, table, keep, cut=None, spmd=None, once=False
):
    fn = lower_fn(plan(nodes, leaves, cut), leaf_kinds, root_refs, hlo_scopes(nodes), table, keep)
    local = placed = None
    if dev:  # a local device other than the default one (dp.DataParallel)
        from jax.sharding import SingleDeviceSharding

        from xlatorch.runtime.transfer import jax_device

        local = jax_device(dev)
        placed = SingleDeviceSharding(local)
    data_avals = [jax.ShapeDtypeStruct(d.aval[0], to_jax(d.aval[1]), sharding=placed) for d in data]
    packed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in packed]

    # Donation is per data parameter: buffers no live tensor holds any more.
    donate_mask = set(donate)
    kept = [i for i in range(len(data)) if i not in donate_mask]
    args = ([data_avals[i] for i in donate], [data_avals[i] for i in kept], packed_avals)

    def body(d, k, packed_args):
        return fn(_merge(d, k, donate_mask), packed_args)

    if spmd is not None:  # one program partitioned over the mesh (runtime/sharding.py)
        data_avals = [sharding.data_aval(d, a.dtype) for d, a in zip(data, data_avals)]
        return sharding.compile_sharded(body, data_avals, packed_avals, (donate, kept), spmd[2], spmd[0])
    from xlatorch.runtime.collectives import SPECS as COLLECTIVES

    if any(n.spec in COLLECTIVES for n in nodes):
        from xlatorch.runtime.spmd import compile_spmd

        return compile_spmd(body, args, [r.aval for r in _roots(nodes, leaves, root_refs)], donate, kept, table)
    lowered = jax.jit(body, donate_argnums=(0,), out_shardings=placed).lower(*args)
    compiled = compiler.compile(lowered, once)
    if local is not None:

        def call(arrays, packed_vals):
            packed_vals = [jax.device_put(p, local) for p in packed_vals]
            return compiled([arrays[i] for i in donate], [arrays[i] for i in kept], packed_vals)

        return Executable(call, xla=compiled)

    def call(arrays, packed_vals):
        return compiled([arrays[i] for i in donate], [arrays[i] for i in kept], packed_vals)

    return Executable(call, xla=compiled)


def _roots(nodes, leaves, root_refs):
    return [leaves[-1 - r] if r < 0 else nodes[r // 4096].outs[r % 4096] for r in root_refs]


def _merge(donated, kept, mask):
    out, di, ki = [], 0, 0
    for i in range(len(donated) + len(kept)):
        if i in mask:
            out.append(donated[di])
            di += 1
        else:
            out.append(kept[ki])
            ki += 1
    return out
