"""Loops that compile once and functions replayed without tracing: IR nodes holding a body.

Each node kind holds one or two ``Body`` (traced once, ``bodies.py``) and lowers them with
``jax.lax``:

- ``scan``: ``jax.lax.scan`` - the body is compiled once, whatever the number of iterations;
  ``while_loop`` (``jax.lax.while_loop``), ``cond`` (``jax.lax.cond``), ``call`` (the body
  once, for a function replayed from its trace).
- On-device checks of a body's ops (an out-of-range index) are rows of the loop's node: the
  first iteration that failed is reported, with the body's op and line.

PyTorch's own higher-order ops (``torch._higher_order_ops.while_loop``, ``torch.cond``) on
xla tensors are lowered here too (``install``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch.utils import _pytree as pytree

from xlatorch.runtime.base import config
from xlatorch.runtime.ir.body import Body, stack_rows
from xlatorch.runtime.ir.ops import STATIC, TENSOR_LIST, TUPLE, Info, OpSpec
from xlatorch.runtime.ir.values import Out
from xlatorch.runtime.trace.bodies import BodyError, avals_of, trace_body, values_of
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES
from xlatorch.runtime.trace.nodes import _node
from xlatorch.runtime.trace.tensor import XlaTensor, wrap

__all__ = ["scan", "while_loop", "cond", "call", "run_while", "run_cond", "install"]


def _make(spec, vals, sig, avals, checked):
    if any(type(v) is Body and v.collective for v in vals):
        spec = _REPLICATED[spec]  # a graph holding it runs as one program over the replicas
    info = spec.cache.get(sig)
    if info is None:
        info = spec.cache[sig] = Info(tuple(avals), None, checked and config.CHECKS)
    return list(_node(spec, vals, sig).outs)


def _spec(name, run, static):
    """A node kind holding bodies: ``run(operands, *static, found)`` gives its outputs and, when
    ``found`` is a list, appends its check rows; the check runs it once and the lowering reuses that."""
    done: dict = {}

    def check(out, ops, *args):
        found: list = []
        done[id(out)] = run(ops, *args, found)
        return found

    def emit(out, ops, *args):
        res = done.pop(id(out), None)
        return run(ops, *args, None) if res is None else res

    def make():
        spec = OpSpec(name, None, emit, ("operands", *static), (TENSOR_LIST,) + (STATIC,) * len(static),
                      (False,) * (1 + len(static)), TUPLE)  # fmt: skip
        spec.check = check
        return spec

    spec = make()
    # Its twin for bodies holding collectives (xm.all_reduce in a loop): a collective's spec,
    # so that the sync compiles the graph as one program over the replicas (multi/replication.py).
    _REPLICATED[spec] = twin = make()
    COLLECTIVES.add(twin)
    return spec


_REPLICATED: dict = {}


def _strong(x):
    """``x`` without JAX's weak type: a loop's carry keeps one type across iterations."""
    x = jnp.asarray(x)
    return lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x


def _first_bad(stacked, reverse):
    """Per check, the row of the first iteration that failed (``stacked``: iterations x rows x 3)."""
    bad = stacked[:, :, 0] != 0
    order = bad[::-1] if reverse else bad
    i = jnp.argmax(order, axis=0)
    if reverse:
        i = stacked.shape[0] - 1 - i
    rows = jnp.take_along_axis(stacked, i[None, :, None], axis=0)[0]
    return rows.at[:, 0].set(jnp.any(bad, axis=0).astype(rows.dtype))


def _run_scan(ops, body, n_carry, n_xs, length, reverse, found):
    carry = tuple(_strong(v) for v in ops[:n_carry])
    xs = tuple(ops[n_carry : n_carry + n_xs])
    cap = list(ops[n_carry + n_xs :])
    if body.seeds:  # the iteration number moves the random ops' seeds
        xs += (jnp.arange(length, dtype=jnp.int64),)
    meta: list = []

    def step(c, x):
        rows = [] if found is not None else None
        res = body.run([*c, *x[:n_xs], *cap], rows, x[n_xs] if body.seeds else None)
        ys = tuple(res[n_carry:])
        if rows:
            meta[:] = [c[3:] for c in rows]
            ys += (stack_rows(rows),)
        return tuple(_strong(r) for r in res[:n_carry]), ys

    c, ys = lax.scan(step, carry, xs, length=length, reverse=reverse)
    if meta:
        first = _first_bad(ys[-1], reverse)
        found.extend((first[k, 0], first[k, 1], first[k, 2], *m) for k, m in enumerate(meta))
        ys = ys[:-1]
    return [*c, *ys]


_SCAN = _spec("xlatorch::scan", _run_scan, ("body", "n_carry", "n_xs", "length", "reverse"))


def scan(body: Body, captured, init, xs, length: int, reverse: bool = False, invariant=()) -> list[Out]:
    """The node scanning ``body`` (inputs: the carry, one slice of each of ``xs``, then the
    ``invariant`` values; results: the new carry, then one slice of each output) over
    ``length`` iterations (last to first with ``reverse``): the final carry, then the stacked
    outputs."""
    n_carry = len(init)
    avals = [v.aval for v in init] + [((length, *a[0]), a[1]) for a in body.avals[n_carry:]]
    ops = (*init, *xs, *invariant, *captured)
    sig = (tuple(v.sig for v in ops), body, n_carry, len(xs), length, reverse)
    return _make(_SCAN, (ops, body, n_carry, len(xs), length, reverse), sig, avals, body.checked)


def _run_while(ops, cond_body, body, n_carry, found):
    n_cond = cond_body.n_leaves - n_carry
    carry = tuple(_strong(v) for v in ops[:n_carry])
    ccap = list(ops[n_carry : n_carry + n_cond])
    bcap = list(ops[n_carry + n_cond :])
    seeded = bool(body.seeds or cond_body.seeds)  # then the iteration number moves the seeds
    it0 = jnp.zeros((), jnp.int64)
    meta: list = []
    if found is not None:  # the rows are carried: their number first (a trace, no compile)
        jax.eval_shape(lambda *c: _rows_of(cond_body, body, c, ccap, bcap, meta, it0), *carry)

    def test(state):
        return _pred(cond_body, state[0], ccap, None, state[1] if seeded else None)

    def step(state):
        c, it, acc = state
        rows: list | None = [] if meta else None
        new = _step(body, c, bcap, rows, it if seeded else None)
        if meta:  # the first failure of each check is kept
            _pred(cond_body, new, ccap, rows, it + 1 if seeded else None)
            acc = jnp.where(acc[:, :1] != 0, acc, stack_rows(rows))
        return new, it + 1, acc

    acc0 = jnp.zeros((0, 3), jnp.int64)
    if meta:
        first: list = []
        _pred(cond_body, carry, ccap, first, it0 if seeded else None)  # the condition's checks, before iterating
        acc0 = stack_rows([(0, 0, 0)] * (len(meta) - len(first)) + first)
    res, _, acc = lax.while_loop(test, step, (carry, it0, acc0))
    if meta:
        found.extend((acc[k, 0], acc[k, 1], acc[k, 2], *m) for k, m in enumerate(meta))
    return list(res)


def _rows_of(cond_body, body, c, ccap, bcap, meta, it):
    rows: list = []
    new = _step(body, c, bcap, rows, it)
    _pred(cond_body, new, ccap, rows, it)
    meta[:] = [r[3:] for r in rows]
    return new


def _pred(cond_body, c, cap, found=None, it=None):
    return jnp.asarray(cond_body.run([*c, *cap], found, it)[0]).reshape(()).astype(bool)


def _step(body, c, cap, found, it=None):
    return tuple(_strong(r) for r in body.run([*c, *cap], found, it))


_WHILE = _spec("xlatorch::while_loop", _run_while, ("cond", "body", "n_carry"))


def while_loop(cond_body: Body, cond_captured, body: Body, body_captured, init) -> list[Out]:
    """The node running ``body`` (the carry -> the new carry) while ``cond_body`` (the carry ->
    a one-element bool) holds: the final carry."""
    n_carry = len(init)
    ops = (*init, *cond_captured, *body_captured)
    sig = (tuple(v.sig for v in ops), cond_body, body, n_carry)
    checked = cond_body.checked or body.checked
    return _make(_WHILE, (ops, cond_body, body, n_carry), sig, [v.aval for v in init], checked)


def _run_cond(ops, true_body, false_body, found):
    pred = jnp.asarray(ops[0]).reshape(()).astype(bool)
    n_t = true_body.n_leaves - true_body.n_inputs
    n_in = true_body.n_inputs
    args = list(ops[1 : 1 + n_in])
    tcap = list(ops[1 + n_in : 1 + n_in + n_t])
    fcap = list(ops[1 + n_in + n_t :])
    if found is None or not (true_body.checked or false_body.checked):
        return list(lax.cond(pred, lambda: tuple(true_body.run([*args, *tcap])),
                             lambda: tuple(false_body.run([*args, *fcap]))))  # fmt: skip
    metas: list = [[], []]

    def branch(b, cap, mine):
        def f():
            rows: list = []
            res = b.run([*args, *cap], rows)
            metas[mine][:] = [r[3:] for r in rows]
            own = stack_rows(rows) if rows else jnp.zeros((0, 3), jnp.int64)
            return tuple(res), own

        return f

    tshape = jax.eval_shape(branch(true_body, tcap, 0))[1].shape[0]
    fshape = jax.eval_shape(branch(false_body, fcap, 1))[1].shape[0]

    def padded(f, mine):
        def g():
            res, own = f()
            z = [jnp.zeros((tshape, 3), jnp.int64), jnp.zeros((fshape, 3), jnp.int64)]
            z[mine] = own
            return res, jnp.concatenate(z)

        return g

    res, rows = lax.cond(pred, padded(branch(true_body, tcap, 0), 0), padded(branch(false_body, fcap, 1), 1))
    found.extend((rows[k, 0], rows[k, 1], rows[k, 2], *m) for k, m in enumerate(metas[0] + metas[1]))
    return list(res)


_COND = _spec("xlatorch::cond", _run_cond, ("true_fn", "false_fn"))


def cond(pred, true_body: Body, true_captured, false_body: Body, false_captured, args) -> list[Out]:
    """The node computing ``true_body(args)`` where the one-element ``pred`` holds, else
    ``false_body(args)`` (both give the same avals)."""
    ops = (pred, *args, *true_captured, *false_captured)
    sig = (tuple(v.sig for v in ops), true_body, false_body)
    checked = true_body.checked or false_body.checked
    return _make(_COND, (ops, true_body, false_body), sig, true_body.avals, checked)


def _run_call(ops, body, found):
    return body.run(list(ops), found)


_CALL = _spec("xlatorch::call", _run_call, ("body",))


def call(body: Body, args, captured) -> list[Out]:
    """The node computing ``body`` once on ``args`` (a function replayed from its trace)."""
    ops = (*args, *captured)
    sig = (tuple(v.sig for v in ops), body)
    return _make(_CALL, (ops, body), sig, body.avals, body.checked)


# --- on tensors: PyTorch's higher-order ops --------------------------------------------------


def run_while(cond_fn, body_fn, carried, additional=(), name="while_loop") -> tuple:
    """``body_fn(*carry, *additional)`` while ``cond_fn(*carry, *additional)`` holds, as one XLA
    loop: the final carry (tensors). Non-tensor ``additional`` inputs are constants of the loop."""
    carried = list(carried)
    consts = {i: a for i, a in enumerate(additional) if not isinstance(a, torch.Tensor)}
    extra = [a for a in additional if isinstance(a, torch.Tensor)]
    init = values_of(carried + extra, name)
    n = len(carried)
    avals = avals_of(carried + extra)

    def args(ts):
        it = iter(ts[n:])
        return [*ts[:n], *(consts[i] if i in consts else next(it) for i in range(len(additional)))]

    def on_cond(ts):
        p = cond_fn(*args(ts))
        if type(p) is not XlaTensor or p.numel() != 1:
            raise BodyError(f"xlatorch: the condition of {name} must return a one-element xla tensor, got {p!r}")
        return [p]

    def on_body(ts):
        res = body_fn(*args(ts))
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        if len(res) != n:
            raise BodyError(f"xlatorch: the body of {name} returned {len(res)} values for a carry of {n}")
        for i, (r, a) in enumerate(zip(res, avals)):
            if type(r) is XlaTensor and (tuple(r.shape), r.dtype) != a:
                raise BodyError(f"xlatorch: the body of {name} changed carry {i} from {a[0]} {a[1]} to "
                                f"{tuple(r.shape)} {r.dtype}; a carry keeps its shape and dtype")  # fmt: skip
        return res + ts[n:]

    cb, ccap, _ = trace_body(on_cond, avals, f"the condition of {name}")
    bb, bcap, _ = trace_body(on_body, avals, f"the body of {name}")
    outs = while_loop(cb, ccap, bb, bcap, init)
    return tuple(wrap(o) for o in outs[:n])


def run_cond(pred, true_fn, false_fn, operands, name="cond"):
    """``true_fn(*operands)`` where the one-element ``pred`` holds, else ``false_fn(*operands)``,
    both traced and lowered to one ``jax.lax.cond``."""
    operands = list(operands)
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        raise NotImplementedError(f"xlatorch: {name} on xla tensors that require grad is not differentiable yet; "
                                  f"compute both branches and select with torch.where instead")  # fmt: skip
    args = values_of(operands, name)
    avals = avals_of(operands)
    spec_box: list = []

    def branch(fn):
        def f(ts):
            leaves, spec = pytree.tree_flatten(fn(*ts))
            spec_box.append(spec)
            return leaves

        return f

    tb, tcap, touts = trace_body(branch(true_fn), avals, f"the true branch of {name}")
    fb, fcap, fouts = trace_body(branch(false_fn), avals, f"the false branch of {name}")
    if tb.avals != fb.avals or spec_box[0] != spec_box[1]:
        raise BodyError(f"xlatorch: the branches of {name} return different shapes or dtypes: "
                        f"{list(tb.avals)} and {list(fb.avals)}")  # fmt: skip
    if not isinstance(pred, torch.Tensor):
        return true_fn(*operands) if pred else false_fn(*operands)
    (p,) = values_of([pred], name)
    outs = cond(p, tb, tcap, fb, fcap, args)
    return pytree.tree_unflatten([wrap(o) for o in outs], spec_box[0])


def install() -> None:
    """PyTorch's ``while_loop`` and ``cond`` on xla tensors: one XLA loop / conditional."""
    import sys

    from torch._higher_order_ops.cond import cond_op
    from torch._higher_order_ops.while_loop import while_loop_op

    # torch.cond outside torch.compile compiles itself with Dynamo, which rejects an xla
    # tensor as its predicate: on xla tensors it is lowered here directly.
    module = sys.modules["torch._higher_order_ops.cond"]
    torch_cond = module.cond

    def cond_on_xla(pred, true_fn, false_fn, operands=()):
        if not torch.compiler.is_dynamo_compiling() and (
            type(pred) is XlaTensor or any(type(t) is XlaTensor for t in pytree.tree_leaves(operands))
        ):
            return run_cond(pred, true_fn, false_fn, pytree.tree_leaves(operands))
        return torch_cond(pred, true_fn, false_fn, operands)

    cond_on_xla.__doc__ = torch_cond.__doc__
    module.cond = torch.cond = cond_on_xla

    @while_loop_op.py_impl(XlaTensor)
    def _while(cond_fn, body_fn, carried_inputs, additional_inputs=()):
        return run_while(cond_fn, body_fn, carried_inputs, additional_inputs)

    @cond_op.py_impl(XlaTensor)
    def _cond(pred, true_fn, false_fn, operands):
        return run_cond(pred, true_fn, false_fn, operands)
