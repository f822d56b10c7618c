"""A function traced once as a body: the part of the runtime every loop node and replayed
function shares.

``trace_body`` runs a function once on placeholder tensors (the body's inputs) and keeps what
it computed as a ``Body`` (``ir/body.py``): a lowering plan over its inputs and the values it
captured from outside (device data, host numbers, pending values), which become the operands
of the node holding it (``loops.py``). Nodes of the body that do not depend on its inputs
are left outside, computed once (a weight's transpose, a constant): loop-invariant code
motion for free. ``trace_values`` + ``body_of`` make several bodies from one trace (a loop's
forward and backward, split where the backward reads the forward).

A body is a function of its inputs: it may not write a tensor made outside it (the write is
undone and the error says so) or read a value on the host (a sync while a body is traced
raises, runtime/execute/sync.py), and its temporaries have no value outside it (reading one
raises). ``swapped`` makes tensors from outside read as inputs of the body (a loop's
parameters, for its backward).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from xlatorch.runtime.base.source import fmt_src
from xlatorch.runtime.base.threads import BODIES, TICKS
from xlatorch.runtime.ir.body import Body, plan
from xlatorch.runtime.ir.ops import GENERATOR, ONE, STATIC, Info, OpSpec, _sig
from xlatorch.runtime.ir.values import Data, Node, Out, Scalar, operands
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES
from xlatorch.runtime.trace.tensor import PENDING, XlaTensor, fail_storages, value_of, wrap

__all__ = [
    "BodyError",
    "InputWrittenError",
    "trace_body",
    "trace_values",
    "body_of",
    "depends",
    "swapped",
    "values_of",
    "avals_of",
]


class BodyError(RuntimeError):
    """A function traced as a loop body (or a pure function) did what a body cannot."""


def _input_lowered(out, index):
    raise AssertionError(f"input {index} of a body was lowered outside its body")


_INPUT = OpSpec("xlatorch::body_input", None, _input_lowered, ("index",), (STATIC,), (False,), ONE)


class InputWrittenError(BodyError, AssertionError):
    """A body wrote one of its inputs in place where that input stands for the user's tensor."""


def trace_body(fn, avals, name: str, requires_grad=(), constants: bool = False, frozen=()) -> tuple[Body, list, list]:
    """Trace ``fn(inputs)`` once, ``inputs``: one placeholder tensor per aval (those at the
    positions in ``requires_grad`` require grad); ``fn`` returns a list of xla tensors.

    Returns the body, the values it captured (the node's operands after the inputs) and what
    ``fn`` returned (the tensors, for their ``requires_grad``; their values are the body's).
    ``constants``: see ``body_of``; ``frozen``: see ``trace_values``."""
    inputs, vals, outs = trace_values(fn, avals, name, requires_grad, frozen)
    body, captured = body_of(vals, inputs, name, constants)
    return body, captured, outs


def trace_values(fn, avals, name: str, requires_grad=(), frozen=()) -> tuple[list, list, list]:
    """Trace ``fn`` as ``trace_body`` does; returns the inputs' values, the results' values and
    the result tensors, for ``body_of`` to make one or several bodies from. The inputs at the
    positions in ``frozen`` may not be written in place (``InputWrittenError``): where the
    user's own tensor would be written by the same code run eagerly."""
    first_sid = next(TICKS)  # storages made from here on are the body's (ids are creation ticks)
    snapshot = {sid: r().value for sid, r in list(PENDING.items()) if r() is not None}
    inputs = []
    for i, aval in enumerate(avals):
        t = wrap(Node(_INPUT, (i,), Info((aval,), None), ("body_input", i, aval)).outs[0])
        if i in requires_grad:
            t.requires_grad_(True)
        inputs.append(t)
    in_vals = [value_of(t) for t in inputs]
    BODIES.append(name)
    try:
        outs = fn(inputs)
        written_in = [i for i in frozen if inputs[i]._st.value is not in_vals[i]]
        if written_in:
            raise InputWrittenError(f"xlatorch: {name} writes its input(s) {written_in} in place; run eagerly, that "
                                    f"would change your tensors, which a body traced once cannot: return the new "
                                    f"values instead")  # fmt: skip
        vals = values_of(outs, name, "must return xla tensors; its result")
    finally:
        BODIES.pop()
        written = _undo_outside_writes(first_sid, snapshot)
        _forget(first_sid, name)
    if written:
        shapes = ", ".join(f"{tuple(a[0])} {a[1]}" for a in written)
        raise BodyError(f"xlatorch: {name} wrote tensors made outside it ({shapes}); a body is traced once "
                        f"as a function of its inputs: return the new values instead (e.g. in the carry)")  # fmt: skip
    return in_vals, vals, outs


def depends(vals, sources, nodes: dict | None = None, random: bool = False) -> dict:
    """``{id(node): whether it depends on one of the values in sources}`` for every node that
    ``vals`` are computed from, stopping at the sources; ``nodes`` gets ``{id(node): node}``.
    ``random``: a random op counts as depending on them (in a loop, each iteration draws its
    own numbers: it is not computed once outside the loop)."""
    src = {id(v) for v in sources}
    dep: dict[int, bool] = {}
    for v in vals:
        if type(v) is not Out or id(v) in src:
            continue
        stack = [(v.node, False)]
        while stack:
            n, ready = stack.pop()
            if id(n) in dep:
                continue
            ops = operands(n.args)
            if not ready:
                stack.append((n, True))
                stack.extend(
                    (o.node, False) for o in ops if type(o) is Out and id(o) not in src and id(o.node) not in dep
                )
                continue
            dep[id(n)] = any(id(o) in src or (type(o) is Out and dep[id(o.node)]) for o in ops) or (
                random and GENERATOR in n.spec.kinds
            )
            if nodes is not None:
                nodes[id(n)] = n
    return dep


def body_of(vals, inputs, name: str, constants: bool = False) -> tuple[Body, list]:
    """The body computing ``vals`` from ``inputs`` (values: a trace's placeholders, or values
    computed in it that another body passes on), and the values it captures from outside;
    with ``constants``, the Python numbers it reads are literals of the body, not captured."""
    in_ids = {id(v) for v in inputs}
    inside = depends(vals, inputs, random=True)
    nodes = []
    seen_nodes = set()

    def is_in(o):
        return id(o) in in_ids or (type(o) is Out and inside.get(id(o.node), False))

    for v in vals:  # post-order again, keeping the nodes that depend on the inputs
        if type(v) is not Out or id(v) in in_ids:
            continue
        stack = [(v.node, False)]
        while stack:
            n, ready = stack.pop()
            if id(n) in seen_nodes or not inside[id(n)]:
                continue
            if not ready:
                stack.append((n, True))
                stack.extend((o.node, False) for o in operands(n.args)
                             if type(o) is Out and id(o) not in in_ids and id(o.node) not in seen_nodes)  # fmt: skip
                continue
            seen_nodes.add(id(n))
            nodes.append(n)
    leaves = list(inputs)
    n_inputs = len(leaves)
    seen = set(in_ids)
    captured = []

    consts: set = set()

    def capture(a):
        if id(a) not in seen:
            seen.add(id(a))
            if constants and type(a) is Scalar and not a.tensor:
                consts.add(id(a))
            else:
                captured.append(a)

    for n in nodes:
        for o in operands(n.args):
            if not is_in(o):
                capture(o)
    for v in vals:
        if not is_in(v):
            capture(v)
    leaves += captured
    order = {id(n): k for k, n in enumerate(nodes)}
    lpos = {id(a): i for i, a in enumerate(leaves)}
    seeds = tuple(sorted({lpos[id(a)] for n in nodes for a, k in zip(n.args, n.spec.kinds)
                          if k is GENERATOR and id(a) in lpos}))  # fmt: skip

    def ref(v):
        if id(v) in consts:  # a literal: its value is the key
            return ("const", v.sig, _sig(v.value))
        k = order.get(id(v.node)) if type(v) is Out and id(v) not in in_ids else None
        return k * 4096 + v.idx if k is not None else -1 - lpos[id(v)]

    enc = tuple((n.key, tuple(ref(o) for o in operands(n.args))) for n in nodes)
    root_refs = tuple(ref(v) for v in vals)
    # The roots' references: the arguments of one more row, reading them.
    *rows, last = plan([*nodes, SimpleNamespace(spec=None, args=tuple(vals), info=None)], leaves, None, consts)
    roots = list(last[1])
    key = (enc, root_refs, tuple(a.sig for a in leaves))
    where = [f"{_op_name(n)} at {fmt_src(getattr(n, 'src', None))}" for n in nodes]
    body = Body(rows, roots, tuple(v.aval for v in vals), key, n_inputs, len(leaves), name, where, seeds)
    body.collective = any(n.spec in COLLECTIVES for n in nodes)
    return body, captured


def _op_name(n) -> str:
    name = n.spec.name.removesuffix(".default")
    return name if "::" in name else "aten::" + name


def _undo_outside_writes(first_sid, snapshot) -> list:
    """Give each storage made before the body and written by it its value back; their avals."""
    written = []
    for sid, r in list(PENDING.items()):
        st = r()
        if st is None or sid >= first_sid or st.value is snapshot.get(sid):
            continue
        old = snapshot.get(sid)
        if old is None:  # device data before the body: its first write since the last sync was the body's
            old = st.prev
            st.prev = None
        written.append(st.value.aval)
        st.value = old
        st.gen = next(TICKS)
        if type(old) is Data:
            old.holders += 1
            del PENDING[sid]
    return written


@contextlib.contextmanager
def swapped(tensors, replacements):
    """While tracing a body: ``tensors`` (from outside it) read as ``replacements`` (its inputs),
    so that the body is a function of them; their values are back afterwards."""
    sts = [t._st for t in tensors]
    old = [st.value for st in sts]
    for st, r in zip(sts, replacements):
        st.value = value_of(r)  # not Storage.set: nothing is written, the sync never sees it
        st.gen = next(TICKS)
    try:
        yield
    finally:
        for st, v in zip(sts, old):
            st.value = v
            st.gen = next(TICKS)


def _forget(first_sid, name) -> None:
    """The body's own tensors hold an error: their values exist only inside the loop."""
    made = [st for sid, r in list(PENDING.items()) if sid >= first_sid and (st := r()) is not None]
    if made:
        error = BodyError(f"xlatorch: this tensor was made inside {name}, which is traced once and runs on "
                          f"the device: it has no value outside it (return it instead)")  # fmt: skip
        fail_storages(made, error)


def values_of(tensors, what: str, rule: str = "takes xla tensors; argument") -> list:
    """The values of xla tensors passed to (or returned by) a loop; anything else is an error
    naming ``what`` and the ``rule`` it breaks."""
    out = []
    for i, t in enumerate(tensors):
        if type(t) is not XlaTensor:
            got = f"a tensor on {t.device}" if hasattr(t, "device") else type(t).__name__
            raise BodyError(f"xlatorch: {what} {rule} {i} is {got}")
        out.append(value_of(t))
    return out


def avals_of(tensors) -> list:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def mark_non_differentiable(ctx, outs) -> None:
    """In an ``autograd.Function`` made of bodies or JAX calls: its integer and bool outputs
    have no gradient."""
    for o in outs:
        if not (o.dtype.is_floating_point or o.dtype.is_complex):
            ctx.mark_non_differentiable(o)
