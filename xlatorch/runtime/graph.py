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
import jax.numpy as jnp
import numpy as np
import torch

from xlatorch.runtime import births, checks, failure, ir, record
from xlatorch.runtime.dtypes import PY_SCALAR_JAX, to_jax, weak
from xlatorch.runtime.emit import hlo_scopes
from xlatorch.runtime.execution import EXECUTIONS, uninterrupted
from xlatorch.runtime.failure import FailedValueError
from xlatorch.runtime.ir import Data, Out, Scalar, operands
from xlatorch.runtime.record import COUNTERS
from xlatorch.runtime.tensor import (
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
# keep every one (about 1 MB each).
CACHE_SIZE = int(os.environ.get("XLATORCH_EXECUTABLE_CACHE_SIZE", "512"))
_uses = itertools.count()


def set_cache_size(n: int) -> None:
    """Keep at most ``n`` compiled graphs in memory (evicting the least recently used now)."""
    global CACHE_SIZE
    CACHE_SIZE = max(1, int(n))
    _evict()


def _evict() -> None:
    while len(CACHE) > CACHE_SIZE:
        oldest = min(CACHE, key=lambda k: CACHE[k].used)
        del CACHE[oldest]
        COUNTERS["CompileCacheEviction"] += 1


# Donation is offered whenever shapes match; XLA declining it (layouts) is not the user's concern.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


class Executable:
    """A compiled graph: ``compiled(arrays, packed)`` runs it for this process's device; a
    graph whose collectives span several local devices (``threads`` > 1) runs once for all
    of them through ``run_all([(arrays, packed) per device])``."""

    __slots__ = ("compiled", "run_all", "threads", "xla", "checks", "used", "need")

    def __init__(self, compiled, run_all=None, threads=0, xla=None):
        self.compiled = compiled
        self.run_all = run_all
        self.threads = threads
        self.xla = xla  # the jax Compiled (memory_analysis, as_text) for xlatorch.debug
        self.checks = None  # a checks.Table when the graph has on-device checks (an extra last output)
        self.used = 0  # when it last ran (for the in-memory cache's eviction)
        self.need = _bytes_needed(xla)  # new buffers a run allocates (outputs + temporaries)


class _Ref:
    """A reference to an earlier value in a lowering plan: ``(kind, index, output)``."""

    __slots__ = ("kind", "i", "j")

    def __init__(self, kind, i, j=0):
        self.kind, self.i, self.j = kind, i, j


def _collect(roots):
    """Post-order nodes, leaves in first-use order, the sharing-aware encoding, and whether
    a failed value is among the nodes. Runs at every sync over the whole graph: kept tight."""
    order: dict[int, int] = {}  # id(node) -> position
    nodes = []
    leaf_pos: dict[int, int] = {}
    leaves = []
    enc = []
    failed = False
    failed_spec = failure._SPEC  # None until some value has failed

    def leaf(v) -> int:
        i = leaf_pos.get(id(v))
        if i is None:
            i = leaf_pos[id(v)] = len(leaves)
            leaves.append(v)
        return -1 - i

    for root in roots:
        if id(root.node) in order:
            continue
        stack = [(root.node, None)]
        while stack:
            n, ops = stack.pop()
            if id(n) in order:
                continue
            if ops is None:  # first visit: operands first
                ops = operands(n.args)
                stack.append((n, ops))
                for v in reversed(ops):
                    if type(v) is Out and id(v.node) not in order:
                        stack.append((v.node, None))
                continue
            refs = tuple(order[id(v.node)] * 4096 + v.idx if type(v) is Out else leaf(v) for v in ops)
            enc.append((n.key, refs))
            order[id(n)] = len(nodes)
            nodes.append(n)
            if n.spec is failed_spec:
                failed = True
    root_refs = tuple(order[id(r.node)] * 4096 + r.idx if type(r) is Out else leaf(r) for r in roots)
    return nodes, leaves, enc, root_refs, failed


def _plan(nodes, leaves):
    """A lowering plan that references values by position, not the IR itself.

    Executables must not keep the step's IR (and its device buffers) alive.
    """
    order = {id(n): i for i, n in enumerate(nodes)}
    lpos = {id(v): i for i, v in enumerate(leaves)}

    def tmpl(a):
        t = type(a)
        if t is Out:
            return _Ref("n", order[id(a.node)], a.idx)
        if t is Data or t is Scalar:
            return _Ref("l", lpos[id(a)])
        if t is tuple:
            return tuple(tmpl(x) for x in a)
        return a

    return [(n.spec, tuple(tmpl(a) for a in n.args), n.info) for n in nodes]


def _lower_fn(plan, leaf_kinds, root_refs, scopes=None, table=None, keep=()):
    """The JAX function computing the roots from (device data..., packed scalars...);
    ``scopes``: per-node names for the HLO metadata (``XLA_HLO_DEBUG``), or None.

    When nodes have on-device checks (``runtime/checks.py``), one more output holds their
    ``[bad, value, position]`` rows, and ``table`` (a ``checks.Table``) gets each row's node,
    exception type and message, and each root's mask of the rows it depends on (filled
    while JAX traces). A root with ``keep[i]`` set (its storage's data from before the
    step is leaf ``keep[i][0]``) gives that leaf back when a row it depends on, or a row of a
    checked node traced before its last write (``keep[i][1]``), is set."""
    from xlatorch.runtime.emit import emit_node

    if table is None:  # a dump: the checks' rows are computed all the same
        from xlatorch.runtime.checks import Table

        table = Table()

    def fn(data, packed):
        table.clear()  # filled anew by each trace
        leaf_vals = []
        for kind in leaf_kinds:
            if kind[0] == "d":
                leaf_vals.append(data[kind[1]])
            else:
                v = packed[kind[0]][kind[1]]
                leaf_vals.append(weak(v) if kind[2] else v)
        vals = []

        def get(a):
            if type(a) is _Ref:
                return leaf_vals[a.i] if a.kind == "l" else vals[a.i][a.j]
            if type(a) is tuple:
                return tuple(get(x) for x in a)
            return a

        found: list = []
        for k, (spec, args, info) in enumerate(plan):
            found_k: list = []
            try:
                vals.append(emit_node(spec, tuple(get(a) for a in args), info, scopes[k] if scopes else None, found_k))
            except Exception as e:
                raise LoweringError(k, e) from e
            table.add_node(k, _node_refs(args), [c for c in found_k if c is not None], found)
        outs = tuple(leaf_vals[-1 - r] if r < 0 else vals[r // 4096][r % 4096] for r in root_refs)
        if not found:
            return outs
        rows = jnp.stack([jnp.stack([jnp.asarray(x).astype(jnp.int64) for x in c[:3]]) for c in found])
        table.set_roots([None if r < 0 else r // 4096 for r in root_refs])
        kept = []
        for i, o in enumerate(outs):
            m = table.undo_mask(i, keep[i][1]) if keep and keep[i] is not None else 0
            if m:  # a failed check gives back the data from before the step
                fired = jnp.any(rows[np.array([b for b in range(len(found)) if m >> b & 1]), 0] != 0)
                o = jnp.where(fired, leaf_vals[keep[i][0]].astype(o.dtype), o)
            kept.append(o)
        return tuple(kept) + (rows,)

    return fn


class LoweringError(Exception):
    """Node ``k``'s lowering raised ``error`` while a graph was traced."""

    def __init__(self, k: int, error: Exception):
        super().__init__(f"lowering node {k} failed: {type(error).__name__}: {error}")
        self.k, self.error = k, error


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


def _node_refs(args, out=None) -> list:
    """The plan positions of the nodes whose outputs ``args`` read."""
    out = [] if out is None else out
    for a in args:
        if type(a) is _Ref:
            if a.kind == "n":
                out.append(a.i)
        elif type(a) is tuple:
            _node_refs(a, out)
    return out


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
        return
    t0 = time.perf_counter_ns()
    reroot_lone_views(storages)
    roots = [st.value for st in storages]
    nodes, leaves, enc, root_refs, any_failed = _collect(roots)
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


def _run_part(part, reason, dev) -> None:
    t0 = time.perf_counter_ns()
    nodes, leaves, enc, root_refs, _ = _collect([st.value for st in part])
    _run_storages(part, nodes, leaves, enc, root_refs, reason, dev, record.timed, False, t0)


def _run_storages(storages, nodes, leaves, enc, root_refs, reason, dev, timed, everything, t0) -> None:
    """Compile (once) and run the graph computing ``storages``' pending values; commit them."""
    roots = [st.value for st in storages]
    keep = ()
    if checks.ENABLED and any(n.info.checked for n in nodes):
        keep = _undoable(storages, nodes, leaves)
    data = [v for v in leaves if type(v) is Data]
    # Donate buffers no live tensor holds any more, when an output can reuse them.
    out_avals = {r.aval for r in roots}
    donate = tuple(i for i, v in enumerate(data) if v.holders == 0 and v.aval in out_avals)
    gdev = storages[0].dev
    key = (tuple(enc), root_refs, tuple(v.sig for v in leaves), donate, gdev, keep)
    exe = CACHE.get(key)
    if exe is None and births.ENABLED:
        order = births.hoist(storages, nodes, key, lambda part: _run_part(part, reason, dev))
        if order is not None:  # optimizer state computed first: this graph is the next step's
            nodes, leaves, enc, root_refs, _ = _collect([st.value for st in order])
            return _run_storages(order, nodes, leaves, enc, root_refs, reason, dev, timed, everything, t0)
    packed, leaf_kinds = _pack(leaves)
    try:
        if exe is None:
            COUNTERS["UncachedCompile"] += 1
            COUNTERS["CreateCompileHandles"] += 1  # torch_xla's name for the same event
            with timed("CompileTime") as tm:
                exe = _compile(nodes, leaves, leaf_kinds, root_refs, data, packed, donate, gdev, keep)
            record.add_sample("InputOutputAliasCount", len(donate))  # buffers the executable may reuse
            exe.used = next(_uses)
            CACHE[key] = exe
            if len(CACHE) > CACHE_SIZE:
                _evict()
            for hook in record.COMPILE_HOOKS:  # xlatorch.debug: the compile explainer
                hook(key, nodes, leaves, root_refs, exe, time.perf_counter_ns() - tm.t0)
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
    # From here the step's buffers are donated: it runs and commits whole, or fails whole.
    with uninterrupted():
        failed = _run_and_commit(exe, storages, data, packed, gdev, nodes, keep, everything, timed)
    global _last_sync
    now = time.perf_counter_ns()
    if _last_sync:
        # Host time of the step outside the sync itself: op tracing plus the user's Python.
        record.add_sample("LazyTracing", t0 - _last_sync)
    _last_sync = now
    if failed is not None:
        error, fired = failed
        failure.raise_owned(error, [st for st, m in zip(storages, exe.checks.masks) if m & fired])


def _run_and_commit(exe, storages, data, packed, gdev, nodes, keep, everything, timed):
    """Execute, then give each storage its result; returns ``(error, fired rows)`` when an
    on-device check failed, else None. Raises (after ``_fail``) if the execution fails."""
    try:
        t_run = time.perf_counter_ns()
        with timed("ExecuteDispatchTime"):
            arrays = [d.array for d in data]
            if exe.threads:
                from xlatorch.runtime.replication import run_replicated

                outs = run_replicated(exe, gdev, arrays, packed)
            else:
                outs = exe.compiled(arrays, packed)
            failed = None
            if exe.checks is not None:  # reading the rows waits for this execution (on CPU it already ran)
                failed = checks.failure(exe.checks.rows, outs[-1], nodes)
                outs = outs[:-1]
    except Exception as e:
        failure.fail_storages(storages, e)
        raise
    if failed is None:
        for st, arr in zip(storages, outs):
            st.set(Data(arr, st.value.aval, gdev))
            st.prev = None
    else:  # a check fired: what depends on the failed op carries the error (or has its old data back)
        error, fired = failed
        for i, (st, arr, mask) in enumerate(zip(storages, outs, exe.checks.masks)):
            if mask & fired and not (keep and keep[i] is not None):
                failure.fail_storages([st], error)
            else:
                st.set(Data(arr, st.value.aval, gdev))
                st.prev = None
    if everything:
        PENDING.clear()
    else:
        for st in storages:
            PENDING.pop(st.sid, None)
    _last[:] = outs
    EXECUTIONS.started(outs, t_run)
    return failed


def _undoable(storages, nodes, leaves) -> tuple:
    """Per root: None, or ``(leaf, before)`` when its storage held device data before the step
    (leaf ``leaf`` of the graph) that a failed check gives back; ``before``: a bit mask of
    the checked nodes its thread traced before the storage's last write. Part of the graph's key."""
    lpos = {id(v): i for i, v in enumerate(leaves)}
    ticks = [(k, n.tick) for k, n in enumerate(nodes) if n.info.checked]
    keep = []
    for st in storages:
        p = st.prev
        j = -1 if p is None or p.aval != st.value.aval else lpos.get(id(p), -1)
        if j < 0:
            keep.append(None)
            continue
        before = 0
        for k, (t, who) in ticks:
            if t < st.gen and who == st.owner:  # traced after the check, by the same thread
                before |= 1 << k
        keep.append((j, before))
    return tuple(keep)


_last_sync = 0
_last: list = []  # the newest execution's outputs, for wait()


def wait() -> None:
    """Block until the newest execution (and so every earlier one) has finished."""
    jax.block_until_ready(list(_last))
    EXECUTIONS.flush()


def _pack(leaves):
    """Host scalars grouped by dtype into one array each: one transfer per dtype, not per scalar."""
    groups: dict = {}  # packed dtype -> (group index, values)
    kinds = []
    nd = 0
    for v in leaves:
        if type(v) is Data:
            kinds.append(("d", nd))
            nd += 1
        else:
            # Python numbers are weakly typed, as in PyTorch: 2.5 * float32 stays float32.
            # A precision mode may pack them wider than 0-d tensors of their dtype.
            dt = to_jax(v.aval[1]) if v.tensor else PY_SCALAR_JAX[v.aval[1]]
            gi, vals = groups.setdefault(dt, (len(groups), []))
            kinds.append((gi, len(vals), not v.tensor))
            vals.append(v.value)
    packed = [np.asarray(vals, dtype=dt) for dt, (_, vals) in groups.items()]
    return packed, kinds


def _compile(nodes, leaves, leaf_kinds, root_refs, data, packed, donate, dev=0, keep=()):
    table = checks.Table()
    exe = _compile_fn(nodes, leaves, leaf_kinds, root_refs, data, packed, donate, dev, table, keep)
    if table.rows:
        exe.checks = table
    return exe


def _compile_fn(nodes, leaves, leaf_kinds, root_refs, data, packed, donate, dev, table, keep):
    plan = _plan(nodes, leaves)
    fn = _lower_fn(plan, leaf_kinds, root_refs, hlo_scopes(nodes), table, keep)
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

    from xlatorch.runtime.collectives import SPECS as COLLECTIVES

    if any(n.spec in COLLECTIVES for n in nodes):
        from xlatorch.runtime.spmd import compile_spmd

        return compile_spmd(body, args, [r.aval for r in _roots(nodes, leaves, root_refs)], donate, kept, table)
    compiled = jax.jit(body, donate_argnums=(0,), out_shardings=placed).lower(*args).compile()
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
