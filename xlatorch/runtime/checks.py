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

import atexit
import math
import os
import sys
import threading

import numpy as np

from xlatorch.runtime.ir import Out

__all__ = ["ENABLED", "DEFER", "Table", "Keep", "undoable", "Unsettled", "failure", "where", "settle"]

_MODE = os.environ.get("XLATORCH_CHECKS", "1").strip().lower()
ENABLED = _MODE not in ("0", "false", "off", "no")
DEFER = _MODE != "sync"  # read a sync's rows when its results are next needed (see above)
_UNDO = os.environ.get("XLATORCH_CHECKS_UNDO", "").strip().lower()
if _UNDO not in ("", "graph", "keep"):
    raise ValueError(f"xlatorch: XLATORCH_CHECKS_UNDO must be 'graph' or 'keep', got {_UNDO!r}")
# Whether a checked step undoes itself in the graph (and donates what it updates): None until
# decided (by platform, see above), then True or False; part of each graph's key.
UNDO_IN_GRAPH: list = [{"graph": True, "keep": False}.get(_UNDO)]


def undo_in_graph(dev: int, kept=None) -> bool:
    """Whether checked steps undo themselves in the graph (see the module's docstring).
    ``kept``, at a compile: the device data a step would keep otherwise; on CPU, more than a
    quarter of the host's available memory switches this process to the graph."""
    mode = UNDO_IN_GRAPH[0]
    if mode is None:
        from xlatorch.runtime.transfer import jax_device

        mode = UNDO_IN_GRAPH[0] = jax_device(dev).platform != "cpu"
    if not mode and kept is not None and not _UNDO:
        from xlatorch.runtime.memory import host_available_bytes

        free = host_available_bytes()
        if free is not None and 4 * sum(math.prod(v.aval[0]) * v.aval[1].itemsize for v in kept) > free:
            mode = UNDO_IN_GRAPH[0] = True
    return mode


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
    from xlatorch.runtime.source import fmt_src

    name = name.removesuffix(".default")
    where = fmt_src(src, full=True)
    text = msg.format(int(flags[r, 1]), int(flags[r, 2]))
    error = exc(f"{text} (aten::{name} at {where}, checked on the xla device)")
    mask = 0
    for i in bad:
        mask |= 1 << int(i)
    return error, mask


class Keep(tuple):
    """``undoable``'s answer (the graph's key holds it); whether the graph undoes a failed
    step itself (``in_graph``); and, not in the key, ``between``: per root, the checked nodes
    its thread traced after the step's first write of it and before its last."""

    in_graph = False
    between: tuple = ()


def undoable(storages, nodes, leaves) -> Keep:
    """Per root: None, or ``(leaf, before)`` when its storage held device data before the step
    that a failed check gives back: leaf ``leaf`` of the graph, or -1 when the step overwrote
    it without reading it (``fill_``, ``copy_``: the sync keeps it); ``before``: a bit mask of
    the checked nodes its thread traced before the storage's last write. ``Keep.between``
    holds those of them traced after its first write in the step too (its value at such a
    node is gone: when one fails, the tensor carries the error)."""
    lpos = {id(v): i for i, v in enumerate(leaves)}
    ticks = [(k, n.tick) for k, n in enumerate(nodes) if n.info.checked]
    keep, betweens = [], []
    for st in storages:
        p = st.prev
        if p is None or p.aval != st.value.aval:
            keep.append(None)
            betweens.append(0)
            continue
        j = lpos.get(id(p), -1)
        before = between = 0
        for k, (t, who) in ticks:
            if t < st.gen and who == st.owner:  # traced after the check, by the same thread
                before |= 1 << k
                if t > st.first:  # and written before it too
                    between |= 1 << k
        keep.append((j, before))
        betweens.append(between)
    keep = Keep(keep)
    keep.between = tuple(betweens)
    return keep


class Unsettled:
    """A committed execution whose check rows are not read yet: what undoing it needs."""

    __slots__ = ("table", "flags", "names", "storages", "news", "prevs", "between")

    def __init__(self, table, flags, names, storages, news, prevs, between=()):
        self.table = table  # the executable's Table
        self.flags = flags  # the rows (a device array)
        self.names = names  # where(...)
        self.storages = storages  # the step's storages, in root order
        self.news = news  # the Data each was given by the commit
        # per storage: the Data that holds its data from before the step when the step failed
        # (the Data kept from before it, or its committed Data when the graph undid itself), or None
        self.prevs = prevs
        # per storage: the checked nodes traced between its first and last write in the step
        # (Keep.between): their failure leaves it no value to give back
        self.between = between


_UNSETTLED: list = []  # executions not read yet: each sync first settles those before it
_THREAD: list = [None]  # the one thread using the device (None: none yet; False: several have)
os.register_at_fork(after_in_child=lambda: _THREAD.__setitem__(0, None))  # a child's main thread is new


def deferrable(storages) -> bool:
    """Whether the rows of a step that computed ``storages`` may be read late: every thread
    that used the device so far, and every owner of the step's tensors, is this one."""
    me = threading.get_ident()
    t = _THREAD[0]
    if t is None:
        t = _THREAD[0] = me
    if t is not False and (t != me or any(st.owner != me for st in storages)):
        t = _THREAD[0] = False
    return t is not False


def defer(u: Unsettled) -> None:
    if not _UNSETTLED and not _exit_hook:  # after JAX's own exit hooks (they run in reverse)
        _exit_hook.append(atexit.register(_at_exit))
    _UNSETTLED.append(u)


_exit_hook: list = []


def settle() -> None:
    """Read the check rows of every execution not read yet, oldest first; when one is set,
    undo that step (see the module's docstring) and raise its error."""
    if not _UNSETTLED:
        return
    from xlatorch.runtime.tensor import LOCK

    with LOCK:
        while _UNSETTLED:  # oldest first (a sync running parts apart may leave more than one)
            undo(_UNSETTLED.pop(0), late=True)


def undo(u: Unsettled, late: bool = False) -> None:
    """Read ``u``'s rows; when one fired: each root the failed op reaches (or traced after it)
    gets its data from before the step back, or carries the error; raise it."""
    from xlatorch.runtime import failure as failed
    from xlatorch.runtime.record import COUNTERS

    COUNTERS["CheckRowsRead"] += 1
    try:
        found = failure(u.table.rows, u.flags, u.names)
    except Exception as e:  # the execution itself failed (reading its rows raises that): all of it
        found = e, -1
    if found is None:
        return
    error, fired = found
    from xlatorch.runtime.execution import uninterrupted

    with uninterrupted():  # an interrupt must not leave the step half undone
        hit, bad = [], {}  # the roots the failure reaches; id(Data) -> their results, not to be read
        for i, (st, mask, back) in enumerate(zip(u.storages, u.table.masks, u.table.undo)):
            if fired == -1:  # no results: what was kept goes back; what the graph was to undo is gone
                mask, back = -1, 0 if u.prevs[i] is u.news[i] else -1
            # Written before the failed op and after it: its value at that op is gone, it fails.
            lost = u.table.rows_of(u.between[i]) if u.between and u.between[i] else 0
            give = u.prevs[i] is not None and back & fired and (fired == -1 or not lost & fired)
            if give or (mask | back) & fired:
                hit.append((i, st, give))
                bad[id(u.news[i])] = u.news[i]
        tainted = set()
        if late:
            error.add_note(
                "xlatorch: found when the results of the step were next needed (on-device checks are read "
                "then; XLATORCH_CHECKS=sync reads them at each step's mark_step); the step's updates, and "
                "those traced from its results since, were undone"
            )
            tainted = failed.poison(bad, error)
        for i, st, give in hit:
            v = st.value
            if v is not u.news[i] and not (type(v) is Out and id(v.node) in tainted):
                if st.prev is u.news[i]:  # the program gave it a value of its own since: kept
                    st.prev = None if fired == -1 and u.prevs[i] is u.news[i] else u.prevs[i]
                continue
            if give:
                failed.give_back(st, u.prevs[i], error)
            else:
                failed.fail_storages([st], error)
    failed.raise_owned(error, [st for st, m in zip(u.storages, u.table.masks) if m & fired or fired == -1])


def _at_exit() -> None:
    """A program whose last step failed a check does not end as if it had succeeded."""
    try:
        settle()
    except BaseException as e:  # noqa: BLE001 - reported, then the exit status says so
        import traceback

        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
