"""A collected graph as a JAX function: a lowering plan that does not hold the IR (``plan``)
and the function computing the roots from device data and packed scalars (``lower_fn``).

runtime/execute/sync.py compiles it; runtime/execute/lowered.py (dumps, the StableHLO
export) lowers the same plan without running it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from xlatorch.runtime.base.dtypes import weak
from xlatorch.runtime.ir.body import Ref, node_refs, plan, stack_rows
from xlatorch.runtime.ir.emit import emit_node
from xlatorch.runtime.lower.checks import Table

__all__ = ["plan", "lower_fn", "LoweringError", "Ref", "node_refs"]


def lower_fn(plan, leaf_kinds, root_refs, scopes=None, table=None, keep=()):
    """The JAX function computing the roots from (device data..., packed scalars...);
    ``scopes``: per-node names for the HLO metadata (``XLA_HLO_DEBUG``), or None.

    When nodes have on-device checks (``runtime/lower/checks.py``), one more output holds their
    ``[bad, value, position]`` rows, and ``table`` (a ``checks.Table``) gets each row's node,
    exception type and message, and each root's mask of the rows it depends on (filled
    while JAX traces). A root with ``keep[i]`` set (its storage's data from before the
    step is leaf ``keep[i][0]``) gets that leaf's data back when a row it depends on, or a
    row of a checked node traced before its last write (``keep[i][1]``), is set
    (``table.undo[i]`` holds those rows): with ``keep.in_graph`` (``checks.Keep``) the graph
    selects it itself, and the sync may donate the leaf as it does without checks (one copy of
    the model's state on the device, not two); otherwise, or when the step did not read that
    data (``keep[i][0]`` is -1), the sync keeps it and restores it."""
    if table is None:  # a dump: the checks' rows are computed all the same
        table = Table()

    def fn(data, packed):
        table.clear()  # filled anew by each trace
        # Each packed group's scalars come out of one split: one primitive to trace, where
        # indexing traced a small jitted function per scalar (half the lowering of a graph
        # of scalar adds, ``bench.long_graph``).
        groups = [_unpack(p) for p in packed]
        leaf_vals = []
        for kind in leaf_kinds:
            if kind[0] == "d":
                leaf_vals.append(data[kind[1]])
            else:
                v = groups[kind[0]][kind[1]]
                leaf_vals.append(weak(v) if kind[2] else v)
        vals = []

        def get(a):
            if type(a) is Ref:
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
            table.add_node(k, node_refs(args), [c for c in found_k if c is not None], found)
        outs = tuple(leaf_vals[-1 - r] if r < 0 else vals[r // 4096][r % 4096] for r in root_refs)
        if not found:
            return outs
        rows = stack_rows(found)
        table.set_roots([None if r < 0 else r // 4096 for r in root_refs])
        table.undo = [table.undo_mask(i, keep[i][1]) if keep and keep[i] is not None else 0 for i in range(len(outs))]
        table.in_graph = getattr(keep, "in_graph", False)  # checks.Keep: decided with the graph's key
        if not table.in_graph:
            return outs + (rows,)
        # Root i is its data from before the step when a row of table.undo[i] fired (a
        # select fused into its update: the donated buffer is written in place either way).
        fired: dict = {}  # undo mask -> whether one of its rows is set
        outs = list(outs)
        for i, m in enumerate(table.undo):
            if m and keep[i][0] >= 0:  # -1: not read by the step, the sync keeps it
                b = fired.get(m)
                if b is None:
                    b = fired[m] = jnp.any(rows[np.array([r for r in range(len(found)) if m >> r & 1]), 0] != 0)
                outs[i] = jnp.where(b, leaf_vals[keep[i][0]], outs[i])
        return tuple(outs) + (rows,)

    return fn


def _unpack(p) -> list:
    """The 0-d values of a packed 1-d argument."""
    n = p.shape[0]
    if n == 1:
        return [lax.reshape(p, ())]
    return [lax.reshape(x, ()) for x in lax.split(p, (1,) * n)]


class LoweringError(Exception):
    """Node ``k``'s lowering raised ``error`` while a graph was traced."""

    def __init__(self, k: int, error: Exception):
        super().__init__(f"lowering node {k} failed: {type(error).__name__}: {error}")
        self.k, self.error = k, error
