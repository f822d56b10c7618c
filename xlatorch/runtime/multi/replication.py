"""Collectives between threads: ``dp.DataParallel`` runs one replica per local device, each
in its own thread, and a step holding a collective must run as one SPMD execution.

Each replica's k-th replicated execution is round k. A thread deposits its inputs
for its round and waits; the last to arrive runs the program once for every device
and hands each thread its outputs. If a replica thread fails, ``abort`` wakes the
others with an error instead of leaving them waiting; if one returns (``leave``), a round
that still waits for it fails: it will never arrive.

The replicas of a round must have built the same program: one runs it for all. Which
pending tensors a replica's step computes can differ by timing alone (autograd's device
thread, shared by the replicas, may still hold a temporary of one replica's backward
pass when that replica syncs), so every replica deposits its program's signature and a
round whose signatures differ runs nothing: each replica gets ``ReplicaMismatch`` and
runs its step again in two parts (``execute/sync.py``).
"""

from __future__ import annotations

import threading

import torch

from xlatorch.runtime.ir.values import Out, operands
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES

__all__ = ["run_replicated", "reset", "abort", "leave", "ReplicaMismatch", "collective_roots"]

_cond = threading.Condition()
_rounds: dict[int, dict] = {}
_counts: dict[int, int] = {}
_state = {"error": None}
_left: set[int] = set()  # replicas whose thread has returned


def reset() -> None:
    with _cond:
        _rounds.clear()
        _counts.clear()
        _left.clear()
        _state["error"] = None


def abort(error: BaseException) -> None:
    """Wake every waiting replica with ``error`` (a replica thread died)."""
    with _cond:
        _state["error"] = error
        _cond.notify_all()


def leave(dev: int) -> None:
    """Replica ``dev``'s thread returned: it joins no more rounds. A round waiting for it
    raises (the replicas ran different collective steps) instead of waiting forever."""
    with _cond:
        _left.add(dev)
        _cond.notify_all()


class ReplicaMismatch(RuntimeError):
    """The replicas of a round built different programs; nothing ran."""


def run_replicated(exe, dev: int, arrays, packed, signature):
    """This replica's outputs of ``exe``, run once all ``exe.threads`` replicas have arrived.
    Raises ``ReplicaMismatch`` (nothing ran) if their programs' ``signature``s differ."""
    n = exe.threads
    with _cond:
        k = _counts.get(dev, 0)
        _counts[dev] = k + 1
        rnd = _rounds.setdefault(k, {"inputs": {}, "signatures": {}, "outputs": None, "error": None})
        rnd["inputs"][dev] = (arrays, packed)
        rnd["signatures"][dev] = signature
        if len(rnd["inputs"]) == n:
            sigs = list(rnd["signatures"].values())
            if any(not _same_program(s, sigs[0]) for s in sigs[1:]):
                rnd["error"] = ReplicaMismatch
            else:
                try:
                    outs = exe.run_all([rnd["inputs"][d] for d in range(n)])
                    rnd["outputs"] = dict(enumerate(outs))
                except BaseException as e:  # noqa: BLE001 (every replica raises it)
                    rnd["error"] = e
            del _rounds[k]
            _cond.notify_all()
        while rnd["outputs"] is None and rnd["error"] is None:
            if _state["error"] is not None:
                raise RuntimeError("xlatorch: another DataParallel replica failed") from _state["error"]
            gone = sorted(_left.difference(rnd["inputs"]))
            if gone:
                raise RuntimeError(
                    f"xlatorch: DataParallel replica {gone[0]} returned without joining this step's "
                    f"collectives (device {dev}'s replicated step {k + 1}): every replica must run the "
                    "same collectives (xm.optimizer_step, xm.all_reduce ...) in the same order, "
                    "the same number of times"
                )
            _cond.wait(timeout=1.0)
        if rnd["error"] is ReplicaMismatch:
            raise ReplicaMismatch(f"xlatorch: DataParallel replicas built different programs (replicated step {k + 1})")
        if rnd["error"] is not None:
            raise rnd["error"]
        return rnd["outputs"][dev]


def _same_program(a, b) -> bool:
    """Whether two replicas' program signatures are one program: equal but for the device a
    factory op names (each replica's own, placed by the replicated execution)."""
    return a == b or _canon(a) == _canon(b)


def _canon(x):
    if type(x) is tuple:
        return tuple(_canon(y) for y in x)
    if type(x) is torch.device:
        return x.type
    return x


def collective_roots(storages, nodes) -> list:
    """The storages whose pending value reads a collective's result (``nodes``: post-order):
    what every replica computes alike, unlike the values a replica's step alone holds."""
    reads: set[int] = set()
    for n in nodes:
        if n.spec in COLLECTIVES or any(type(v) is Out and id(v.node) in reads for v in operands(n.args)):
            reads.add(id(n))
    return [st for st in storages if type(st.value) is Out and id(st.value.node) in reads]
