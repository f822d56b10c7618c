"""A fault costs at most the step it hit: what a failed step does to its tensors.

A tensor the failed step updated in place gets its data from before the step back when it
still exists (``give_back_or_fail``); the others carry the error as a failed value
(runtime/ir/failed.py), raised by the sync that reads them, in the thread that made them
(``raise_owned``). A graph that reads a failed value runs its healthy part (``split_failed``);
one that cannot run is run by its independent parts (``components``).
"""

from __future__ import annotations

import threading

from xlatorch.runtime.base.threads import _in_backward, defer_to_owners, owner
from xlatorch.runtime.ir.failed import cause, failed_value, is_failed
from xlatorch.runtime.ir.values import Out, operands, replace_operands
from xlatorch.runtime.trace.tensor import PENDING, fail_storages, pending_storages

__all__ = ["give_back_or_fail", "give_back", "poison", "components", "fail_storages", "split_failed", "raise_owned"]


def give_back_or_fail(storages, error) -> None:
    """Each storage gets back its device data from before the step if it still has it (the
    step's update did not happen), else holds ``error`` as a failed value."""
    for st in storages:
        prev = st.prev
        if prev is not None and prev.aval == st.value.aval:
            give_back(st, prev, error)
        else:
            fail_storages([st], error)


def give_back(st, prev, error) -> None:
    """``st`` holds ``prev`` again, its device data from before a step that did not happen (a
    pending update of it since is dropped), or ``error`` if that data is gone."""
    if prev.array.is_deleted():
        fail_storages([st], error)
        return
    st.set(prev)
    st.prev = None
    PENDING.pop(st.sid, None)


def poison(bad: dict, error: Exception) -> set:
    """Pending values that read device data in ``bad`` (``id`` -> ``Data``: results of a step
    found failed after the program went on) read a value failed with ``error`` instead.
    Returns the ids of the nodes that read it, directly or not."""
    tainted: set = set()
    if not bad:
        return tainted
    new = {k: failed_value(d.aval, error) for k, d in bad.items()}
    seen: set = set()
    stack = [(st.value.node, False) for st in pending_storages()]
    while stack:  # post-order: a node's operands before it
        n, ready = stack.pop()
        if ready:
            ops = operands(n.args)
            if any(id(v) in new for v in ops if type(v) is not Out):
                n.args = replace_operands(n.args, new)
                tainted.add(id(n))
            elif any(type(v) is Out and id(v.node) in tainted for v in ops):
                tainted.add(id(n))
        elif id(n) not in seen:
            seen.add(id(n))
            stack.append((n, True))
            stack.extend((v.node, False) for v in operands(n.args) if type(v) is Out and id(v.node) not in seen)
    return tainted


def components(storages, nodes) -> list[list]:
    """The storages grouped by the independent parts of their graph (no shared node or leaf)."""
    parent: dict[int, int] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in nodes:
        a = find(id(n))
        for v in operands(n.args):
            b = find(id(v.node) if type(v) is Out else id(v))
            if a != b:
                parent[b] = a
    groups: dict[int, list] = {}
    for st in storages:
        v = st.value
        groups.setdefault(find(id(v.node) if type(v) is Out else id(v)), []).append(st)
    return list(groups.values())


def split_failed(storages, nodes):
    """(healthy storages, the first error) after poisoning the roots that read a failed value."""
    bad: dict[int, Exception] = {}
    for n in nodes:  # post-order: operands first
        if is_failed(n):
            bad[id(n)] = n.args[0]
            continue
        for v in operands(n.args):
            if type(v) is Out and id(v.node) in bad:
                bad[id(n)] = bad[id(v.node)]
                break
    if not bad:
        return storages, None
    healthy, first = [], None
    for st in storages:
        err = bad.get(id(st.value.node))
        if err is None:
            healthy.append(st)
        else:
            first = first or err
            give_back_or_fail([st], err)  # an update that read a failed value did not happen
    return healthy, first


def raise_owned(error: BaseException, storages) -> None:
    """Raise ``error`` if one of ``storages`` (those it affects) is this thread's (or none is
    known); otherwise leave it for the threads that made them.

    Another thread is not given a fault it was already given (``error`` reading a value that
    failed with it): its values that read the failed ones were traced before it learned of
    the fault (this thread's sync ran part of its step), as CPU would never have made them.
    They carry the error: reading one raises it."""
    owners = {st.owner for st in storages}
    told = _told(cause(error))
    if _in_backward() == -1:
        me = threading.get_ident()
        if not owners or None in owners or me in owners:
            told.add(me)
            raise error
    elif not owners:  # on autograd's device thread nothing may raise: the caller raises it
        owners = {owner()}
    owners = {o for o in owners if o is None or o not in told}
    told.update(o for o in owners if o is not None)
    if owners:
        defer_to_owners(error, owners)


def _told(error: BaseException) -> set:
    """The threads given ``error`` (raised there, or left for them to raise)."""
    told = getattr(error, "_xlatorch_told", None)
    if told is None:
        told = set()
        error._xlatorch_told = told
    return told
