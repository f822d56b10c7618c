"""Stages of a graph that run on the host: PyTorch's CPU kernels, node by node.

runtime/plan/stages.py decides which nodes may (``bookkeeping``: small integer tensors of a
generation loop; ``exact``: float ops that give the same bits on the host); ``on_host`` runs
them; what the next stage or the step's tensors read stays on the host until a graph reads it.
"""

from __future__ import annotations

import torch

from xlatorch.runtime.base import record
from xlatorch.runtime.execute.transfer import from_array
from xlatorch.runtime.ir.values import Data, Out, Scalar
from xlatorch.runtime.plan.stages import bookkeeping, exact
from xlatorch.runtime.trace.nodes import run_node_on_cpu

__all__ = ["on_host"]


def on_host(nodes, cut, roots, gdev, whole=False, known=None) -> list | None:
    """Run a stage's ``nodes`` on the host with PyTorch's CPU kernels: ``roots``' values, as
    device data held on the host (``Data.host``; uploaded when a graph reads one); None when
    the stage may not run there: a value that is not a small integer or boolean tensor
    (``whole``, a tiny graph: nor an exact float op), a random op, or an op that raises (the
    caller then compiles the stage, and a real error is reported from the device as usual).
    ``known``: values the host computed already, by ``id(Out)`` (``prechecks.decided``'s, by
    the same kernels): a node whose outputs are all there is not run again."""
    if not all((exact if whole else bookkeeping)(n) for n in nodes):
        return None
    host: dict = {}  # id(value) -> CPU tensor

    def value(a):
        t = type(a)
        if t is Out or t is Data:
            x = host.get(id(a))
            if x is None:
                d = cut.get(id(a), a)  # an earlier stage's output, or a leaf
                x = d.host
                if x is None:
                    with record.TIMED("TransferFromDeviceTime"):
                        x = d.host = from_array(d.array, d.aval[1])  # kept: small, read again next time
                host[id(a)] = x
            return x
        if t is Scalar:
            return torch.tensor(a.value, dtype=a.aval[1]) if a.tensor else a.value
        if t is tuple:
            return [None if x is None else value(x) for x in a]
        return a

    known = known or {}
    try:
        for n in nodes:
            outs = n.outs
            if outs and all(o is not None and id(o) in known for o in outs):
                for o in outs:
                    host[id(o)] = known[id(o)]
                continue
            res = run_node_on_cpu(n, value)
            for o, r in zip(n.outs, res):
                if o is not None:
                    if (tuple(r.shape), r.dtype) != o.aval:
                        return None
                    host[id(o)] = r
    except Exception:
        return None
    finally:
        # ``value`` refers to itself (a tuple's parts): without this the cycle, with the stage's
        # host values and device data, waits for the cyclic collector (two a generated token)
        value = None  # noqa: F841
    if not whole:
        record.COUNTERS["StageOnHost"] += 1
    return [Data(None, o.aval, gdev, host[id(o)]) for o in roots]  # uploaded when a graph reads it
