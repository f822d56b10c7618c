"""Which program a graph compiles to, and the executable cache's lookup.

A graph compiles for one device (runtime/lower/executable.py), as one ``shard_map`` program
over the replicas when it holds collectives (runtime/multi/spmd.py), or as one program XLA
partitions by its inputs' shardings under ``xr.use_spmd()`` (runtime/multi/sharding.py).
``executable`` finds it in the cache (runtime/lower/cache.py) or compiles it, and compiles
again to run fast a graph compiled to compile fast that keeps running (compiler.py).
"""

from __future__ import annotations

import time

from xlatorch.runtime.base import record
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.lower import cache, checks, compiler
from xlatorch.runtime.lower.executable import (
    CompileRequest,
    Executable,
    compile_one,
    lowered_body,
    record_memory,
    roots,
    stored_body,
)
from xlatorch.runtime.multi import sharding
from xlatorch.runtime.multi.spmd import compile_spmd
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES

__all__ = ["executable", "compile_graph"]


def executable(req: CompileRequest, timed) -> Executable:
    """The executable cached under ``req.key``, compiled on a miss (``req.once``: for a graph
    expected to run once or a few times, ``runtime/lower/compiler.py``)."""
    exe = cache.CACHE.get(req.key)
    if exe is not None:
        COUNTERS["CachedCompile"] += 1
        if exe.fast:
            exe.fast -= 1
            if not exe.fast:  # expected to run once, it keeps running: compile it to run fast
                req.once = False
                try:
                    with timed("CompileTime"):
                        better = compile_graph(req)
                except Exception:  # an optimization only: the graph runs as compiled before
                    return exe
                COUNTERS["OptimizedRecompile"] += 1
                cache.touch(better)
                exe = cache.CACHE[req.key] = better
        return exe
    COUNTERS["UncachedCompile"] += 1
    COUNTERS["CreateCompileHandles"] += 1  # torch_xla's name for the same event
    cache.missed(req.key)
    with timed("CompileTime") as tm:
        exe = compile_graph(req)
    if req.once and compiler.options(True) != compiler.options() and compiler.worth_optimizing(exe.xla):
        exe.fast = compiler.RUNS_BEFORE_OPTIMIZING
    record.add_sample("InputOutputAliasCount", len(req.donate))  # buffers the executable may reuse
    record_memory(exe)  # CompiledGraphMemory ...
    cache.add(req.key, exe)
    for hook in record.COMPILE_HOOKS:  # xlatorch.debug: the compile explainer
        hook(req, exe, time.perf_counter_ns() - tm.t0)
    return exe


def compile_graph(req: CompileRequest) -> Executable:
    """Compile ``req``'s graph: for one device, as an SPMD program over the replicas (a graph
    with collectives), or partitioned over the mesh (``req.spmd``)."""
    table = checks.Table()
    if req.spmd is not None:  # one program partitioned over the mesh (runtime/multi/sharding.py)
        body = lowered_body(req, table)
        data_avals = [sharding.data_aval(d, a.dtype) for d, a in zip(req.data, body.data_avals)]
        mesh, _, outs = req.spmd
        exe = sharding.compile_sharded(body.fn, data_avals, body.packed_avals, (body.donate, body.kept), outs, mesh)
    elif any(n.spec in COLLECTIVES for n in req.nodes):
        body = lowered_body(req, table)
        out_avals = [r.aval for r in roots(req.nodes, req.leaves, req.root_refs)]
        exe = compile_spmd(body.fn, body.args(), out_avals, body.donate, body.kept, table)
    else:  # through the lowered-program cache (runtime/lower/program_cache.py)
        exe = compile_one(stored_body(req, table), req.once)
    if table.rows:
        exe.checks = table
    return exe
