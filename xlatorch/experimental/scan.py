"""``scan``: a loop over the leading dimension of tensors, lowered to one XLA loop.

``scan(fn, init, xs)`` traces ``fn`` once on placeholder tensors (one carry, one slice of each
of ``xs``) and records one node whose lowering is ``jax.lax.scan`` over that body
(``runtime/trace/loops.py``): the program holds the body once, whatever the number of
iterations, and compiles in the time of one.

Autograd: the backward is a loop too (a reverse scan). Each of its iterations differentiates
the body with PyTorch's autograd on the device (traced once, like the forward) from what the
forward kept: with ``partition_fn=min_cut_rematerialization_partition`` the carry at each
iteration only, the body's forward being recomputed in the backward (the memory of a carry
per iteration); with the default, the same, as xlatorch does not yet keep the body's
activations (see the issue notes). Tensors the body reads from outside and that require
grad (a module's parameters) get their gradients, summed over iterations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from xlatorch.runtime.trace import loops
from xlatorch.runtime.trace.loops import BodyError
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, wrap

__all__ = ["scan"]


def _differentiable(t) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def scan(
    fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = False,
) -> tuple[Any, Any]:
    """Apply ``fn`` over the leading dimension of ``xs`` while carrying state, as one XLA loop.

    Equal to::

        carry, ys = init, []
        for i in range(len(xs)):
            carry, y = fn(carry, xs[i])
            ys.append(y)
        return carry, torch.stack(ys)

    with pytrees of tensors for the carry, ``xs`` and the outputs (each output leaf stacked).

    Args:
      fn: ``(carry, x) -> (new carry, y)``, made of device ops; traced once (it may not read
        values on the host or write tensors made outside it; the carry keeps its shapes and
        dtypes).
      init: the first carry (a pytree of xla tensors).
      xs: a pytree of xla tensors with the same leading dimension.
      partition_fn: torch_xla's choice of what the backward recomputes (accepted; see the
        module's docstring).
      is_fn_pure: accepted for torch_xla's signature; the body is traced at every call.

    Returns:
      ``(carry, ys)``: the last carry and the stacked outputs.
    """
    del partition_fn, is_fn_pure
    init_flat, carry_spec = pytree.tree_flatten(init)
    xs_flat, x_spec = pytree.tree_flatten(xs)
    loops.values_of(init_flat + xs_flat, "scan")
    if not xs_flat:
        raise ValueError("xlatorch: scan needs at least one tensor in xs to scan over")
    length = xs_flat[0].shape[0] if xs_flat[0].dim() else None
    for t in xs_flat:
        if t.dim() == 0 or t.shape[0] != length:
            shapes = [tuple(t.shape) for t in xs_flat]
            raise ValueError(f"xlatorch: scan's xs must share their leading dimension; got shapes {shapes}")
    if length == 0:
        raise ValueError("xlatorch: scan over a leading dimension of size 0")
    loop = _Loop(fn, init_flat, carry_spec, xs_flat, x_spec, length)
    loop.inputs_require_grad = any(t.requires_grad for t in init_flat + xs_flat)
    loop.trace_forward(grad=torch.is_grad_enabled())
    if not loop.grad:
        outs = loop.run_forward(init_flat, xs_flat, keep_history=False)
    else:
        outs = _Scan.apply(loop, *init_flat, *xs_flat, *loop.params)
    n = len(init_flat)
    carry = pytree.tree_unflatten(list(outs[:n]), carry_spec)
    ys = iter(outs[n:])
    return carry, pytree.tree_unflatten([None if none else next(ys) for none in loop.y_none], loop.y_spec)


class _Loop:
    """One call of ``scan``: the user's function over flat lists, its forward body, the
    tensors from outside it that require grad (``params``)."""

    def __init__(self, fn, init_flat, carry_spec, xs_flat, x_spec, length):
        self.fn, self.carry_spec, self.x_spec, self.length = fn, carry_spec, x_spec, length
        self.carry_avals = loops.avals_of(init_flat)
        self.x_avals = [(tuple(t.shape[1:]), t.dtype) for t in xs_flat]
        self.y_spec = None
        self.params: list = []

    def flat_fn(self, carry_flat, x_flat) -> list:
        """``fn`` on flat lists: the new carry's leaves, then the outputs' leaves."""
        carry = pytree.tree_unflatten(list(carry_flat), self.carry_spec)
        x = pytree.tree_unflatten(list(x_flat), self.x_spec)
        res = self.fn(carry, x)
        if not isinstance(res, tuple) or len(res) != 2:
            raise BodyError("xlatorch: scan's fn must return a pair (new carry, y)")
        new, new_spec = pytree.tree_flatten(res[0])
        ys, y_spec = pytree.tree_flatten(res[1])
        self.y_none = [y is None for y in ys]  # None outputs stay None (as torch_xla's scan keeps them)
        ys = [y for y in ys if y is not None]
        if new_spec != self.carry_spec:
            raise BodyError(f"xlatorch: scan's fn returned a carry of structure {new_spec}, not {self.carry_spec}")
        for i, (t, a) in enumerate(zip(new, self.carry_avals)):
            if type(t) is XlaTensor and (tuple(t.shape), t.dtype) != a:
                raise BodyError(f"xlatorch: scan's fn changed carry leaf {i} from {a[0]} {a[1]} to "
                                f"{tuple(t.shape)} {t.dtype}; a carry keeps its shape and dtype")  # fmt: skip
        self.y_spec = y_spec
        return new + ys

    def trace_forward(self, grad: bool) -> None:
        """The forward body (carry, x -> new carry, y); with ``grad`` (grad mode on), the
        tensors from outside that it differentiates through (``params``) and, when the loop
        is differentiated (``self.grad``), also the carry each iteration started from."""
        nc = len(self.carry_avals)
        start = _sequence_nr()

        def body(ts):
            with torch.enable_grad() if grad else torch.no_grad():
                outs = self.flat_fn(ts[:nc], ts[nc:])
            if grad:
                self.params = _outside_params(outs, start)
            self.grad = grad and (self.inputs_require_grad or bool(self.params))
            self.n_out = len(outs)
            return outs + ts[:nc] if self.grad else outs

        self.body, self.captured, _ = loops.trace_body(body, self.carry_avals + self.x_avals, "scan")

    def run_forward(self, init_flat, xs_flat, keep_history: bool) -> list:
        """The loop's results: the last carry, the stacked outputs (and with ``keep_history``,
        the stacked carry each iteration started from)."""
        outs = loops.scan(self.body, self.captured, [value_of(t) for t in init_flat],
                          [value_of(t) for t in xs_flat], self.length)  # fmt: skip
        res = [wrap(o) for o in outs]
        return res if keep_history else res[: self.n_out]


def _sequence_nr() -> int:
    """The autograd sequence number the next op of this thread's graph gets."""
    return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


def _outside_params(outs, start) -> list:
    """The leaf tensors requiring grad that ``outs`` were computed from through ops recorded
    after ``start`` (the body); a non-leaf tensor from before the body is an error."""
    found: dict = {}
    seen = set()
    stack = [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        g = stack.pop()
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        if type(g).__name__ == "AccumulateGrad":
            found[id(g.variable)] = g.variable
            continue
        if g._sequence_nr() < start:
            raise BodyError("xlatorch: scan's fn reads a tensor computed outside it that requires grad; pass it "
                            "in through init or xs (its gradient is then returned), or detach it")  # fmt: skip
        stack.extend(f for f, _ in g.next_functions)
    for p in found.values():
        if type(p) is not XlaTensor:
            raise BodyError(f"xlatorch: scan's fn reads a tensor on {p.device} that requires grad; move it to xla")
    return list(found.values())


class _Scan(torch.autograd.Function):
    """The loop with its backward: a reverse scan differentiating the body, iteration by
    iteration, from the carry each iteration started from."""

    @staticmethod
    def forward(ctx, loop, *flat):
        nc, nx = len(loop.carry_avals), len(loop.x_avals)
        init, xs, params = flat[:nc], flat[nc : nc + nx], flat[nc + nx :]
        res = loop.run_forward(init, xs, keep_history=True)
        ctx.loop = loop
        # What the backward reads, as the values they have now (an in-place update of a
        # parameter before backward must not change the gradient).
        ctx.kept = (res[loop.n_out :], [wrap(value_of(t)) for t in xs], [wrap(value_of(p)) for p in params])
        ctx.diff = [_differentiable(t) and t.requires_grad for t in flat]
        outs = res[: loop.n_out]
        for o in outs:
            if not _differentiable(o):
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        loop = ctx.loop
        history, xs, params = ctx.kept
        del ctx.kept
        nc, nx, npar = len(loop.carry_avals), len(loop.x_avals), len(params)
        dc = [i for i, a in enumerate(loop.carry_avals) if a[1].is_floating_point or a[1].is_complex]
        dx = [i for i, a in enumerate(loop.x_avals) if a[1].is_floating_point or a[1].is_complex]
        gouts = [g if g is not None else torch.zeros(_out_shape(loop, i), dtype=_out_dtype(loop, i), device="xla")
                 for i, g in enumerate(grads)]  # fmt: skip
        g_last = [gouts[i] for i in dc]
        g_ys = gouts[nc:]
        y_avals = [(tuple(g.shape[1:]), g.dtype) for g in g_ys]
        acc0 = [torch.zeros_like(p) for p in params]
        # Body inputs: carried (carry grads, parameter grads so far), sliced (the carry the
        # iteration started from, its x, its outputs' grads), invariant (the parameters).
        avals = (
            [loop.carry_avals[i] for i in dc]
            + loops.avals_of(acc0)
            + loop.carry_avals
            + loop.x_avals
            + y_avals
            + loops.avals_of(params)
        )
        n_gc = len(dc)

        def body(ts):
            gc, acc = ts[:n_gc], ts[n_gc : n_gc + npar]
            k = n_gc + npar
            c, x, gy = ts[k : k + nc], ts[k + nc : k + nc + nx], ts[k + nc + nx : len(ts) - npar]
            ps = ts[len(ts) - npar :]
            with loops.swapped(loop.params, ps), torch.enable_grad():
                c = [t.detach().requires_grad_(i in dc) for i, t in enumerate(c)]
                x = [t.detach().requires_grad_(i in dx) for i, t in enumerate(x)]
                outs = loop.flat_fn(c, x)
                gout = [(gc[dc.index(i)] if i in dc else None) if i < nc else gy[i - nc] for i in range(len(outs))]
                pairs = [(o, g) for o, g in zip(outs, gout) if o.requires_grad and g is not None]
                wrt = [c[i] for i in dc] + [x[i] for i in dx] + list(loop.params)
                got = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                       if pairs else [None] * len(wrt))  # fmt: skip
            got = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]
            new_gc = got[:n_gc]
            g_x = got[n_gc : n_gc + len(dx)]
            new_acc = [a + g for a, g in zip(acc, got[n_gc + len(dx) :])]
            return [t.detach() for t in new_gc + new_acc + g_x]

        bbody, bcap, _ = loops.trace_body(body, avals, "scan's backward")
        outs = loops.scan(bbody, bcap, [value_of(t) for t in g_last + acc0], [value_of(t) for t in history + xs + g_ys],
                          loop.length, reverse=True, invariant=[value_of(p) for p in params])  # fmt: skip
        outs = [wrap(o) for o in outs]
        g_init = [None] * nc
        for j, i in enumerate(dc):
            g_init[i] = outs[j]
        g_par = outs[n_gc : n_gc + npar]
        g_xs = [None] * nx
        for j, i in enumerate(dx):
            g_xs[i] = outs[n_gc + npar + j]
        res = g_init + g_xs + list(g_par)
        return (None, *[g if d else None for g, d in zip(res, ctx.diff)])


def _out_shape(loop, i):
    nc = len(loop.carry_avals)
    return loop.carry_avals[i][0] if i < nc else (loop.length, *loop.body.avals[i][0])


def _out_dtype(loop, i):
    return loop.body.avals[i][1]
