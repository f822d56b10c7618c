"""A sync's pending values as a graph: its nodes in order with its cache encoding
(``collect``), and its host scalars packed by dtype (``pack``).

``cut`` (``{id(out): Data}``) reads those pending outputs as device data instead: a later
stage of a graph split by ``stages.py`` reads what earlier stages computed. The graph is
lowered by runtime/lower/function.py.
"""

from __future__ import annotations

from sys import getrefcount as _refs

import numpy as np

from xlatorch.runtime.base.dtypes import PY_SCALAR_JAX, to_jax
from xlatorch.runtime.ir import failed as failure
from xlatorch.runtime.ir.values import Data, Out, Scalar

__all__ = ["Graph", "collect", "pack"]


class Graph:
    """A collected graph: ``nodes`` in post-order (operands first), ``leaves`` (device data
    and host scalars) in first-use order, ``enc`` (per node: its key and its operands'
    positions, the structure the cache key hashes), ``root_refs`` (per root: ``node * 4096 +
    output``, or ``-1 - leaf``) and whether a failed value is among the nodes (``failed``)."""

    __slots__ = ("nodes", "leaves", "enc", "root_refs", "failed")

    def __init__(self, nodes, leaves, enc, root_refs, failed=False):
        self.nodes, self.leaves, self.enc, self.root_refs, self.failed = nodes, leaves, enc, root_refs, failed


def collect(roots, cut=None) -> Graph:
    """The graph computing ``roots``. Runs at every sync over the whole graph: kept tight
    (one visit per node whose operands are already placed, the operand scan and the leaf
    numbering inline; the order is the post-order of a depth-first walk, operands in order).
    Nodes and leaves are dictionary keys themselves: their hash is their identity."""
    order = {}  # node -> position
    scanned = {}  # node -> its operands, while its own operands are being placed
    nodes = []
    leaf_pos = {}  # leaf -> position
    leaves = []
    enc = []
    failed = False
    failed_spec = failure._SPEC
    _Out, _Data, _Scalar, _tuple = Out, Data, Scalar, tuple
    for root in roots:
        if type(root) is not _Out or root.node in order:
            continue
        stack = [root.node]
        while stack:
            n = stack[-1]
            if n in order:  # reached twice before it was placed
                stack.pop()
                continue
            ops = scanned.pop(n, None)
            if ops is None:
                ops = []
                for a in n.args:
                    t = type(a)
                    if t is _Out or t is _Scalar or t is _Data:
                        ops.append(a)
                    elif t is _tuple:
                        for x in a:
                            t = type(x)
                            if t is _Out or t is _Scalar or t is _Data:
                                ops.append(x)
                if cut:
                    ops = [cut.get(id(v), v) for v in ops]
                more = False
                for v in reversed(ops):
                    if type(v) is _Out and v.node not in order:
                        stack.append(v.node)
                        more = True
                if more:
                    scanned[n] = ops
                    continue
            stack.pop()
            refs = []
            for v in ops:
                if type(v) is _Out:
                    refs.append(order[v.node] * 4096 + v.idx)
                else:
                    i = leaf_pos.get(v)
                    if i is None:
                        i = leaf_pos[v] = len(leaves)
                        leaves.append(v)
                    refs.append(-1 - i)
            enc.append((n.key, _tuple(refs)))
            order[n] = len(nodes)
            nodes.append(n)
            if n.spec is failed_spec:
                failed = True
    root_refs = []
    for r in roots:
        if type(r) is _Out:
            root_refs.append(order[r.node] * 4096 + r.idx)
        else:
            i = leaf_pos.get(r)
            if i is None:
                i = leaf_pos[r] = len(leaves)
                leaves.append(r)
            root_refs.append(-1 - i)
    return Graph(nodes, leaves, enc, _tuple(root_refs), failed)


def release(graph) -> None:
    """After a sync has run ``graph`` and given every pending tensor its data: break the cycle
    between each of its nodes and their outputs (``node.outs``, ``out.node``), so that
    reference counting frees the graph, with the device arrays it holds, as soon as the last
    tensor lets go. Left to Python's cyclic collector, a step's
    nodes outlived several collections and piled up until a full one, which walked every
    object of the process: 50-100 ms every 20 steps or so of 300 ops (``bench.overlap``), long
    enough to stall the host while the device waited; GPT's step spent 4 ms a step in the
    collector.

    A node stays linked while something outside the graph still holds one of its outputs (a
    view's cached value, ``tensor.value_of``: a later graph may read it), and so does every
    node it reads from: those can appear in a later graph, whose planning reads ``outs``. An
    unlinked node lets go of its arguments too, so that by the time the walk (consumers
    first) reaches a node, its outputs' reference counts say alone whether anything still
    reads them: a linked consumer, or something outside the graph."""
    nodes = graph.nodes
    for k in range(len(nodes) - 1, -1, -1):
        n = nodes[k]
        for o in n.outs:
            # References: n.outs, this loop's name and getrefcount's argument; any more is a
            # reader that stays
            if o is not None and _refs(o) > 3:
                break
        else:
            n.outs = n.args = None


# Leaf signatures -> how ``pack`` lays their scalars out: (per leaf its kind, per packed
# array its dtype and the positions of its leaves). The signatures decide it (a leaf's dtype,
# and whether it is a 0-d tensor or a Python number), so a graph seen before reuses it.
_LAYOUTS: dict = {}


def pack(leaves, sigs=None):
    """Host scalars grouped by dtype into one array each: one transfer per dtype, not per scalar.
    ``sigs``: the leaves' signatures, when the caller has them already."""
    if sigs is None:
        sigs = tuple([v.sig for v in leaves])
    layout = _LAYOUTS.get(sigs)
    if layout is None:
        layout = _layout(leaves)
        if len(_LAYOUTS) >= 512:
            _LAYOUTS.clear()
        _LAYOUTS[sigs] = layout
    kinds, groups = layout
    return [np.asarray([leaves[i].value for i in idx], dtype=dt) for dt, idx in groups], kinds


def _layout(leaves):
    groups: dict = {}  # packed dtype -> (group index, positions of its leaves)
    kinds = []
    nd = 0
    for pos, v in enumerate(leaves):
        if type(v) is Data:
            kinds.append(("d", nd))
            nd += 1
        else:
            # Python numbers are weakly typed, as in PyTorch: 2.5 * float32 stays float32.
            # A precision mode may pack them wider than 0-d tensors of their dtype.
            dt = to_jax(v.aval[1]) if v.tensor else PY_SCALAR_JAX[v.aval[1]]
            gi, idx = groups.setdefault(dt, (len(groups), []))
            kinds.append((gi, len(idx), not v.tensor))
            idx.append(pos)
    return tuple(kinds), [(dt, tuple(idx)) for dt, (_, idx) in groups.items()]
