"""Collectives between threads: ``dp.DataParallel`` runs one replica per local device, each
in its own thread, and a step holding a collective must run as one SPMD execution.

Each replica's k-th replicated execution is round k. A thread deposits its inputs
for its round and waits; the last to arrive runs the program once for every device
and hands each thread its outputs. If a replica thread fails, ``abort`` wakes the
others with an error instead of leaving them waiting; if one returns (``leave``), a round
that still waits for it fails: it will never arrive.
"""

from __future__ import annotations

import threading

__all__ = ["run_replicated", "reset", "abort", "leave"]

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


def run_replicated(exe, dev: int, arrays, packed):
    """This replica's outputs of ``exe``, run once all ``exe.threads`` replicas have arrived."""
    n = exe.threads
    with _cond:
        k = _counts.get(dev, 0)
        _counts[dev] = k + 1
        rnd = _rounds.setdefault(k, {"inputs": {}, "outputs": None, "error": None})
        rnd["inputs"][dev] = (arrays, packed)
        if len(rnd["inputs"]) == n:
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
        if rnd["error"] is not None:
            raise rnd["error"]
        return rnd["outputs"][dev]
