"""A sync's pending values as a graph: its nodes in order with its cache encoding
(``collect``), and its host scalars packed by dtype (``pack``). The graph is lowered by
runtime/lower/function.py; a graph split into stages is encoded per stage by ``stages.py``.
"""

from __future__ import annotations

from sys import getrefcount as _refs

import numpy as np

from xlatorch.runtime.base.dtypes import PY_SCALAR_JAX, to_jax
from xlatorch.runtime.ir import failed as failure
from xlatorch.runtime.ir.values import Data, Out, Scalar, operands

__all__ = ["Graph", "collect", "pack"]


class Graph:
    """A collected graph: ``nodes`` in post-order (operands first), ``leaves`` (device data
    and host scalars) in the order the walk meets them, ``enc`` (per node: its key and its operands'
    positions, the structure the cache key hashes), ``root_refs`` (per root: ``node * 4096 +
    output``, or ``-1 - leaf``) and whether a failed value is among the nodes (``failed``)."""

    __slots__ = ("nodes", "leaves", "enc", "root_refs", "failed")

    def __init__(self, nodes, leaves, enc, root_refs, failed=False):
        self.nodes, self.leaves, self.enc, self.root_refs, self.failed = nodes, leaves, enc, root_refs, failed


# How deep ``collect`` recurses before it goes on with an explicit stack (same order, slower):
# well under Python's recursion limit, with room for the caller's own frames.
DEEP = 400


def collect(roots) -> Graph:
    """The graph computing ``roots``. Runs at every sync over the whole graph, so it is kept
    tight: the nodes in the post-order of a depth-first walk (operands in order), each visited
    once by a recursive call (Python's frames are cheaper than a stack of lists: 30-45% less
    time than the explicit stack on a chain and on a training step), the leaves numbered as the walk
    meets them. Past ``DEEP`` levels, and where the caller's stack leaves no room, the same
    walk goes on with an explicit stack (``_Walk.walk``), which gives the same order. Nodes
    and leaves are dictionary keys themselves: their hash is their identity."""
    try:
        return _Walk().graph(roots, DEEP)
    except RecursionError:  # the caller's own stack was deep: the same graph without recursion
        return _Walk().graph(roots, -1)


class _Walk:
    __slots__ = ("order", "nodes", "leaf_pos", "leaves", "enc", "failed")

    def __init__(self):
        self.order = {}  # node -> position
        self.nodes = []
        self.leaf_pos = {}  # leaf -> position
        self.leaves = []
        self.enc = []
        self.failed = False

    def graph(self, roots, deep) -> Graph:
        order, leaf_pos, leaves = self.order, self.leaf_pos, self.leaves
        visit, close = self.visitor(deep)
        try:
            for root in roots:
                if type(root) is Out and root.node not in order:
                    if deep >= 0:
                        visit(root.node, 0)
                    else:
                        self.walk(root.node)
        finally:
            close()  # ``visit`` refers to itself: the cycle would keep the graph for the collector
        root_refs = []
        for r in roots:
            if type(r) is Out:
                root_refs.append(order[r.node] * 4096 + r.idx)
            else:
                i = leaf_pos.get(r)
                if i is None:
                    i = leaf_pos[r] = len(leaves)
                    leaves.append(r)
                root_refs.append(-1 - i)
        return Graph(self.nodes, leaves, self.enc, tuple(root_refs), self.failed)

    def visitor(self, deep):
        """``visit(node, depth)``, placing ``node`` after its operands and returning its
        position, and ``close()``, which ends it."""
        order, nodes, leaf_pos, leaves, enc = self.order, self.nodes, self.leaf_pos, self.leaves, self.enc
        walk = self.walk
        failed_spec = failure._SPEC
        _Out, _Data, _Scalar, _tuple = Out, Data, Scalar, tuple

        def visit(n, depth):
            refs = []
            for a in n.args:
                t = type(a)
                if t is _Out:
                    m = a.node
                    k = order.get(m)
                    if k is None:
                        k = visit(m, depth + 1) if depth < deep else walk(m)
                    refs.append(k * 4096 + a.idx)
                elif t is _Scalar or t is _Data:
                    i = leaf_pos.get(a)
                    if i is None:
                        i = leaf_pos[a] = len(leaves)
                        leaves.append(a)
                    refs.append(-1 - i)
                elif t is _tuple:  # the two cases above again, inline (a flattening pre-pass: 11-16% slower)
                    for x in a:
                        t = type(x)
                        if t is _Out:
                            m = x.node
                            k = order.get(m)
                            if k is None:
                                k = visit(m, depth + 1) if depth < deep else walk(m)
                            refs.append(k * 4096 + x.idx)
                        elif t is _Scalar or t is _Data:
                            i = leaf_pos.get(x)
                            if i is None:
                                i = leaf_pos[x] = len(leaves)
                                leaves.append(x)
                            refs.append(-1 - i)
            k = order[n] = len(nodes)
            enc.append((n.key, _tuple(refs)))
            nodes.append(n)
            if n.spec is failed_spec:
                self.failed = True
            return k

        def close():
            nonlocal visit
            visit = None

        return visit, close

    def walk(self, root) -> int:
        """``visit``'s walk from ``root`` with an explicit stack of frames ``[node, operands,
        next operand, refs]``; ``root``'s position."""
        order, nodes, leaf_pos, leaves, enc = self.order, self.nodes, self.leaf_pos, self.leaves, self.enc
        stack = [[root, operands(root.args), 0, []]]
        while True:
            frame = stack[-1]
            n, ops, i, refs = frame
            while i < len(ops):
                v = ops[i]
                if type(v) is Out:
                    k = order.get(v.node)
                    if k is None:  # its operand first; this frame goes on from here after it
                        frame[2] = i
                        stack.append([v.node, operands(v.node.args), 0, []])
                        break
                    refs.append(k * 4096 + v.idx)
                else:
                    j = leaf_pos.get(v)
                    if j is None:
                        j = leaf_pos[v] = len(leaves)
                        leaves.append(v)
                    refs.append(-1 - j)
                i += 1
            else:
                k = order[n] = len(nodes)
                enc.append((n.key, tuple(refs)))
                nodes.append(n)
                if n.spec is failure._SPEC:
                    self.failed = True
                stack.pop()
                if not stack:
                    return k


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
