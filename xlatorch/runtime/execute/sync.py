"""Graph cutting: collect pending values, key the graph, compile on a miss, execute, commit.

At a sync every live storage with a pending value becomes an output of one computation per
device (a ``Step``). The graph's key is its structure (node hashes plus how nodes share
operands) and its leaves' avals: a plain tuple, hashed once per sync; device data and host
scalars are parameters, so a fixed-shape step hits the cache from its second occurrence on.
Executables are called asynchronously: nothing here waits for results. A step runs and
commits whole, or fails whole (runtime/execute/faults.py).
"""

from __future__ import annotations

import threading
import time
from itertools import repeat

import jax

from xlatorch.runtime.base import config, record, regions, topology
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.base.fork import check as check_fork
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.source import fmt_src, user_frame
from xlatorch.runtime.base.threads import BODIES, CHECKED_SINCE_SYNC, DEFERRED, LOCK, _in_backward
from xlatorch.runtime.execute import dry, faults, settle
from xlatorch.runtime.execute.compile import executable
from xlatorch.runtime.execute.execution import EXECUTIONS, uninterrupted
from xlatorch.runtime.execute.staged import may_donate, run_stages
from xlatorch.runtime.execute.transfer import from_array
from xlatorch.runtime.ir import failed
from xlatorch.runtime.ir import values as ir
from xlatorch.runtime.ir.failed import FailedValueError
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.lower import cache, checks
from xlatorch.runtime.lower.executable import CompileRequest, OutOfMemory, check_memory, lowered_body, out_of_memory
from xlatorch.runtime.lower.function import LoweringError
from xlatorch.runtime.multi import sharding
from xlatorch.runtime.multi.replication import ReplicaMismatch, collective_roots, run_replicated
from xlatorch.runtime.plan import births, keep, prechecks, stages
from xlatorch.runtime.plan.collect import collect, pack, release
from xlatorch.runtime.trace.bodies import BodyError
from xlatorch.runtime.trace.tensor import PENDING, drop_view_caches, pending_storages, reroot_lone_views

__all__ = ["sync", "wait", "Step", "EAGER"]

# The reason of eager mode's syncs, one per op (runtime/execute/eager.py): their compiles and
# executions are timed as torch_xla's EagerOpCompileTime / EagerOpExecuteTime.
EAGER = "eager"
_EAGER_METRICS = {"CompileTime": "EagerOpCompileTime", "ExecuteTime": "EagerOpExecuteTime"}


def _eager_timed(name: str):
    return record.TIMED(_EAGER_METRICS.get(name, name))


class Step:
    """One device's part of a sync: ``storages`` (their pending values are the roots) and their
    collected ``graph``; why (``reason``) and where (``dev``) it runs; whether it computes every
    pending value (``everything``); when the sync began (``t0``) and how it is timed
    (``timed``); ``once``: a graph expected to run once (compiled to compile fast).

    ``prepare`` adds what the cache key says: ``keep`` (what a failed check gives back,
    runtime/plan/keep.py), ``data`` (the device-data leaves), ``donate`` (which of them the
    executable may reuse), ``spmd`` (the mesh and shardings under ``xr.use_spmd()``), ``key``.
    A step lives for its sync only: an executable, a pending check and a births callback
    never keep it (it holds the step's graph and buffers)."""

    __slots__ = ("reason", "dev", "storages", "graph", "everything", "t0", "timed", "once",
                 "keep", "held", "data", "donate", "spmd", "key", "views")  # fmt: skip

    def __init__(self, reason, dev, storages, graph, everything, t0, timed, once=False):
        self.reason, self.dev, self.storages, self.graph = reason, dev, storages, graph
        self.everything, self.t0, self.timed, self.once = everything, t0, timed, once
        # The host's values of the graph's small integer values found deciding its checks
        # (``prechecks.decided``), by ``id(Out)``: its host stages and its results take them
        self.views = None

    def prepare(self):
        """Decide donation, what is kept for undo and the cache key; the cached executable or None."""
        g = self.graph
        leaves = g.leaves
        gdev = self.storages[0].dev
        kept = ()
        in_graph = False  # a checked step undoes itself in the graph (runtime/plan/keep.py)
        self.views = None
        if config.CHECKS and any(n.info.checked for n in g.nodes):
            self.views = views = {}
            if prechecks.decided(g.nodes, views=views):  # none can fire: the step runs unchecked
                kept = keep.UNCHECKED
            else:
                kept = keep.undoable(self.storages, g.nodes, leaves)
                in_graph = kept.in_graph = any(k is not None for k in kept) and keep.undo_in_graph(gdev)
        self.keep = kept
        self.data = data = [v for v in leaves if type(v) is Data]
        # Donate buffers no live tensor holds any more (or that the user marked donatable:
        # ``donor``), when an output can reuse them. Not the data a failed check gives back,
        # unless the graph gives it back itself (``in_graph``): reading it after the step's
        # outputs are written would make XLA copy every updated buffer.
        out_avals = {st.value.aval for st in self.storages}
        self.held = held = () if in_graph else {id(leaves[k[0]]) for k in kept if k is not None and k[0] >= 0}
        self.donate = tuple(i for i, v in enumerate(data) if id(v) not in held and may_donate(v, out_avals))
        self.spmd = sharding.prepare(data, self.storages) if topology.SPMD[0] else None  # (mesh, key part, outs)
        self.key = (tuple(g.enc), g.root_refs, tuple([v.sig for v in leaves]), self.donate, gdev, kept,
                    self.spmd and self.spmd[1], in_graph)  # fmt: skip
        if regions.ACTIVE or regions.CUSTOM:  # compiler options of a region, or the process's: another executable
            opts = regions.options_key()
            if opts is not None:
                self.key += (opts,)
        return _cached(self.key)


# The newest executable found in the cache, and its key: a loop's next step has the same key.
_LAST_HIT: list = [None, None]


def _cached(key):
    """The executable cached under ``key``, or None. Hashing the key walks the whole graph's
    encoding (tuples do not keep their hash); comparing it with the newest hit's key is a tenth
    of that (their node keys are the same objects), and that executable is still the one cached
    under it if it is still in the cache (where an eviction or a clear removes it)."""
    last_key, last = _LAST_HIT
    if last is not None and key == last_key and last in cache.CACHE.values():
        return last
    exe = cache.CACHE.get(key)
    if exe is not None:
        _LAST_HIT[:] = key, exe
    return exe


def sync(reason: str = "mark_step", dev: int | None = None, read=None) -> None:
    """Materialise every live pending tensor (of local device ``dev``, default: all devices),
    with one (cached) XLA execution per device. ``read``: the storage a host read wants; when
    its own graph is tiny and exact on the host (``_read_alone``), only that runs, there."""
    lock = None if ir._multi else LOCK  # see base/threads.LOCK
    if lock is not None:
        lock.acquire()
    try:
        phase = record.PHASE
        if reason == EAGER:
            _sync(reason, dev, _eager_timed)
        elif phase is not None:  # profiling: spans for the sync, its compile and execution
            with phase("xlatorch.sync", reason=reason):
                _sync(reason, dev, record.TIMED, read)
        else:  # otherwise that test is all the profiler costs a sync
            _sync(reason, dev, record.timed, read)
    finally:
        if lock is not None:
            lock.release()


def _sync(reason, dev, timed, read=None) -> None:
    check_fork(f"a sync ({reason})")
    if BODIES:
        raise BodyError(f"xlatorch: {BODIES[-1]} needs a value on the host ({reason}, at "
                        f"{fmt_src(user_frame(), full=True)}): a body is traced once and runs on the device, "
                        f"so it cannot read values (.item(), print, .cpu(), an op that falls back to CPU)")  # fmt: skip
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
    if ir._multi:
        # dp.DataParallel's threads record and sync without the lock: another device's thread
        # may make a pending value after the snapshot, which clearing PENDING would lose.
        everything = False
    if not storages:
        _ALONE[0] = 0
        if everything:
            PENDING.clear()
            CHECKED_SINCE_SYNC.clear()
        drop_view_caches()
        settle.settle()  # a sync reads the previous step's checks even when it has nothing to run
        return
    region = regions.current() if regions.ACTIVE else None
    if region is not None and region.full_graph and not region.ending:
        _cut_in_full_graph(region, reason)
    t0 = time.perf_counter_ns()
    reroot_lone_views(storages)
    graph = collect([st.value for st in storages])
    on_host = stages.on_host(graph.nodes, reason)  # the whole graph runs on the host (``Whole``)
    if read is not None and region is None and not graph.failed and not on_host:
        if _read_alone(read, reason, dev, t0, timed):
            return
    _ALONE[0] = 0
    if graph.failed:
        healthy, error = faults.split_failed(storages, graph.nodes)
        if error is not None:  # run what does not depend on the failure, then report it
            sync(reason, dev)
            err = FailedValueError(f"xlatorch: a tensor's value could not be computed: {error}")
            err.__cause__ = error
            ok = {id(st) for st in healthy}
            faults.raise_owned(err, [st for st in storages if id(st) not in ok])
            return
        storages = healthy
    if region is not None:
        _count_graph(region, graph, storages[0].dev)
    if not on_host or _downloads(graph):  # else it runs on the host without waiting: no cut
        _cut(reason, graph)
    step = Step(reason, dev, storages, graph, everything, t0, timed)
    if dry.ACTIVE[0]:
        _run_dry(step)
        return
    try:
        _run(step)
    except ReplicaMismatch:
        _run_in_two_parts(step)
    except LoweringError as le:
        # One op could not be lowered: it fails, what depends on it carries the error, the
        # rest of the step runs.
        n = step.graph.nodes[le.k]
        err = le.error
        err.xlatorch_source = getattr(n, "src", None)  # the op's line, when recorded (xlatorch.check reads it)
        err.add_note(f"xlatorch: raised while lowering {_op_name(n)}; the tensors computed from it carry this error")
        failed.fail_node(n, err)
        try:
            sync(reason, dev)
        except FailedValueError as fe:
            if failed.cause(fe) is not err:
                raise
        err.__suppress_context__ = True
        faults.raise_owned(err, [st for st in step.storages if failed.is_failed_storage(st)])
    except OutOfMemory as oom:
        if oom.__cause__ is None:  # the check before the run, not XLA's error (the run may have donated)
            _isolate(step, oom)
        raise
    else:
        drop_view_caches()  # first: a view's cached value would keep the graph linked
        if everything:
            release(graph)


def _cut(reason, graph) -> None:
    for hook in record.SYNC_HOOKS:  # xlatorch.debug: the graph-cut report
        hook(reason, len(graph.nodes))


def _downloads(graph) -> bool:
    """Whether running ``graph`` on the host downloads device data: then the host waits for the
    device, a graph cut (reported as one); reading only what the host holds, it does not."""
    return any(type(v) is Data and v.host is None for v in graph.leaves)


def _keep_on_host(graph) -> None:
    """A dry run of a graph a real run computes on the host: the device data it reads is
    downloaded and kept, as the host stage keeps it (a later read of it waits for nothing)."""
    for v in graph.leaves:
        if type(v) is Data and v.host is None:
            v.host = from_array(v.array, v.aval[1])


def _read_alone(st, reason, dev, t0, timed) -> bool:
    """A host read (``.item()``, ``.cpu()``) whose value's own graph is tiny and exact on the host
    (``stages.on_host``), where the whole pending graph is not: that graph alone runs there, and
    the other pending values stay pending, so the step's graph is not cut. A model's checks on
    its inputs (``pad_token_id in input_ids[:, [-1, 0]]``, ``torch.all(mask == 1)``) cost
    neither an execution nor a step in two graphs. Reported as a cut (``xlatorch.check``, the
    debug report) only when it downloads device data, as then the host waits for the device.
    False (nothing done) otherwise: the sync runs every pending value, as before."""
    if reason not in stages.HOST_READS or _ALONE[0] >= MAX_ALONE or ir._multi or topology.SPMD[0]:
        return False
    if type(st.value) is not ir.Out or not stages.tiny_and_exact(st.value):
        return False
    graph = collect([st.value])  # the nodes the walk just found exact
    if graph.failed:
        return False
    step = Step(reason, dev, [st], graph, False, t0, timed)
    waits = _downloads(graph)
    if dry.ACTIVE[0]:  # a dry run: the value as its CPU replay will read it (_run_dry's host graph)
        if waits:
            _cut(reason, graph)
        _run_dry(step)
        _ALONE[0] += 1
        return True
    if step.prepare() is not None:  # compiled before (a graph the host could not run): as before
        return False
    stage = stages.split(graph.nodes, graph.enc, graph.root_refs, st.dev, reason)
    if type(stage) is not stages.Whole:
        return False
    if waits:
        _cut(reason, graph)
    with uninterrupted():
        if not run_stages(step, stage, _commit):
            return False
    drop_view_caches()
    release(graph)  # nodes the pending values still read stay linked
    _ALONE[0] += 1
    _traced(t0)
    return True


# Reads run alone since the last sync of every pending value: after ``MAX_ALONE`` of them the
# next read syncs everything, as before. A loop that never calls ``mark_step`` and reads only
# such values (a check on its inputs) would otherwise grow one graph for as long as it runs.
MAX_ALONE = 32
_ALONE = [0]


def _run_in_two_parts(step: Step) -> None:
    """Run a replicated step whose program differed between the ``dp.DataParallel`` replicas
    (nothing ran): this replica's values that read no collective alone, then the rest (what
    every replica computes alike) as one program for all of them."""
    COUNTERS["ReplicaMismatch"] += 1
    shared = collective_roots(step.storages, step.graph.nodes)
    ids = {id(st) for st in shared}
    own = [st for st in step.storages if id(st) not in ids]
    if own:
        _run_part(own, step.reason, step.dev)
    try:
        _run_part(shared, step.reason, step.dev)
    except ReplicaMismatch:
        raise RuntimeError(
            f"xlatorch: the DataParallel replicas computed different values from their collectives in one step "
            f"(device {step.dev}, {step.reason}): every replica must run the same program (the same collectives "
            f"on tensors of the same shapes, and the same computation on their results)"
        ) from None


def _where(region) -> str:
    name = f" {region.name!r}" if region.name else ""
    at = f" entered at {fmt_src(region.where, full=True)}" if region.where else ""
    return f"torch_xla.compile region{name}{at}"


def _cut_in_full_graph(region, reason) -> None:
    """Raise: a sync inside a ``full_graph`` region would run part of its graph before its end."""
    what = record.current_cause() or reason
    src = user_frame()
    raise RuntimeError(
        f"Unexpected execution happens inside the compiled function, exiting: {what} at {fmt_src(src, full=True)} "
        f"would run part of the graph of the {_where(region)} before the region ends (full_graph=True). "
        f"Move it out of the region, or compile without full_graph to run the region in pieces."
    )


def _count_graph(region, graph, gdev) -> None:
    """Count a graph made inside regions with ``max_different_graphs``; raise at one too many,
    naming how it differs from those seen (the compile explainer's account)."""
    sessions = list(region.sessions())
    if not sessions:
        return
    key = (tuple(graph.enc), graph.root_refs, tuple(v.sig for v in graph.leaves))
    for s in sessions:
        if key in s.keys:
            continue
        explainer = record.GRAPH_DIFF[0] if record.GRAPH_DIFF else None
        summary = explainer.summary(key + ((), gdev), graph.nodes) if explainer is not None else None
        if len(s.keys) >= s.limit:
            lines = explainer.difference(summary, s.summaries) if explainer is not None else []
            src = user_frame()
            at = "" if src is None or src[:2] == (region.where or ())[:2] else f" at {fmt_src(src, full=True)}"
            raise RuntimeError(
                f"Maximum number of different graphs allowed per function exceeded: {s.limit}\n"
                f"The {_where(region)} produced its graph number {len(s.keys) + 1}{at} "
                f"(max_different_graphs={s.limit}); it differs from the closest one before:"
                + "".join(f"\n  {line}" for line in lines or ["(no difference found from the graphs before)"])
            )
        s.keys.add(key)
        s.summaries.append(summary)


def _op_name(n) -> str:
    name = n.spec.name.removesuffix(".default")
    src = getattr(n, "src", None)
    return f"aten::{name}" + (f" at {fmt_src(src, full=True)}" if src is not None else "")


def _isolate(step: Step, error) -> None:
    """After ``error`` stopped a step's graph before it ran: run its independent parts one by one.

    Parts that run are committed; a part that fails again keeps, for each tensor the step
    updated in place, its data from before the step, and the rest of its tensors carry
    the error."""
    parts = faults.components(step.storages, step.graph.nodes)
    if len(parts) == 1:
        faults.give_back_or_fail(step.storages, error)
        return
    for part in parts:
        try:
            _run_part(part, step.reason, step.dev)
        except OutOfMemory as e:
            faults.give_back_or_fail(part, e)


def _run_part(part, reason, dev, once=False) -> None:
    t0 = time.perf_counter_ns()
    _run(Step(reason, dev, part, collect([st.value for st in part]), False, t0, record.timed, once))


def _run(step: Step) -> None:
    """Compile (once) and run the step's graph; commit its values."""
    gdev = step.storages[0].dev
    reason, dev = step.reason, step.dev

    def hoisted(part) -> None:  # runs the optimizer state's constants apart; keeps no Step
        _run_part(part, reason, dev, once=True)

    while True:
        exe = step.prepare()
        if exe is None and step.held and keep.undo_in_graph(gdev, [v for v in step.graph.leaves if id(v) in step.held]):
            continue  # keeping the old data would not fit: this process now undoes in the graph
        if exe is None:
            settle.settle()  # the previous step's check rows, before anything here runs on the device
        if exe is None and step.spmd is None:
            if births.ENABLED:
                order = births.hoist(step.storages, step.graph.nodes, step.key, hoisted, _syncs)
                if order is not None:  # optimizer state computed first: this graph is the next step's
                    step.storages, step.graph, step.once = order, collect([st.value for st in order]), False
                    continue
            # A graph whose shapes changed since it last ran may run as stages.
            g = step.graph
            stage = stages.split(g.nodes, g.enc, g.root_refs, gdev, step.reason)
            if stage is not None:
                with uninterrupted():  # a stage that donated runs and commits whole
                    staged = run_stages(step, stage, _commit)
                if staged:
                    _traced(step.t0)
                    return
        break
    g = step.graph
    packed, leaf_kinds = pack(g.leaves, step.key[2])
    try:
        if exe is None or exe.fast:
            req = CompileRequest(step.key, g.nodes, g.leaves, leaf_kinds, g.root_refs, step.data, packed, step.donate,
                                 gdev, step.keep, None, step.spmd, step.once)  # fmt: skip
            exe = executable(req, step.timed)
        else:
            COUNTERS["CachedCompile"] += 1
    except LoweringError:
        raise  # the caller fails just that node
    except Exception as e:
        e = out_of_memory(e, None, gdev, g.nodes, step.reason)
        faults.fail_storages(step.storages, e)
        raise e
    check_memory(exe, gdev, g.nodes, step.reason)
    record.add_sample("TensorsGraphSize", len(g.nodes))
    cache.touch(exe)
    # The previous step's check rows, read as late as possible: the host prepared this step
    # while it ran. A failure found here raises before this step runs or donates anything.
    settle.settle()
    # From here the step's buffers are donated: it runs and commits whole, or fails whole.
    try:
        with uninterrupted():
            _run_and_commit(exe, step, packed)
    finally:
        _traced(step.t0)


def _run_dry(step: Step) -> None:
    """A dry run's sync (``execute/dry.py``): report the compile a real run would make (through
    the same hooks, without an executable; its lowering traced by JAX, not compiled) and give
    every root data of its shape only. An op whose lowering fails raises its error here, as
    the real run's sync would, with ``xlatorch_source`` set to the op's line."""
    step.prepare()
    g = step.graph
    gdev = step.storages[0].dev
    req = None
    if stages.on_host(g.nodes, step.reason):  # a real run computes it on the host: no compile
        _keep_on_host(g)
    elif dry.first_time(step.key):
        packed, leaf_kinds = pack(g.leaves)
        req = CompileRequest(step.key, g.nodes, g.leaves, leaf_kinds, g.root_refs, step.data, packed, step.donate,
                             gdev, step.keep, None, step.spmd, step.once)  # fmt: skip
        for hook in record.COMPILE_HOOKS:
            hook(req, None, 0)
    _give(step, [dry.DryArray(st.value.aval[0], to_jax(st.value.aval[1]), source=st.value) for st in step.storages])
    if req is not None and dry.LOWER[0]:
        body = lowered_body(req, checks.Table())
        try:
            jax.eval_shape(body.fn, *body.args())
        except LoweringError as le:
            n, err = g.nodes[le.k], le.error
            err.xlatorch_source = getattr(n, "src", None)
            err.add_note(f"xlatorch: raised while lowering {_op_name(n)}; a real run raises it at this sync")
            raise err from None


def _traced(t0) -> None:
    global _last_sync, _syncs
    _syncs += 1
    now = time.perf_counter_ns()
    if _last_sync:
        # Host time of the step outside the sync itself: op tracing plus the user's Python.
        record.add_sample("LazyTracing", t0 - _last_sync)
    _last_sync = now


def _give(step: Step, arrays) -> None:
    """Each of the step's storages takes its array (or ``Data``: a staged step's value, which
    may be held on the host) as device data: none is pending any more."""
    gdev = step.storages[0].dev
    # A decode loop's next position, held on the host too (a staged step's Data has it already)
    carried = None
    whole = arrays and type(arrays[0]) is not Data
    if whole and step.keep is keep.UNCHECKED and not topology.SPMD[0] and not dry.ACTIVE[0]:
        carried = prechecks.carried([st.value for st in step.storages], step.views)
    for st, arr, host in zip(step.storages, arrays, carried or repeat(None)):
        st.set(arr if type(arr) is Data else Data(arr, st.value.aval, gdev, host))
        st.prev = None
    if step.everything:
        PENDING.clear()
        CHECKED_SINCE_SYNC.clear()
    else:
        for st in step.storages:
            PENDING.pop(st.sid, None)


def _commit(step: Step, outs, t_run, ran=None) -> None:
    """Give each storage its result (an array, or ``Data``): they are no longer pending. A
    staged step (``Data``) says what ran on the device: ``ran``, its last compiled stage's
    arrays, or None when every stage ran on the host (no execution to count or wait for)."""
    _give(step, outs)
    if outs and type(outs[0]) is Data:
        if ran is None:
            return
        outs = ran
    _last[:] = outs
    EXECUTIONS.started(outs, t_run, "EagerOpExecuteTime" if step.reason == EAGER else "ExecuteTime")


def _run_and_commit(exe, step: Step, packed) -> None:
    """Execute, then give each storage its result. With on-device checks, their rows are
    read now (``XLATORCH_CHECKS=sync``, a graph run for several devices) or when the
    results are next needed (``settle.settle``); a row that is set undoes the step and
    raises. Raises (after failing the step's tensors) if the execution fails."""
    storages, gdev, kept = step.storages, step.storages[0].dev, step.keep
    try:
        t_run = time.perf_counter_ns()
        with step.timed("ExecuteDispatchTime"):
            arrays = [d.array for d in step.data]
            if exe.threads:
                outs = run_replicated(exe, gdev, arrays, packed, step.key[:4] + step.key[5:])  # the key but the device
            else:
                outs = exe.compiled(arrays, packed)
    except ReplicaMismatch:
        raise  # nothing ran: the step runs again in two parts (_run_in_two_parts)
    except Exception as e:
        e = out_of_memory(e, exe, gdev, step.graph.nodes, step.reason)
        faults.fail_storages(storages, e)
        raise e
    if exe.checks is None:
        _commit(step, outs, t_run)
        return
    table = exe.checks
    # Per root: the data from before the step a failed check gives back, kept by the sync
    prevs = [None if k is None else st.prev for st, k in zip(storages, kept)] if kept else [None] * len(storages)
    _commit(step, outs[:-1], t_run)
    names = checks.where(table.rows, step.graph.nodes)
    news = [st.value for st in storages]
    if table.in_graph:  # or its committed data, which holds it when its rows fired (the graph undid it)
        prevs = [d if back and kept[i][0] >= 0 else prevs[i] for i, (d, back) in enumerate(zip(news, table.undo))]
    u = settle.Unsettled(table, outs[-1], names, storages, news, prevs, kept.between if kept else ())
    if config.CHECKS_DEFER and not exe.threads and not ir._multi and settle.deferrable(storages):
        settle.defer(u)  # the host goes on tracing while this runs
    else:
        settle.undo(u)  # reading the rows waits for this execution


_last_sync = 0
_syncs = 0  # syncs that ran a graph (births.hoist tells births every step by it)
_last: list = []  # the newest execution's outputs, for wait()


def wait() -> None:
    """Block until the newest execution (and so every earlier one) has finished.

    An output of it that a newer execution took (donated: another thread's step began after
    it) is skipped; that execution is not committed yet, and its own commit is the next wait's."""
    for _ in range(3):
        try:
            jax.block_until_ready([a for a in list(_last) if not a.is_deleted()])
            break
        except RuntimeError as e:  # donated between the test and the wait: look again
            if "delete" not in str(e) and "donat" not in str(e):
                raise
    EXECUTIONS.flush()
    settle.settle()
