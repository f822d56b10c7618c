"""XLA's optimization barrier as an IR node (``xm.optimization_barrier_``).

Its outputs are its inputs, but XLA may not move computation across it nor merge what
comes after it with what came before: activation checkpointing needs this, or XLA's common
subexpression elimination folds the backward's recomputation back into the forward and
keeps the activations alive after all.
"""

from __future__ import annotations

from jax import lax

from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.ir.ops import TENSOR_LIST, Info, OpSpec, signature
from xlatorch.runtime.ir.values import Node
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, write

__all__ = ["optimization_barrier_", "BARRIER"]


def _emit(out, xs):
    return list(lax.optimization_barrier(tuple(xs)))


BARRIER = OpSpec("xla::optimization_barrier", None, _emit, ["inputs"], (TENSOR_LIST,), (False,), 1)


def optimization_barrier_(tensors) -> None:
    """In place: each tensor of ``tensors`` becomes its value through one optimization barrier
    (one node for all of them). Tensors not on the xla device are left alone."""
    ts = [t for t in tensors if type(t) is XlaTensor]
    if not ts:
        return
    vals = (tuple(value_of(t) for t in ts),)
    COUNTERS[BARRIER.name] += 1
    node = Node(BARRIER, vals, Info(tuple(v.aval for v in vals[0]), None), (BARRIER, signature(vals)))
    for t, v in zip(ts, node.outs):
        write(t, v)
