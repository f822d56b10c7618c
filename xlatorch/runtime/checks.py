"""Checks CPU PyTorch makes on data, computed inside the compiled graph.

CPU PyTorch raises on an out-of-range index (``index_select``, ``embedding``, ``gather``,
``x[idx]``, ``index_put_``, ``scatter``, loss targets) and on integer division by zero;
XLA clamps, drops or returns garbage instead. An op whose ops.yaml entry has a ``check``
computes, in the same XLA program as its result, one row ``[bad, value, position]`` per
condition (the first offending element and where it is, for the message). A sync reads the rows of the
graph it ran (a few bytes, with the results: no extra round trip per op, no graph cut)
and, when one is set, raises the exception CPU raises (same type, CPU's message, then the
ATen op and the user's line); the tensors that depend on the failed op carry the error,
the others are committed. A tensor the step updated in place (a parameter, optimizer
state) keeps its value from before the step instead when its update depends on the
failed op or was traced after it, as on CPU, where the exception stops the program
before any later update (host-side state, such as a CPU step count, cannot be undone).

``XLATORCH_CHECKS=0`` turns the checks off (read at import): checked ops then behave as
XLA does (indices clamped, integer division by zero gives a number).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["ENABLED", "Table", "failure"]

ENABLED = os.environ.get("XLATORCH_CHECKS", "1").strip().lower() not in ("0", "false", "off", "no")


class Table:
    """A compiled graph's checks, filled while JAX traces it: ``rows`` holds ``(node index,
    exception type, message)`` per row of the extra output, ``masks`` per root the bit mask
    of the rows it depends on, ``undo`` per root the rows that give it its old data back."""

    __slots__ = ("rows", "masks", "undo", "node_rows", "_node_masks")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.rows: list = []
        self.masks: list = []
        self.undo: list = []  # per root: the rows whose failure gives it its data from before the step back
        self.node_rows: dict = {}  # node index -> mask of its own rows
        self._node_masks: list = []

    def add_node(self, k: int, operand_nodes, results: list, found: list) -> None:
        """Node ``k`` (reading the outputs of ``operand_nodes``) gave check ``results``;
        they are appended to ``found``, the graph's rows so far."""
        m = own = 0
        for c in results:
            own |= 1 << len(found)
            found.append(c)
            self.rows.append((k, c[3], c[4]))
        if own:
            self.node_rows[k] = own
        for j in operand_nodes:
            m |= self._node_masks[j]
        self._node_masks.append(m | own)

    def undo_mask(self, i: int, before: int) -> int:
        """The rows whose failure gives root ``i`` its data from before the step back: those it
        depends on, and those of the checked nodes in ``before`` (traced before its last write)."""
        m = self.masks[i]
        for k, own in self.node_rows.items():
            if before >> k & 1:
                m |= own
        return m

    def set_roots(self, root_nodes) -> None:
        """The roots' masks, from the node each root is an output of (None: a leaf)."""
        self.masks = [0 if k is None else self._node_masks[k] for k in root_nodes]


def failure(rows, flags, nodes) -> tuple[Exception, int] | None:
    """``(exception, mask of the rows that fired)`` when a check row is set, else None.

    The exception is the first failed check's, in graph order (the earliest op)."""
    flags = np.asarray(flags)
    bad = np.flatnonzero(flags[:, 0])
    if not bad.size:
        return None
    r = int(bad[0])
    k, exc, msg = rows[r]
    n = nodes[k]
    from xlatorch.runtime.source import fmt_src

    name = n.spec.name.removesuffix(".default")
    where = fmt_src(getattr(n, "src", None), full=True)
    text = msg.format(int(flags[r, 1]), int(flags[r, 2]))
    error = exc(f"{text} (aten::{name} at {where}, checked on the xla device)")
    mask = 0
    for i in bad:
        mask |= 1 << int(i)
    return error, mask
