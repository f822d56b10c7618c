"""A step's on-device checks decided before it runs, from data the host holds.

A checked step (``runtime/lower/checks.py``) computes its checks' rows beside its results, and
until the rows are read the step keeps what it updates in place so that a check that fires can
give it back: on CPU the old buffers are kept (nothing updated is donated), on an accelerator
the graph selects them itself. Most training steps have one kind of check only, on data that
came from the host: a loss's targets, an embedding's token ids (uploaded from a CPU batch,
``Data.host``). Those checks can be computed before the step runs.

``decided(nodes)`` is True when every checked node's checks read only such data (values the
host holds, views and same-dtype copies of them, taken on the host: ``_held``; and the shapes
of everything else) and none fires: the step then compiles and runs
without checks (its key says so), donating as an unchecked step does, and reads no rows. When
one reads a value the host does not hold (an index computed on the device), or one fires, the
step runs checked as before, and a check that fires raises there with CPU's error and undoes
the step as usual. The checks are the ops' own (``L.checks``), computed with numpy on the
host's values (those written for it: index bounds, loss targets, integer divisors; a check
that is not, or that reads a value the host does not hold, is not decided so for that node's
signature again). A node holding a whole graph of ``torch.compile`` gives its checked ops
(``trace/fx.FxProgram.inner_checks``: the graph's inputs as the node's arguments, what the graph
computes itself as shapes only), decided the same way; a loop's body keeps its checks on the
device. Counter ``ChecksOnHost``: steps whose checks were decided so.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.ir.values import Data, Out, Scalar
from xlatorch.runtime.plan.stages import bookkeeping, small_integral
from xlatorch.runtime.trace.fx import Inner
from xlatorch.runtime.trace.nodes import run_node_on_cpu

__all__ = ["decided", "carried"]

_UNDECIDABLE: set = set()  # (node key, which arguments the host holds) whose check is not decided so
_LIMIT = 1024
_DECIDED = (bool, np.bool_)  # what a check computed on the host gives


class _Shape:
    """A tensor the host does not hold, for a check: its shape and dtype, and no value (any
    use of one raises, so the check is not decided on the host)."""

    __slots__ = ("shape", "dtype", "ndim", "size")

    def __init__(self, aval):
        self.shape = tuple(aval[0])
        self.dtype = np.dtype(to_jax(aval[1]))
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)

    def _no_value(self, *_):
        raise TypeError("xlatorch: a check read a value the host does not hold")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __array__ = __jax_array__ = _no_value
    __add__ = __sub__ = __mul__ = __getitem__ = __and__ = __or__ = __invert__ = __neg__ = _no_value
    __hash__ = object.__hash__


def _struct(aval):
    if aval is None:
        return None
    s = _STRUCTS.get(aval)
    if s is None:  # one per aval: checks only read them
        if len(_STRUCTS) >= _LIMIT:
            _STRUCTS.clear()
        s = _STRUCTS[aval] = _Shape(aval)
    return s


_STRUCTS: dict = {}


def _args(args, host: list, views: dict) -> tuple:
    """The node's arguments for its check, each ``("h", i)``: a value the host holds,
    ``host[i]`` (appended here); ``("s", shape)``: a tensor the host does not hold, its shape
    only; ``("t", parts)``: a list of tensors; ``("v", a)``: a static argument. ``views``:
    the host values of views found so far (``_held``)."""
    out = []
    for a in args:
        t = type(a)
        h = a.host if t is Data else _held(a, views) if t is Out else None
        if h is not None:
            out.append(("h", len(host)))
            host.append(h)
        elif t is Data or t is Out:
            out.append(("s", _struct(a.aval)))
        elif t is Scalar:  # a parameter too: its value changes from step to step
            out.append(("h", len(host)))
            host.append(torch.tensor(a.value, dtype=a.aval[1]))
        elif t is Inner:  # computed inside a compiled graph's node
            out.append(("s", _struct(a.aval)))
        elif t is torch.Tensor:  # a compiled graph's constant
            out.append(("h", len(host)))
            host.append(a)
        elif t is tuple and any(type(x) in (Data, Out, Scalar) for x in a):
            out.append(("t", _args(a, host, views)))
        else:
            out.append(("v", a))
    return tuple(out)


def _held(v, views: dict, depth: int = 0):
    """The host's value of pending value ``v`` when it is a view (``spec.view``: a slice, a
    ``view``, a transpose), a same-dtype copy (ops.yaml ``copies``: a tensor made on the device
    from a Python list is a copy of the host's upload) or small integer arithmetic
    (``stages.bookkeeping``) of data the host holds, or of such a value: computed by PyTorch on
    the host, exactly as CPU computes it (a language model's targets are ``y.view(-1)``, its
    positions ``positions[:t]``, a decode loop's next position ``pos + 1``). None otherwise.
    Found values are kept in ``views`` (by ``id``) for the graph's other checks."""
    found = views.get(id(v), views)
    if found is not views:
        return found
    n = v.node
    res = None
    spec = n.spec
    same = (
        spec.view
        or (spec.copies and type(n.args[0]) in (Data, Out) and n.args[0].aval[1] == v.aval[1])
        or bookkeeping(n)  # integer arithmetic on such values: a decode loop's ``pos + 1``
    )
    # What the host holds is small integer data; a view as large as a float tensor (an expand) is not taken
    if (
        same
        and small_integral(v.aval)
        and n.outs is not None
        and depth < 8
        and isinstance(spec.overload, torch._ops.OpOverload)
    ):

        def conv(a):
            t = type(a)
            if t is Data:
                x = a.host
            elif t is Out:
                x = _held(a, views, depth + 1)
            elif t is tuple:
                return [conv(x) for x in a]
            else:
                return a.value if t is Scalar else a
            if x is None:
                raise LookupError
            return x

        try:
            res = run_node_on_cpu(n, conv)[v.idx]
        except Exception:  # an operand the host does not hold, or an op PyTorch refuses here
            res = None
        finally:
            conv = None  # noqa: F841 - it refers to itself: a cycle the collector would free
        if res is not None and (tuple(res.shape), res.dtype) != v.aval:
            res = None
    views[id(v)] = res
    return res


def _pattern(layout) -> tuple:
    """Which arguments are the host's values (the same node key may have other ones)."""
    return tuple(_pattern(x) if kind == "t" else kind for kind, x in layout)


def _fill(layout, vals) -> list:
    out = []
    for kind, x in layout:
        if kind == "h":
            out.append(vals[x])
        elif kind == "t":
            out.append(tuple(_fill(x, vals)))
        else:
            out.append(x)
    return out


def _flat(layout):
    for kind, x in layout:
        if kind == "t":
            yield from _flat(x)
        else:
            yield kind, x


def _bads(spec, info, layout, vals) -> list:
    """An op's check over the host's values ``vals`` (numpy): its rows' ``bad`` flags."""
    first = [_struct(a) for a in info.avals]
    first = first[0] if len(first) == 1 and spec.returns == 0 else tuple(first)
    args = _fill(layout, vals)
    if info.cdtype is not None:  # as emit_node casts the promoting arguments
        cd = np.dtype(to_jax(info.cdtype))
        for i in spec.promote_idx:
            a = args[i]
            if type(a) is np.ndarray and a.dtype != cd:
                args[i] = a.astype(cd)
    found = spec.check(first, *args)
    return [r[0] for r in (found if isinstance(found, list) else [found]) if r is not None]


def _same(spec, info, args):
    """What an op's check decides, as a key: its expression (ops.yaml ``check``) and the
    values it reads (tensors by identity, static arguments by value, each with the dtype the check
    casts it to), and the outputs' avals if it reads them. ``nll_loss_backward`` checks its
    forward's targets again: equal keys, one answer. None for an op whose check reads nothing
    recorded; the key may hold an argument that is not hashable (``decided`` skips those)."""
    reads = spec.check_reads
    if reads is None:
        return None
    expr, at, out = reads
    cd = info.cdtype
    return expr, tuple((args[i], cd if i in spec.promote_idx else None) for i in at), info.avals if out else None


def decided(nodes, cut=None, views=None) -> bool:
    """Whether the checks of ``nodes`` (a graph's, or a stage's) are all decided on the host,
    none firing. ``cut``: a staged step's values computed so far (``id(Out)`` -> ``Data``): those
    a host stage made are the host's values too. ``views``: a dict that gets the host values
    found (for ``carried``)."""
    ops = []  # per checked op: its key, spec, info and arguments
    for n in nodes:
        if not n.info.checked:
            continue
        if isinstance(n.spec.overload, torch._ops.OpOverload):
            ops.append((n.key, n.spec, n.info, n.args))
            continue
        # A compiled graph's node (torch.compile: a generation step's forward) holds its checked
        # ops; a loop's body does not give them: its checks stay on the device
        inner = n.spec.inner_checks(n.args[0]) if n.spec.inner_checks is not None else None
        if inner is None:
            return False
        ops.extend(((n.key, k), spec, info, args) for k, spec, info, args in inner)
    if views is None:
        views = {}
    if cut:
        views.update((k, d.host) for k, d in cut.items() if d.host is not None)
    passed: set = set()  # the checks decided so far, as _same's keys: a loss's backward repeats its forward's
    for node_key, spec, info, args in ops:
        same = _same(spec, info, args)
        if same is not None:
            try:
                if same in passed:
                    continue
                passed.add(same)
            except TypeError:  # an argument that is not hashable: decided on its own
                pass
        host: list = []
        layout = _args(args, host, views)
        if not any(k == "h" for k, _ in _flat(layout)):
            return False  # nothing the host holds: the check reads the device's values
        key = (node_key, _pattern(layout))
        if key in _UNDECIDABLE:
            return False
        try:
            bads = _bads(spec, info, layout, [h.numpy() for h in host])
        except Exception:  # it reads a value the host does not hold (a shape-only stand-in)
            bads = None
        # A check not written for numpy gives device values (jax.numpy on host arrays: never
        # read here, so never waited for behind the running step): not decided on the host.
        if bads is None or not all(type(b) in _DECIDED for b in bads):
            if len(_UNDECIDABLE) >= _LIMIT:
                _UNDECIDABLE.clear()
            _UNDECIDABLE.add(key)
            return False
        if any(bads):
            return False  # it fires: the step runs checked, and raises as it always has
    if ops:
        COUNTERS["ChecksOnHost"] += 1
    return bool(ops)


def carried(values, views: dict) -> list | None:
    """After ``decided`` (its ``views``): per value of a step's results, its host value where the
    host takes it from what it holds (``_held``), else None; None when it takes none. The step
    gives it to the result's data (``Data.host``), so that a decode loop's position stays known to
    the host from step to step: its next step's checks (the cache write at that position) are
    decided on the host too, and the step runs unchecked and donates the cache it updates."""
    out = None
    for i, v in enumerate(values):
        if type(v) is Out and small_integral(v.aval):
            h = _held(v, views)
            if h is not None:
                if out is None:
                    out = [None] * len(values)
                out[i] = h
    return out
