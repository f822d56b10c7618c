"""A graph with collectives compiled as one SPMD program over the replicas' devices
(processes of a job, or ``dp.DataParallel``'s threads over local devices)."""

from __future__ import annotations

import jax
import numpy as np

from xlatorch.runtime.base import topology as distributed
from xlatorch.runtime.base.topology import jax_device, local_device_count
from xlatorch.runtime.lower import compiler
from xlatorch.runtime.lower.executable import Executable
from xlatorch.runtime.trace.collectives import AXIS

__all__ = ["compile_spmd"]


def compile_spmd(body, args, out_avals, donate, kept, table):
    """A graph with collectives: one SPMD program over the replicas' devices.

    Replicas are processes (one device each, the job's global mesh) or, under
    ``dp.DataParallel``, this process's local devices. Each replica's array is its block
    of a global array split along axis 0 (0-d values travel as shape (1,)); inside
    ``shard_map`` the blocks are the local values again, so the lowering is the same as
    for a one-replica graph.
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    threads = distributed.thread_replicas()
    if threads:
        devices = [jax_device(i) for i in range(local_device_count())][:threads]
        local = devices
    else:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        local = [jax_device()]
    mesh = Mesh(np.array(devices), (AXIS,))
    spec = PartitionSpec(AXIS)
    sharding = NamedSharding(mesh, spec)
    n = len(devices)

    def block(a):  # the local block's aval (0-d travels as (1,))
        return a.shape or (1,)

    def glob(shape):
        return (shape[0] * n,) + tuple(shape[1:])

    flat_in = [a for group in args for a in group]
    in_shapes = [a.shape for a in flat_in]
    out_shapes = [tuple(shape) for shape, _ in out_avals]

    def spmd_body(d, k, p):
        unblock = iter(in_shapes)
        d, k, p = ([x.reshape(next(unblock)) for x in group] for group in (d, k, p))
        outs = body(d, k, p)
        return tuple(o.reshape(block(o)) for o in outs)

    from jax import shard_map

    # Every value is a replica's own (torch_xla's model): no tracking of which values are the
    # same on every replica (check_vma), which a loop whose carry starts as a constant and
    # then reads a collective's result would fail (runtime/trace/loops.py).
    mapped = shard_map(spmd_body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    global_args = [[jax.ShapeDtypeStruct(glob(block(a)), a.dtype, sharding=sharding) for a in group]
                   for group in args]  # fmt: skip
    compiled = compiler.compile(jax.jit(mapped, donate_argnums=(0,)).lower(*global_args))
    if table.rows:  # the check rows (known once traced) are one more output
        out_shapes.append((len(table.rows), 3))

    def to_global(parts):
        """One global array from each local replica's block."""
        blocks = []
        for x, dev in zip(parts, local):
            if isinstance(x, np.ndarray):
                x = jax.device_put(x, dev)
            blocks.append(x.reshape(1) if x.ndim == 0 else x)
        return jax.make_array_from_single_device_arrays(glob(blocks[0].shape), sharding, blocks)

    def run_all(contribs):
        """[(arrays, packed) per local replica] -> [outputs per local replica]."""

        def column(which, i):  # input i of every replica (which: 0 data, 1 packed scalars)
            return to_global([c[which][i] for c in contribs])

        g_don = [column(0, i) for i in donate]
        g_kept = [column(0, i) for i in kept]
        g_packed = [column(1, i) for i in range(len(contribs[0][1]))]
        outs = compiled(g_don, g_kept, g_packed)
        res = [[] for _ in contribs]
        for o, shape in zip(outs, out_shapes):
            shards = {s.device: s.data for s in o.addressable_shards}
            for r, dev in enumerate(local):
                x = shards[dev]
                res[r].append(x.reshape(shape) if x.shape != shape else x)
        return res

    def call(arrays, packed_vals):
        return run_all([(arrays, packed_vals)])[0]

    return Executable(call, run_all, threads, compiled)
