"""The computation of given tensors, lowered by JAX but neither compiled nor run.

What a sync would compile for a set of device tensors, as a ``jax.stages.Lowered``: the
graph dumps (``xlatorch.debug.dump``) print it, the StableHLO export (``xlatorch.stablehlo``)
hands it to the user. Nothing here syncs, compiles or changes the next step's graph.
"""

from __future__ import annotations

import jax
import torch

from xlatorch.runtime.base import topology
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.ir.emit import hlo_scopes
from xlatorch.runtime.ir.values import Data, Out
from xlatorch.runtime.lower.function import lower_fn, plan
from xlatorch.runtime.multi import sharding
from xlatorch.runtime.plan.collect import collect, pack
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES
from xlatorch.runtime.trace.tensor import XlaTensor, value_of

__all__ = ["graph_of", "lower"]


def graph_of(tensors, who: str = "xlatorch"):
    """(nodes, leaves, root_refs) of the graph computing ``tensors`` (a tensor or a list of
    them); tensors already computed are inputs that are also outputs."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    vals = []
    for t in tensors:
        if type(t) is not XlaTensor:
            raise TypeError(f"{who}: expected tensors on the xla device, got one on '{t.device}'")
        vals.append(value_of(t))
    pending = [v for v in vals if type(v) is Out]
    g = collect(pending)
    nodes, refs = g.nodes, g.root_refs
    # The leaves in the order the nodes read them first (as torch_xla numbers a graph's
    # parameters), not the order the sync's walk met them in: what an export's arguments follow.
    first = {}
    for _, rs in g.enc:
        for r in rs:
            if r < 0:
                first.setdefault(r, g.leaves[-1 - r])
    leaves = list(first.values())
    by_id = {id(v): -1 - i for i, v in enumerate(leaves)}
    it = iter(refs)
    root_refs = []
    for v in vals:
        if type(v) is Out:
            root_refs.append(next(it))
            continue
        if id(v) not in by_id:
            by_id[id(v)] = -1 - len(leaves)
            leaves.append(v)
        root_refs.append(by_id[id(v)])
    return nodes, leaves, tuple(root_refs)


def lower(tensors, who: str = "xlatorch"):
    """``(lowered, leaves, packed)``: the JAX ``Lowered`` computation of ``tensors``, the
    graph's leaves (its device-data leaves are the computation's first arguments, in order)
    and the Python numbers packed into its last argument."""
    nodes, leaves, root_refs = graph_of(tensors, who)
    if any(n.spec in COLLECTIVES for n in nodes):
        raise NotImplementedError(f"{who}: graphs with collectives (lowered per replica under shard_map) are not "
                                  "supported yet")  # fmt: skip
    packed, kinds = pack(leaves)
    fn = lower_fn(plan(nodes, leaves), kinds, root_refs, hlo_scopes(nodes))
    data = [v for v in leaves if type(v) is Data]
    where = None
    if topology.SPMD[0]:  # SPMD: the inputs' shardings, as a sync compiles it (one mesh)
        where = sharding.replicated(sharding.prepare(data, [])[0])
        data = [sharding.data_aval(v, to_jax(v.aval[1])) for v in data]
    else:
        data = [jax.ShapeDtypeStruct(v.aval[0], to_jax(v.aval[1])) for v in data]
    lowered = jax.jit(fn).lower(data, [jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=where) for p in packed])
    return lowered, leaves, packed
