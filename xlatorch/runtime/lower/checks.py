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
before any later update (host-side state, such as a CPU step count, cannot be undone). A
tensor the step wrote both before the failed op and after it carries the error instead: its
value at the failed op is not kept.
Where the device's memory is scarce (an accelerator), the graph makes that choice itself
(``plan.lower_fn``: its result for the tensor is the old data when such a row is set), so
the old buffer is donated as without checks: no second copy of the model's state on the
device. On CPU, where the device's memory is the host's, the old buffers are kept (not
donated) until the rows are read, and the sync gives them back: the graph compiles about 10%
faster without a select per updated tensor (``bench.first_steps``) - until the state kept
would take a quarter of the host's available memory, when CPU switches to the first way for
the rest of the process (``undo_in_graph``). ``XLATORCH_CHECKS_UNDO=graph|keep`` chooses.
One difference: when the execution itself fails (not a check), kept data goes back, while
data the graph was to undo was donated, and those tensors carry the error.

The rows are read late: a sync commits its results and dispatches without waiting, and the
rows are read (``settle``) when the program next needs the device's results - at the next
sync, before it runs anything; at any read of device data by the host (``.cpu()``,
``.item()``, printing, saving); at ``wait_device_ops`` / ``mark_step(wait=True)``; at exit.
So the host traces step N+1 while step N runs, as it does without checks. When a row is
set, that point raises the failed step's exception and undoes the step as above; values the
program traced since from the failed step's results carry the error (``FailedValueError``).
A program that ends with a failed step exits with status 1 after printing its error.

Only while one thread uses the device: an execution may hold another thread's tensors (a
sync runs every pending value) and reading its rows from elsewhere would undo that thread's
step in the middle of its tracing. From the first step that involves a second thread, every
sync reads its own rows before it returns, as with ``XLATORCH_CHECKS=sync``.

``XLATORCH_CHECKS=0`` turns the checks off (read at import): checked ops then behave as
XLA does (indices clamped, integer division by zero gives a number). ``XLATORCH_CHECKS=sync``
reads each sync's rows before it returns (the error is raised by the failed step's own
``mark_step``; the host waits for every step).
"""

from __future__ import annotations

import numpy as np

from xlatorch.runtime.base.source import fmt_src

__all__ = ["Table", "failure", "where"]


class Table:
    """A compiled graph's checks, filled while JAX traces it: ``rows`` holds ``(node index,
    exception type, message)`` per row of the extra output, ``masks`` per root the bit mask
    of the rows it depends on, ``undo`` per root the rows that give it its old data back
    (``in_graph``: the graph gives it back itself)."""

    __slots__ = ("rows", "masks", "undo", "in_graph", "node_rows", "_node_masks")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.rows: list = []
        self.masks: list = []
        self.undo: list = []  # per root: the rows whose failure gives it its data from before the step back
        self.in_graph = False
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

    def rows_of(self, nodes_mask: int) -> int:
        """The rows of the checked nodes in ``nodes_mask``."""
        m = 0
        for k, own in self.node_rows.items():
            if nodes_mask >> k & 1:
                m |= own
        return m

    def set_roots(self, root_nodes) -> None:
        """The roots' masks, from the node each root is an output of (None: a leaf)."""
        self.masks = [0 if k is None else self._node_masks[k] for k in root_nodes]


def where(rows, nodes) -> list:
    """Per row, what its message names: ``(op name, source line)`` of the node that checks it
    (kept instead of the nodes, which would hold the step's whole graph)."""
    return [(nodes[k].spec.name, getattr(nodes[k], "src", None)) for k, _, _ in rows]


def failure(rows, flags, names) -> tuple[Exception, int] | None:
    """``(exception, mask of the rows that fired)`` when a check row is set, else None.

    The exception is the first failed check's, in graph order (the earliest op)."""
    flags = np.asarray(flags)
    bad = np.flatnonzero(flags[:, 0])
    if not bad.size:
        return None
    r = int(bad[0])
    _, exc, msg = rows[r]
    name, src = names[r]
    name = name.removesuffix(".default")
    where = fmt_src(src, full=True)
    text = msg.format(int(flags[r, 1]), int(flags[r, 2]))
    error = exc(f"{text} (aten::{name} at {where}, checked on the xla device)")
    mask = 0
    for i in bad:
        mask |= 1 << int(i)
    return error, mask
