"""What a checked step keeps to undo itself when one of its on-device checks fails.

A tensor the step updated in place (a parameter, optimizer state) gets its data from before
the step back when its update depends on the failed op or was traced after it; the graph
either selects that data itself (``undo_in_graph``: accelerators, whose memory is scarce) or
the sync keeps the old buffer (CPU). See runtime/lower/checks.py for the whole story.
"""

from __future__ import annotations

import math

from xlatorch.runtime.base import config, memory
from xlatorch.runtime.base.topology import jax_device

__all__ = ["Keep", "Unchecked", "UNCHECKED", "undoable", "undo_in_graph", "UNDO_IN_GRAPH"]

_UNDO = config.env("XLATORCH_CHECKS_UNDO")  # "graph", "keep", or None: by platform
# Whether a checked step undoes itself in the graph (and donates what it updates): None until
# decided (by platform, see above), then True or False; part of each graph's key.
UNDO_IN_GRAPH: list = [{"graph": True, "keep": False}.get(_UNDO)]


def undo_in_graph(dev: int, kept=None) -> bool:
    """Whether checked steps undo themselves in the graph (see the module's docstring).
    ``kept``, at a compile: the device data a step would keep otherwise; on CPU, more than a
    quarter of the host's available memory switches this process to the graph."""
    mode = UNDO_IN_GRAPH[0]
    if mode is None:
        mode = UNDO_IN_GRAPH[0] = jax_device(dev).platform != "cpu"
    if not mode and kept is not None and not _UNDO:
        need = 4 * sum(math.prod(v.aval[0]) * v.aval[1].itemsize for v in kept)
        # Reading the host's memory opens three files (0.1 ms, at every compile of a generation
        # loop's growing step): not for data too small to matter to any host still running.
        if need > _SMALL:
            free = memory.host_available_bytes()
            if free is not None and need > free:
                mode = UNDO_IN_GRAPH[0] = True
    return mode


_SMALL = 64 << 20  # four times the kept data, below which the host's memory is not read


class Keep(tuple):
    """``undoable``'s answer (the graph's key holds it); whether the graph undoes a failed
    step itself (``in_graph``); and, not in the key, ``between``: per root, the checked nodes
    its thread traced after the step's first write of it and before its last."""

    in_graph = False
    between: tuple = ()


class Unchecked(Keep):
    """A checked step whose checks were decided before it ran (``plan/prechecks.py``): it keeps
    nothing and is lowered without its checks."""

    unchecked = True


UNCHECKED = Unchecked()


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
