"""Dry runs: a program traced exactly as usual, with nothing compiled, run or uploaded.

``python -m xlatorch.check`` runs a user's training step this way. Every op goes through the
same dispatch as in a real run (lowered, decomposed, CPU fallback, data-dependent), every
sync cuts the graph where a real run would and reports it through the same hooks, and a
graph a real run would compile is reported through ``record.COMPILE_HOOKS`` (without an
executable) once per key. What a dry run does not have is device data: a
``DryArray`` holds a shape and a dtype, plus the host tensor an upload came from or the
value it stands for. Read on the host (``.item()``, a CPU fallback's inputs), it is computed
then with PyTorch's CPU kernels, op by op, from the uploads' values, so a Python branch on a
value read on the host goes the way it goes in a real run. Only what is read is computed;
what cannot be (a random op, a hand-written node with no ATen op) reads as zeros.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from xlatorch.runtime.base.dtypes import EXACT, JAX_TO_TORCH
from xlatorch.runtime.ir.values import Data, Out, Scalar
from xlatorch.runtime.trace.nodes import run_node_on_cpu

__all__ = ["ACTIVE", "DryArray", "dry_run", "first_time"]

ACTIVE = [False]  # read at every upload and sync
LOWER = [True]  # trace each new graph's lowering with JAX (catches ops whose lowering fails; not compiled)
_KEYS: set = set()  # graph keys a real run would have compiled by now (this dry run)


class DryArray:
    """Device data that was never made: a shape and a dtype, and where its value comes from
    (``host``: the CPU tensor uploaded; ``source``: the pending value it stands for)."""

    __slots__ = ("shape", "dtype", "host", "source")

    is_fully_addressable = True

    def __init__(self, shape, dtype, host=None, source=None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.host = host
        self.source = source

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        t = value(self)
        if t.dtype == torch.bfloat16:
            a = t.contiguous().view(torch.int16).numpy().view(EXACT[torch.bfloat16])
        else:
            a = t.numpy()
        return a.astype(dtype or self.dtype)

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self):
        return self


def value(arr: DryArray) -> torch.Tensor:
    """``arr``'s value as a CPU tensor, computed now if it was not known (then kept)."""
    if arr.host is None:
        arr.host = _evaluate(arr)
        arr.source = None  # the graph behind it is not needed any more
    return arr.host


def _zeros(aval) -> torch.Tensor:
    return torch.zeros(aval[0], dtype=aval[1])


def _evaluate(arr: DryArray) -> torch.Tensor:
    src = arr.source
    if src is None:
        return torch.zeros(arr.shape, dtype=JAX_TO_TORCH[arr.dtype])
    done: dict = {}  # id(node) -> its CPU results
    stack = [src.node]
    while stack:  # post-order without recursion: a step's graph is thousands of nodes deep
        n = stack[-1]
        if id(n) in done:
            stack.pop()
            continue
        todo = [o.node for o in _operands(n.args) if type(o) is Out and id(o.node) not in done]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        done[id(n)] = _run_node(n, done)
    return done[id(src.node)][src.idx]


def _operands(args):
    for a in args:
        if type(a) is tuple:
            yield from (x for x in a if type(x) in (Data, Out, Scalar))
        elif type(a) in (Data, Out, Scalar):
            yield a


def _host(a, done):
    t = type(a)
    if t is Out:
        return done[id(a.node)][a.idx]
    if t is Scalar:
        return torch.tensor(a.value, dtype=a.aval[1]) if a.tensor else a.value
    if t is Data:
        arr = a.array
        return value(arr) if type(arr) is DryArray else torch.from_numpy(np.asarray(arr).copy())
    if t is tuple:
        return [_host(x, done) for x in a]
    if isinstance(a, torch.device) and a.type == "xla":
        return torch.device("cpu")
    return a


def _run_node(n, done) -> list:
    """A node's outputs computed by its ATen op on CPU; zeros where that is not possible."""
    try:
        res = run_node_on_cpu(n, lambda a: _host(a, done))
        if len(res) != len(n.outs):
            raise ValueError("output count")
        return [None if o is None else r.to(o.aval[1]).reshape(o.aval[0]) for o, r in zip(n.outs, res)]
    except Exception:  # an op PyTorch's CPU kernels cannot run as recorded: its value is unknown
        return [None if o is None else _zeros(o.aval) for o in n.outs]


def first_time(key) -> bool:
    """True the first time this dry run meets graph ``key`` (a real run would compile it)."""
    if key in _KEYS:
        return False
    _KEYS.add(key)
    return True


@contextlib.contextmanager
def dry_run(lower: bool = True):
    """Trace without device work until the block ends (not reentrant; one thread);
    ``lower``: also trace each new graph's lowering (JAX tracing, no XLA compile)."""
    if ACTIVE[0]:
        raise RuntimeError("xlatorch: a dry run is already active")
    ACTIVE[0], LOWER[0] = True, lower
    _KEYS.clear()
    try:
        yield
    finally:
        ACTIVE[0] = False
        _KEYS.clear()
