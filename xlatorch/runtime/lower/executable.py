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

from xlatorch.runtime.base import memory, regions
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.base.topology import jax_device
from xlatorch.runtime.ir.emit import hlo_scopes
from xlatorch.runtime.lower import compiler
from xlatorch.runtime.lower.function import lower_fn, plan

__all__ = [
    "CompileRequest",
    "Executable",
    "OutOfMemory",
    "Body",
    "check_memory",
    "lowered_body",
    "compile_one",
    "roots",
]

# Donation is offered whenever shapes match; XLA declining it (layouts) is not the user's concern.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


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


def check_memory(exe, gdev) -> None:
    """Raise ``OutOfMemory`` before ``exe`` runs on local device ``gdev`` if its new buffers
    cannot fit in the device's free memory (graphs allocating over 256 MiB)."""
    if exe.need <= _BIG:
        return
    free = memory.available_bytes(jax_device(gdev))
    if free is not None and exe.need > free:
        raise OutOfMemory(
            f"RESOURCE_EXHAUSTED: this step's graph needs {exe.need / 2**30:.2f} GiB of new buffers on xla:{gdev}, "
            f"and {free / 2**30:.2f} GiB are free; the tensors computed by it were not computed"
        )


class Body:
    """A graph's JAX function taking (donated data, kept data, packed scalars), with what
    compiling it needs: the abstract data and packed arguments in leaf order, the positions of
    the kept (not donated) data, and the sharding of a local device other than the default
    one (``dp.DataParallel``), or None."""

    __slots__ = ("fn", "data_avals", "packed_avals", "donate", "kept", "placed")

    def args(self) -> tuple:
        """Abstract arguments for ``fn``: (donated data, kept data, packed scalars)."""
        d = self.data_avals
        return [d[i] for i in self.donate], [d[i] for i in self.kept], self.packed_avals


def lowered_body(req: CompileRequest, table) -> Body:
    """``req``'s graph as a ``Body``; ``table`` (a ``checks.Table``) is filled while JAX traces it."""
    fn = lower_fn(plan(req.nodes, req.leaves, req.cut), req.leaf_kinds, req.root_refs, hlo_scopes(req.nodes), table,
                  req.keep)  # fmt: skip
    b = Body()
    b.placed = placed = SingleDeviceSharding(jax_device(req.dev)) if req.dev else None
    b.data_avals = [jax.ShapeDtypeStruct(d.aval[0], to_jax(d.aval[1]), sharding=placed) for d in req.data]
    b.packed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in req.packed]
    # Donation is per data parameter: buffers no live tensor holds any more.
    b.donate = req.donate
    donate_mask = set(req.donate)
    b.kept = [i for i in range(len(req.data)) if i not in donate_mask]

    def body(d, k, packed_args):
        return fn(_merge(d, k, donate_mask), packed_args)

    region = regions.current() if regions.ACTIVE else None
    if region is not None and region.name:  # the HLO module is jit_<name>: XLA's dumps carry the region's name
        body.__name__ = re.sub(r"\W", "_", region.name)
    b.fn = body
    return b


def compile_one(body: Body, once: bool = False) -> Executable:
    """``body`` compiled for one device (``once``: to compile fast, ``compiler.py``)."""
    lowered = jax.jit(body.fn, donate_argnums=(0,), out_shardings=body.placed).lower(*body.args())
    compiled = compiler.compile(lowered, once)
    donate, kept = body.donate, body.kept
    if body.placed is not None:
        local = next(iter(body.placed.device_set))

        def call(arrays, packed_vals):
            packed_vals = [jax.device_put(p, local) for p in packed_vals]
            return compiled([arrays[i] for i in donate], [arrays[i] for i in kept], packed_vals)

        return Executable(call, xla=compiled)

    def call(arrays, packed_vals):
        return compiled([arrays[i] for i in donate], [arrays[i] for i in kept], packed_vals)

    return Executable(call, xla=compiled)


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
