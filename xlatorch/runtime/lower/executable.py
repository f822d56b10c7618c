"""A graph compiled for one device: the compile request, the executable it makes, and the
memory check before an executable runs.

``CompileRequest`` carries what a compile needs; the executable keeps none of it (it would
keep the step's graph and its device buffers alive): its closures hold the lowering plan
(positions, not the IR), the compiled program and the donation order.
"""

from __future__ import annotations

import re
import warnings

import jax
import torch
from jax.sharding import SingleDeviceSharding

from xlatorch.runtime.base import config, memory, record, regions
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.source import fmt_src, user_frame
from xlatorch.runtime.base.topology import Groups, jax_device
from xlatorch.runtime.ir.emit import hlo_scopes
from xlatorch.runtime.lower import compiler, program_cache
from xlatorch.runtime.lower.function import lower_fn, plan, shared

__all__ = [
    "CompileRequest",
    "Executable",
    "OutOfMemory",
    "GraphMemory",
    "Body",
    "check_memory",
    "out_of_memory",
    "record_memory",
    "lowered_body",
    "stored_body",
    "compile_one",
    "roots",
]

# Donation is offered whenever shapes match; XLA declining it (layouts) is not the user's concern.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
# Equal host scalars of a graph read as one parameter (``compile_one``); ``XLATORCH_SHARE_SCALARS=0``: each apart.
SHARE_SCALARS = config.env("XLATORCH_SHARE_SCALARS")


class CompileRequest:
    """What compiling one graph needs: its cache ``key``; ``nodes``, ``leaves``, ``root_refs``
    (a collected graph); ``leaf_kinds`` and ``packed`` (``plan.collect.pack``); ``data`` (its
    device-data leaves); ``donate`` (positions in ``data`` whose buffers an output may reuse);
    ``dev`` (the local device); ``keep`` (``plan.keep.undoable``); ``cut`` (values computed by
    earlier stages); ``spmd`` (``multi.sharding.prepare``'s answer, or None); ``once`` (a graph
    expected to run once: compiled to compile fast, ``compiler.py``)."""

    __slots__ = ("key", "nodes", "leaves", "leaf_kinds", "root_refs", "data", "packed", "donate", "dev", "keep",
                 "cut", "spmd", "once")  # fmt: skip

    def __init__(self, key, nodes, leaves, leaf_kinds, root_refs, data, packed, donate=(), dev=0, keep=(),
                 cut=None, spmd=None, once=False):  # fmt: skip
        self.key, self.nodes, self.leaves, self.leaf_kinds, self.root_refs = key, nodes, leaves, leaf_kinds, root_refs
        self.data, self.packed, self.donate, self.dev, self.keep = data, packed, donate, dev, keep
        self.cut, self.spmd, self.once = cut, spmd, once


class Executable:
    """A compiled graph: ``compiled(arrays, packed)`` runs it for this process's device; a
    graph whose collectives span several local devices (``threads`` > 1) runs once for all
    of them through ``run_all([(arrays, packed) per device])``."""

    __slots__ = ("compiled", "run_all", "threads", "xla", "checks", "used", "need", "fast", "memory", "gid")

    def __init__(self, compiled, run_all=None, threads=0, xla=None):
        global _GRAPHS
        self.compiled = compiled
        self.run_all = run_all
        self.threads = threads
        self.xla = xla  # the jax Compiled (memory_analysis, as_text) for xlatorch.debug
        self.checks = None  # a checks.Table when the graph has on-device checks (an extra last output)
        self.used = 0  # when it last ran (for the in-memory cache's eviction)
        self.memory = GraphMemory.of(xla)  # XLA's buffer sizes, once per compile; None if unknown
        self.need = self.memory.new if self.memory is not None else 0  # new buffers a run allocates
        self.fast = 0  # compiled to compile fast: the runs left before it is compiled to run fast
        _GRAPHS += 1
        self.gid = _GRAPHS  # the graph's number in this process (``xlatorch.debug.graph_memory``)
        NEWEST[0] = self


_GRAPHS = 0  # executables made so far
# The executable made last, and the one that ran (or is about to run) last: the profiler's
# compile and execute spans carry their memory figures. (No step or graph: see the module.)
NEWEST: list = [None, None]


class GraphMemory:
    """The device memory one run of a compiled graph needs, in bytes, from XLA's memory
    analysis: ``argument`` (its inputs), ``output`` (of which ``alias`` reuse donated
    inputs), ``temp`` (temporaries), ``code`` (generated code). ``new`` is what a run
    allocates (outputs not aliased plus temporaries); ``peak`` adds the arguments."""

    __slots__ = ("argument", "output", "alias", "temp", "code", "new")

    def __init__(self, argument, output, alias, temp, code):
        self.argument, self.output, self.alias, self.temp, self.code = argument, output, alias, temp, code
        self.new = output - alias + temp

    @property
    def peak(self) -> int:
        return self.argument + self.new

    @staticmethod
    def of(compiled) -> GraphMemory | None:
        """``compiled``'s figures (a jax Compiled), or None where the backend has none."""
        try:
            m = compiled.memory_analysis()
            return GraphMemory(*(int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
                                 for k in ("argument", "output", "alias", "temp", "generated_code")))  # fmt: skip
        except Exception:  # not every backend reports it
            return None

    def as_dict(self) -> dict[str, int]:
        """The figures under the explainer's keys (``generated_code`` for ``code``)."""
        return {"argument": self.argument, "output": self.output, "alias": self.alias, "temp": self.temp,
                "generated_code": self.code}  # fmt: skip


# Samples per compile (``met.metrics_report()``): one per graph compiled.
_MEMORY_METRICS = (("CompiledGraphMemory", "peak"), ("CompiledGraphArgumentBytes", "argument"),
                   ("CompiledGraphOutputBytes", "output"), ("CompiledGraphAliasBytes", "alias"),
                   ("CompiledGraphTempBytes", "temp"), ("CompiledGraphCodeBytes", "code"))  # fmt: skip


def record_memory(exe: Executable) -> None:
    """Record a newly compiled graph's memory figures as metric samples."""
    m = exe.memory
    if m is not None:
        for name, attr in _MEMORY_METRICS:
            record.add_sample(name, getattr(m, attr))


class OutOfMemory(torch.OutOfMemoryError):
    """A graph's buffers do not fit in the device's free memory (checked before it runs; the
    exception PyTorch raises for a CUDA out-of-memory, a ``RuntimeError``)."""


_BIG = 1 << 28  # graphs allocating more than this are checked against free memory before they run


def check_memory(exe, gdev, nodes=(), reason=None) -> None:
    """Before ``exe`` runs on local device ``gdev``: count it in the device's peak
    (``memory.executing``), and raise ``OutOfMemory`` if its new buffers cannot fit in the
    device's free memory (graphs allocating over 256 MiB). ``nodes`` (the graph's IR nodes)
    and ``reason`` (what cut it) name the graph and its largest buffers in the error."""
    need = exe.need
    if need > _BIG:
        free = memory.available_bytes(jax_device(gdev))
        if free is not None and need > free:
            raise OutOfMemory(oom_report(exe, gdev, nodes, reason, free))
    memory.executing(gdev, need)
    NEWEST[1] = exe


def out_of_memory(error: BaseException, exe, gdev, nodes=(), reason=None) -> BaseException:
    """``error`` as an ``OutOfMemory`` with the graph's report when it is XLA's
    RESOURCE_EXHAUSTED (raised compiling or running a graph), else ``error`` itself."""
    if isinstance(error, OutOfMemory) or "RESOURCE_EXHAUSTED" not in str(error):
        return error
    free = memory.available_bytes(jax_device(gdev))
    oom = OutOfMemory(oom_report(exe, gdev, nodes, reason, free, first=str(error).strip().splitlines()[0]))
    oom.__cause__ = error
    return oom


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _nbytes(aval) -> int:
    shape, dtype = aval
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def largest_buffers(nodes, count: int = 3) -> list[str]:
    """The ``count`` largest values ``nodes`` compute, one line each: shape and dtype, size,
    the op that made it and the user's line (recorded for every large value, ``ir/ops.Info.big``)."""
    sized = []
    for n in nodes:
        for o in n.outs:
            if o is not None and type(o.aval) is tuple:
                sized.append((_nbytes(o.aval), o.aval, n))
    sized.sort(key=lambda t: -t[0])
    lines = []
    for size, (shape, dtype), n in sized[:count]:
        src = getattr(n, "src", None)
        at = f" at {fmt_src(src, full=True)}" if src is not None else ""
        name = getattr(n.spec, "name", str(n.spec)).removesuffix(".default")
        lines.append(f"{_size(size)}  {str(dtype).removeprefix('torch.')}{list(shape)} from aten::{name}{at}")
    return lines


def oom_report(exe, gdev, nodes, reason, free, first=None) -> str:
    """Why a graph does not fit on ``xla:gdev``: which graph (its number, the step, the cut and
    its line, the region), what it needs against what is free, its largest buffers. ``exe``:
    its executable (None when compiling it failed); ``first``: XLA's message, if it raised."""
    m = exe.memory if exe is not None else None
    region = regions.current() if regions.ACTIVE else None
    src = user_frame()
    what = f"graph {exe.gid}" if exe is not None else "a graph"
    step = COUNTERS["MarkStep"] - (reason == "mark_step")  # mark_steps before this one (the explainer's step)
    what += f" (step {step}, cut by {record.current_cause() or reason or 'a sync'}"
    what += f" at {fmt_src(src, full=True)}" if src is not None else ""
    what += f", torch_xla.compile region {region.name!r})" if region is not None and region.name else ")"
    avail = _size(free) if free is not None else "an unknown amount"
    if first is None:
        lines = [f"RESOURCE_EXHAUSTED: {what} needs {_size(m.new)} of new buffers on xla:{gdev}, and {avail} "
                 f"is free"]  # fmt: skip
    else:
        lines = [first, f"  {what} ran out of memory on xla:{gdev} ({avail} free now)"]
    if m is not None:
        lines.append(
            f"  needs: {_size(m.new)} new = outputs {_size(m.output - m.alias)} (not aliased to donated "
            f"inputs) + temporaries {_size(m.temp)}; arguments {_size(m.argument)} (on the device already)"
        )
    big = largest_buffers(nodes)
    if big:
        lines.append("  largest buffers:")
        lines += [f"    {b}" for b in big]
    lines.append("  the tensors computed by this graph were not computed")
    return "\n".join(lines)


class Body:
    """A graph's JAX function taking (donated data, kept data, packed scalars), with what
    compiling it needs: the abstract data and packed arguments in leaf order, the positions of
    the kept (not donated) data, and the sharding of a local device other than the default
    one (``dp.DataParallel``), or None. ``share``/``shared_fn``: the same function reading
    each distinct host scalar once (``function.Shared``), for ``compile_one``; None when the
    step's scalars are all distinct. ``program``: the graph's key for the lowered-program
    cache (``program_cache.graph_key``), or None; ``table``: its checks."""

    __slots__ = ("fn", "data_avals", "packed_avals", "donate", "kept", "placed", "share", "shared_fn", "program",
                 "table")  # fmt: skip

    def args(self) -> tuple:
        """Abstract arguments for ``fn``: (donated data, kept data, packed scalars)."""
        d = self.data_avals
        return [d[i] for i in self.donate], [d[i] for i in self.kept], self.packed_avals


def lowered_body(req: CompileRequest, table) -> Body:
    """``req``'s graph as a ``Body``; ``table`` (a ``checks.Table``) is filled while JAX traces it."""
    rows, scopes = plan(req.nodes, req.leaves, req.cut), hlo_scopes(req.nodes)
    fn = lower_fn(rows, req.leaf_kinds, req.root_refs, scopes, table, req.keep)
    b = Body()
    b.placed = placed = SingleDeviceSharding(jax_device(req.dev)) if req.dev else None
    b.data_avals = [jax.ShapeDtypeStruct(d.aval[0], to_jax(d.aval[1]), sharding=placed) for d in req.data]
    b.packed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in req.packed]
    # Donation is per data parameter: buffers no live tensor holds any more.
    b.donate = req.donate
    donate_mask = set(req.donate)
    b.kept = [i for i in range(len(req.data)) if i not in donate_mask]

    def over(f):
        def body(d, k, packed_args):
            return f(_merge(d, k, donate_mask), packed_args)

        return body

    body = over(fn)
    # Not with on-device checks: tracing the function again (the unshared one, later) would add
    # its check rows to ``table`` a second time.
    checked = not getattr(req.keep, "unchecked", False) and any(n.info.checked for n in req.nodes)
    b.share = shared(req.packed) if SHARE_SCALARS and not checked else None
    b.shared_fn = None
    if b.share is not None:
        b.shared_fn = over(lower_fn(rows, req.leaf_kinds, req.root_refs, scopes, table, req.keep, b.share))
    region = regions.current() if regions.ACTIVE else None
    if region is not None and region.name:  # the HLO module is jit_<name>: XLA's dumps carry the region's name
        body.__name__ = re.sub(r"\W", "_", region.name)
        if b.shared_fn is not None:
            b.shared_fn.__name__ = body.__name__
    b.fn = body
    b.table = table
    b.program = None
    return b


def stored_body(req: CompileRequest, table) -> Body:
    """``lowered_body`` for a graph that ``compile_one`` compiles: with its key for the
    lowered-program cache, if it has ``program_cache.MIN_NODES`` nodes or more."""
    b = lowered_body(req, table)
    b.program = program_cache.graph_key(req) if len(req.nodes) >= program_cache.MIN_NODES else None
    return b


def compile_one(body: Body, once: bool = False) -> Executable:
    """``body`` compiled for one device (``once``: to compile fast, ``compiler.py``).

    With equal host scalars (``body.share``) it compiles the function that reads each once,
    and a run whose scalars are no longer equal where those were compiles ``body.fn`` (all
    scalars apart) and runs that from then on (counter ``UnsharedScalarRecompile``): at most one
    more compile per graph, never one per changed value.

    A graph with a ``body.program`` key is compiled from its exported program, found in the
    lowered-program cache (``program_cache.py``; nothing traced) or exported and stored there."""
    args = body.args()

    def build(fn, share):
        """``fn`` compiled: (the function running it on (donated, kept, packed), the jax Compiled)."""
        if body.program is not None:
            text = program_cache.key_text(body.program, share)
            exported = program_cache.load(text, body.table)
            if exported is None:
                exported = program_cache.export(jax.jit(fn), args, text, body.table)
            if exported is not None:
                return _from_exported(exported, args, body.placed, once)
        compiled = compiler.compile(jax.jit(fn, donate_argnums=(0,), out_shardings=body.placed).lower(*args), once)
        return compiled, compiled

    first, compiled = build(body.shared_fn, body.share) if body.share is not None else build(body.fn, None)
    if body.share is None:  # never built again: the executable does not keep the key's text
        body.program = None
    donate, kept, share = body.donate, body.kept, body.share
    local = next(iter(body.placed.device_set)) if body.placed is not None else jax_device(0)  # where the scalars go
    general: list = []  # body.fn compiled, once a run's scalars do not fit ``share``
    groups = Groups(local)  # the scalars go to the device at each run, a group only when it changed

    def call(arrays, packed_vals):
        seen = [p.tobytes() for p in packed_vals]
        run = first
        if share is not None:
            if general:
                run = general[0]
            elif not groups.same(seen) and not share.fits(packed_vals, seen):
                COUNTERS["UnsharedScalarRecompile"] += 1
                COUNTERS["UncachedCompile"] += 1
                with record.TIMED("CompileTime"):
                    general.append(build(body.fn, None)[0])
                run = general[0]
        packed_vals = groups.send(packed_vals, seen)
        return run([arrays[i] for i in donate], [arrays[i] for i in kept], packed_vals)

    return Executable(call, xla=compiled)


def _from_exported(exported, args, placed, once):
    """``build``'s answer for a program exported by ``jax.export``. Donated data the program
    does not read is not donated (as ``jax.jit`` drops an unused argument, which ``exported.call``
    would take and donate): a tensor may still hold it."""
    read = set(exported.module_kept_var_idx)
    n = len(args[0])
    used = [i for i in range(n) if i in read]
    unused = [i for i in range(n) if i not in read]

    def outer(d_used, d_unused, kept, packed):
        d = [None] * n
        for i, x in zip(used, d_used):
            d[i] = x
        for i, x in zip(unused, d_unused):
            d[i] = x
        return exported.call(d, kept, packed)

    outer.__name__ = exported.fun_name  # the HLO module's name (``jit_<region>``, ``lowered_body``)
    d = args[0]
    with program_cache.calling(exported):
        lowered = jax.jit(outer, donate_argnums=(0,), out_shardings=placed).lower(
            [d[i] for i in used], [d[i] for i in unused], args[1], args[2])  # fmt: skip
    compiled = compiler.compile(lowered, once)

    if not unused:  # the program reads all of it (the usual case): no reordering per run

        def run(donated, kept, packed):
            return compiled(donated, [], kept, packed)

    else:

        def run(donated, kept, packed):
            return compiled([donated[i] for i in used], [donated[i] for i in unused], kept, packed)

    return run, compiled


def roots(nodes, leaves, root_refs) -> list:
    """The graph's root values (an output of a node, or a leaf)."""
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
