"""A collected graph as a JAX function: a lowering plan that does not hold the IR (``plan``)
and the function computing the roots from device data and packed scalars (``lower_fn``).

runtime/execute/sync.py compiles it; runtime/execute/lowered.py (dumps, the StableHLO
export) lowers the same plan without running it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xlatorch.runtime.base.dtypes import weak
from xlatorch.runtime.ir.body import Ref, node_refs, plan, stack_rows
from xlatorch.runtime.ir.emit import emit_node
from xlatorch.runtime.lower.checks import Table

__all__ = ["plan", "lower_fn", "LoweringError", "Ref", "node_refs", "Shared", "shared"]


def lower_fn(plan, leaf_kinds, root_refs, scopes=None, table=None, keep=(), share=None):
    """The JAX function computing the roots from (device data..., packed scalars...);
    ``scopes``: per-node names for the HLO metadata (``XLA_HLO_DEBUG``), or None; ``share``
    (a ``Shared``): scalars read from the slot of an equal one (valid while ``share.fits``).

    When nodes have on-device checks (``runtime/lower/checks.py``), one more output holds their
    ``[bad, value, position]`` rows, and ``table`` (a ``checks.Table``) gets each row's node,
    exception type and message, and each root's mask of the rows it depends on (filled
    while JAX traces). A root with ``keep[i]`` set (its storage's data from before the
    step is leaf ``keep[i][0]``) gets that leaf's data back when a row it depends on, or a
    row of a checked node traced before its last write (``keep[i][1]``), is set
    (``table.undo[i]`` holds those rows): with ``keep.in_graph`` (``checks.Keep``) the graph
    selects it itself, and the sync may donate the leaf as it does without checks (one copy of
    the model's state on the device, not two); otherwise, or when the step did not read that
    data (``keep[i][0]`` is -1), the sync keeps it and restores it. A ``keep`` whose
    ``unchecked`` is set (``plan.keep.UNCHECKED``) lowers the graph without its checks."""
    if table is None:  # a dump: the checks' rows are computed all the same
        table = Table()
    unchecked = getattr(keep, "unchecked", False)  # checks decided before the step (plan/prechecks.py)

    def fn(data, packed):
        table.clear()  # filled anew by each trace
        # Each packed group's scalars come out of one split: one primitive to trace, where
        # indexing traced a small jitted function per scalar (half the lowering of a graph
        # of scalar adds, ``bench.long_graph``).
        groups = [_Unpacked(p) for p in packed]
        rep = share.rep if share is not None else None
        leaf_vals = []
        read: dict = {}
        for kind in leaf_kinds:
            if kind[0] == "d":
                leaf_vals.append(data[kind[1]])
                continue
            j = rep.get((kind[0], kind[1]), kind[1]) if rep else kind[1]
            at = (kind[0], j, kind[2])
            v = read.get(at)
            if v is None:
                v = groups[kind[0]][j]
                v = read[at] = weak(v) if kind[2] else v
            leaf_vals.append(v)
        vals = []

        def get(a):
            if type(a) is Ref:
                return leaf_vals[a.i] if a.kind == "l" else vals[a.i][a.j]
            if type(a) is tuple:
                return tuple(get(x) for x in a)
            return a

        found: list = []
        casts: dict = {}
        for k, (spec, args, info) in enumerate(plan):
            found_k: list | None = None if unchecked else []
            try:
                vals.append(
                    emit_node(spec, tuple(get(a) for a in args), info, scopes[k] if scopes else None, found_k, casts)
                )
            except Exception as e:
                raise LoweringError(k, e) from e
            if found_k is not None:
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


class _Unpacked:
    """The 0-d values of a packed 1-d argument, each made when first read (``[j]``): a graph
    whose equal scalars are shared (``Shared``) reads one slot of thousands. Of a concrete
    argument (an export's inlined constants), 0-d constants the program then holds as such."""

    __slots__ = ("p", "parts", "vals")

    def __init__(self, p):
        self.p, self.parts, self.vals = p, None, {}

    def __getitem__(self, j):
        v = self.vals.get(j)
        if v is None:
            v = self.vals[j] = self._make(j)
        return v

    def _make(self, j):
        p = self.p
        if isinstance(p, (list, tuple)):  # an export's group: each value a constant or an argument of its own
            x = p[j]
            return x if isinstance(x, jax.core.Tracer) else jnp.asarray(x)
        if not isinstance(p, jax.core.Tracer):
            return jnp.asarray(np.asarray(p)[j])
        if p.shape[0] == 1:
            return lax.reshape(p, ())
        if self.parts is None:  # one split for the whole group: one primitive to trace
            self.parts = lax.split(p, (1,) * p.shape[0])
        return lax.reshape(self.parts[j], ())


class Shared:
    """Which host scalars of the step a graph is compiled for are equal, bit for bit: the
    lowering reads each distinct value once (``rep``: ``(group, slot)`` -> the slot of the
    first equal scalar), and a run checks that its scalars are still equal where those were
    (``fits``). Values enter the graph as parameters, never constants, and the cache key does
    not depend on them: a scalar XLA knows to be one parameter is what lets it fold what
    depends on it alone (the convert and ``* alpha`` of each ``t + 1``; ``bench.long_graph``).

    ``pairs``: per group with shared slots, ``(group, slots, their representatives)``."""

    __slots__ = ("rep", "pairs", "spans")

    def __init__(self, rep: dict, pairs: list, sizes: dict):
        self.rep, self.pairs = rep, pairs
        # Per group: the byte ranges of each shared slot and of its representative
        self.spans = [(g, [(i * n, i * n + n, r * n, r * n + n) for i, r in zip(idx.tolist(), rep.tolist())])
                      for g, idx, rep in pairs for n in (sizes[g],)]  # fmt: skip

    def fits(self, packed, seen=None) -> bool:
        """Whether ``packed`` (a step's packed scalars; ``seen``: their bytes, if the caller has
        them) has equal values wherever the compiled step had, bit for bit."""
        for g, spans in self.spans:
            b = seen[g] if seen is not None else np.ascontiguousarray(packed[g]).tobytes()
            for s, e, rs, re_ in spans:
                if b[s:e] != b[rs:re_]:
                    return False
        return True


def _bits(p):
    p = np.ascontiguousarray(p)
    return p.view(np.uint8).reshape(p.shape[0], p.dtype.itemsize)


def shared(packed) -> Shared | None:
    """The ``Shared`` of packed scalars (``plan.collect.pack``), or None when none are equal.
    Equal means the same bits: 0.0 and -0.0 stay apart, a NaN joins only the same NaN."""
    rep, pairs, sizes = {}, [], {}
    for g, p in enumerate(packed):
        p = np.asarray(p)
        sizes[g] = p.dtype.itemsize
        if p.ndim != 1 or p.shape[0] < 2:
            continue
        _, first, inv = np.unique(_bits(p), axis=0, return_index=True, return_inverse=True)
        r = first[inv.reshape(-1)]
        idx = np.nonzero(r != np.arange(r.shape[0]))[0]
        if idx.shape[0]:
            pairs.append((g, idx, r[idx]))
            rep.update(((g, int(i)), int(j)) for i, j in zip(idx, r[idx]))
    return Shared(rep, pairs, sizes) if pairs else None


class LoweringError(Exception):
    """Node ``k``'s lowering raised ``error`` while a graph was traced."""

    def __init__(self, k: int, error: Exception):
        super().__init__(f"lowering node {k} failed: {type(error).__name__}: {error}")
        self.k, self.error = k, error
