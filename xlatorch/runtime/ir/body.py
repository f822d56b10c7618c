"""Lowering plans: a graph's nodes as ``(spec, arguments, info)`` rows that reference earlier
values by position (``Ref``), never the IR itself; and ``Body``, a plan that is a function
of its inputs (a loop's body, a pure function), run inside another node's lowering.

``plan`` serves both: runtime/lower/function.py lowers a whole sync's graph from one, and the
nodes of runtime/trace/loops.py (``scan``, ``while_loop``, ``cond``, a replayed pure function)
each hold a ``Body`` that their lowering runs under ``jax.lax.scan`` / ``while_loop`` /
``cond`` / once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xlatorch.runtime.base.dtypes import PY_SCALAR_JAX, weak
from xlatorch.runtime.ir.emit import emit_node
from xlatorch.runtime.ir.values import Data, Out, Scalar

__all__ = ["Ref", "Const", "plan", "node_refs", "Body", "Keyed", "stack_rows"]


class Ref:
    """A reference to an earlier value in a lowering plan: ``(kind, index, output)``; kind
    ``"n"``: output ``j`` of plan row ``i``, ``"l"``: leaf ``i``."""

    __slots__ = ("kind", "i", "j")

    def __init__(self, kind, i, j=0):
        self.kind, self.i, self.j = kind, i, j


class Const:
    """A host number baked into a plan as a literal (a pure function's constants): weakly
    typed, as Python numbers enter graphs."""

    __slots__ = ("value", "dtype")

    def __init__(self, scalar: Scalar):
        self.value, self.dtype = scalar.value, PY_SCALAR_JAX[scalar.aval[1]]

    def jax(self):
        return weak(np.asarray(self.value, self.dtype))


def plan(nodes, leaves, cut=None, consts=None):
    """A lowering plan that references values by position, not the IR itself.

    Executables must not keep the step's IR (and its device buffers) alive. ``cut``
    (``{id(out): leaf}``) reads those pending outputs as leaves; an output of a node that
    is not among ``nodes`` must be a leaf itself (a loop body's captured value). ``consts``
    (ids of host scalars) are baked in as literals.
    """
    order = {id(n): i for i, n in enumerate(nodes)}
    lpos = {id(v): i for i, v in enumerate(leaves)}

    def tmpl(a):
        t = type(a)
        if consts and id(a) in consts:
            return Const(a)
        if t is Out:
            d = cut.get(id(a)) if cut else None
            if d is not None:
                return Ref("l", lpos[id(d)])
            i = order.get(id(a.node))
            return Ref("n", i, a.idx) if i is not None else Ref("l", lpos[id(a)])
        if t is Data or t is Scalar:
            return Ref("l", lpos[id(a)])
        if t is tuple:
            return tuple(tmpl(x) for x in a)
        return a

    return [(n.spec, tuple(tmpl(a) for a in n.args), n.info) for n in nodes]


def node_refs(args, out=None) -> list:
    """The plan positions of the nodes whose outputs ``args`` read."""
    out = [] if out is None else out
    for a in args:
        if type(a) is Ref:
            if a.kind == "n":
                out.append(a.i)
        elif type(a) is tuple:
            node_refs(a, out)
    return out


def stack_rows(found):
    """On-device check rows (``(bad, value, position, ...)`` each) as one int64 array ``rows x 3``."""
    return jnp.stack([jnp.stack([jnp.asarray(x).astype(jnp.int64) for x in c[:3]]) for c in found])


class Keyed:
    """A static argument of a node that stands for a program (a body, a JAX function): equal
    when its ``key`` is, hashed once (a node holding it is keyed by it at every call)."""

    __slots__ = ("key", "_hash")

    def __init__(self, key):
        self.key = key
        self._hash = hash(key)

    def __eq__(self, other):
        return other is self or (type(other) is type(self) and other._hash == self._hash and other.key == self.key)

    def __hash__(self):
        return self._hash


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd int64 step: iterations' seeds never meet


class Body(Keyed):
    """A traced function as a lowering plan over its leaves: its ``inputs`` (the function's
    arguments, in order) then its captured values (device data, host scalars and pending
    values made outside it, passed in as the owning node's operands).

    ``key`` (its nodes' keys and how they share operands, its inputs' avals, its roots)
    identifies it in its node's key; ``roots`` are its results; ``checked``: whether a node
    of it has an on-device check; ``name`` says what it is, for messages ("the body of scan").
    """

    __slots__ = (
        "plan",
        "roots",
        "avals",
        "n_inputs",
        "n_leaves",
        "checked",
        "name",
        "where",
        "seeds",
        "collective",
    )

    def __init__(self, plan_rows, roots, avals, key, n_inputs, n_leaves, name, where, seeds=()):
        super().__init__(key)
        self.plan, self.roots, self.avals = plan_rows, roots, avals
        # The leaves that are random ops' seeds: a loop runs iteration i with seeds moved by i
        # (each iteration draws new numbers, as the same code in a Python loop would).
        self.seeds = seeds
        self.collective = False  # whether it holds a collective (runtime/trace/bodies.py sets it)
        self.n_inputs, self.n_leaves, self.name = n_inputs, n_leaves, name
        self.where = where  # per plan row: "aten::op at file.py:12", for a failed check's message
        self.checked = any(info.checked for _, _, info in plan_rows)

    def __repr__(self):
        return f"Body({self.name}, {len(self.plan)} nodes)"

    def run(self, leaf_vals, found=None, iteration=None):
        """The roots' JAX values from the leaves' (inputs then captured values); the rows of
        its on-device checks are appended to ``found`` (``(bad, value, position, exception,
        message)`` each, as ``L.checks`` gives them), or not computed when ``found`` is None.
        ``iteration``: a loop's iteration number (a JAX int64), which moves the seeds."""
        vals = []
        if iteration is not None and self.seeds:
            leaf_vals = list(leaf_vals)
            for i in self.seeds:
                leaf_vals[i] = leaf_vals[i] + iteration * _GOLDEN

        def get(a):
            t = type(a)
            if t is Ref:
                return leaf_vals[a.i] if a.kind == "l" else vals[a.i][a.j]
            if t is tuple:
                return tuple(get(x) for x in a)
            if t is Const:
                return a.jax()
            return a

        for k, (spec, args, info) in enumerate(self.plan):
            rows: list | None = [] if found is not None and info.checked else None
            vals.append(emit_node(spec, tuple(get(a) for a in args), info, None, rows))
            if rows:
                where = f" (in {self.name}: {self.where[k]})".replace("{", "{{").replace("}", "}}")
                found.extend((*c[:4], c[4] + where) for c in rows if c is not None)
        return [get(r) for r in self.roots]
