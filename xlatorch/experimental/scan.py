"""``scan``: a loop over the leading dimension of tensors, lowered to one XLA loop.

``scan(fn, init, xs)`` traces ``fn`` once on placeholder tensors (one carry, one slice of each
of ``xs``) and records one node whose lowering is ``jax.lax.scan`` over that body
(``runtime/trace/loops.py``): the program holds the body once, whatever the number of
iterations, and compiles in the time of one.

Autograd: the backward is a loop too (a reverse scan). Its body is the iteration
differentiated by PyTorch's autograd on the device, traced once like the forward. With the
default ``partition_fn`` (functorch's ``default_partition``), one trace of an iteration's
forward and backward is split where the backward reads the forward: the forward loop stacks
those activations, the backward loop reads them. With ``min_cut_rematerialization_partition``
the forward keeps only the carry each iteration started from, and the backward recomputes
the iteration's forward from it (the memory of one carry per iteration). Tensors the body
reads from outside and that require grad (a module's parameters) get their gradients,
summed over iterations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch.utils import _pytree as pytree

from xlatorch.runtime.ir import rng
from xlatorch.runtime.ir.values import Out, operands
from xlatorch.runtime.trace import bodies, loops
from xlatorch.runtime.trace.bodies import BodyError
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, wrap

__all__ = ["scan", "value_and_grad_partitioned", "tree_flatten_none"]


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
      partition_fn: what the backward recomputes: functorch's ``default_partition`` (None:
        keep the activations) or ``min_cut_rematerialization_partition`` (keep the carries,
        recompute the rest); see the module's docstring.
      is_fn_pure: accepted for torch_xla's signature; the body is traced at every call.

    Returns:
      ``(carry, ys)``: the last carry and the stacked outputs.
    """
    del is_fn_pure
    if not callable(fn):
        raise ValueError(f"xlatorch: scan's fn must be callable, got {type(fn).__name__}")
    init_flat, carry_spec = pytree.tree_flatten(init)
    xs_flat, x_spec = pytree.tree_flatten(xs)
    bodies.values_of(init_flat + xs_flat, "scan")
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
    loop.save = not _recomputes(partition_fn)
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
        self.carry_avals = bodies.avals_of(init_flat)
        self.x_avals = [(tuple(t.shape[1:]), t.dtype) for t in xs_flat]
        self.x_requires = [t.requires_grad for t in xs_flat]
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
        self.rng_start = rng.get_seed()  # a backward that recomputes the body draws the same numbers

        def body(ts):
            with torch.enable_grad() if grad else torch.no_grad():
                outs = self.flat_fn(ts[:nc], ts[nc:])
            if grad:
                self.params = _outside_params(outs, start)
            self.grad = grad and (self.inputs_require_grad or bool(self.params))
            self.n_out = len(outs)
            return outs + ts[:nc] if self.grad else outs

        # An x is a slice of the user's xs: writing it in place would change xs in a Python loop.
        xs = range(nc, nc + len(self.x_avals))
        self.body, self.captured, _ = bodies.trace_body(body, self.carry_avals + self.x_avals, "the body of scan",
                                                        frozen=xs)  # fmt: skip

    # --- what the backward needs -----------------------------------------------------------

    @property
    def dc(self) -> list:
        """The positions of the carry's differentiable leaves (a float carry's gradient flows
        through the loop even when the first carry does not require grad)."""
        return [i for i, a in enumerate(self.carry_avals) if a[1].is_floating_point or a[1].is_complex]

    @property
    def dx(self) -> list:
        """The positions of the xs that are differentiated: floats that require grad (not a
        layer's buffers, say)."""
        return [i for i, a in enumerate(self.x_avals) if (a[1].is_floating_point or a[1].is_complex)
                and self.x_requires[i]]  # fmt: skip

    def y_avals(self) -> list:
        return list(self.body.avals[len(self.carry_avals) : self.n_out])

    def param_avals(self) -> list:
        return bodies.avals_of(self.params)

    def grad_avals(self) -> list:
        """The backward loop's carry: the carry's grads, the parameters' grads so far."""
        return [self.carry_avals[i] for i in self.dc] + self.param_avals()

    def vjp_step(self, gc, acc, c, x, gy, ps) -> list:
        """One iteration of the backward, traced: the grads of the carry it started from, the
        parameters' grads so far plus this iteration's, the grads of its x (differentiable
        leaves only), from the grads of its new carry (``gc``) and outputs (``gy``)."""
        dc, dx, nc = self.dc, self.dx, len(self.carry_avals)
        with bodies.swapped(self.params, ps), torch.enable_grad():
            c = [t.detach().requires_grad_(i in dc) for i, t in enumerate(c)]
            x = [t.detach().requires_grad_(i in dx) for i, t in enumerate(x)]
            outs = self.flat_fn(c, x)
            gout = [(gc[dc.index(i)] if i in dc else None) if i < nc else gy[i - nc] for i in range(len(outs))]
            pairs = [(o, g) for o, g in zip(outs, gout) if o.requires_grad and g is not None]
            wrt = [c[i] for i in dc] + [x[i] for i in dx] + list(self.params)
            got = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs else [None] * len(wrt))  # fmt: skip
        got = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]
        n_gc = len(dc)
        new_acc = [a + g for a, g in zip(acc, got[n_gc + len(dx) :])]
        self.last_outs = outs
        return [t.detach() for t in got[:n_gc] + new_acc + got[n_gc : n_gc + len(dx)]]

    def run_saving(self, init_flat, xs_flat, params) -> tuple[list, tuple]:
        """The forward loop keeping what the backward reads of each iteration, and the
        backward's body reading it: one trace of an iteration's forward and backward, split
        where the backward reads the forward (the activations, stacked by the loop)."""
        nc, nx, npar, n_g = len(self.carry_avals), len(self.x_avals), len(self.params), len(self.dc)
        avals = self.carry_avals + self.x_avals + self.param_avals() + self.grad_avals() + self.y_avals()
        k = nc + nx + npar

        def joint(ts):
            grads = self.vjp_step(ts[k : k + n_g], ts[k + n_g : k + n_g + npar], ts[:nc], ts[nc : nc + nx],
                                  ts[k + n_g + npar :], ts[nc + nx : k])  # fmt: skip
            return [o.detach() for o in self.last_outs] + grads

        inputs, vals, _ = bodies.trace_values(joint, avals, "the body of scan", frozen=range(nc, nc + nx))
        fwd_in, g_in = inputs[:k], inputs[k:]
        outs, grads = vals[: self.n_out], vals[self.n_out :]
        acts = _activations(grads, inputs[: nc + nx], g_in)
        fbody, fcap = bodies.body_of(outs + acts, fwd_in, "the body of scan")
        bbody, bcap = bodies.body_of(grads, g_in[: n_g + npar] + acts + g_in[n_g + npar :] + inputs[nc + nx : k],
                                    "the backward of scan's body")  # fmt: skip
        res = loops.scan(fbody, fcap, [value_of(t) for t in init_flat], [value_of(t) for t in xs_flat], self.length,
                         invariant=[value_of(p) for p in params])  # fmt: skip
        return [wrap(o) for o in res], (bbody, bcap)

    def run_forward(self, init_flat, xs_flat, keep_history: bool) -> list:
        """The loop's results: the last carry, the stacked outputs (and with ``keep_history``,
        the stacked carry each iteration started from)."""
        outs = loops.scan(self.body, self.captured, [value_of(t) for t in init_flat],
                          [value_of(t) for t in xs_flat], self.length)  # fmt: skip
        res = [wrap(o) for o in outs]
        return res if keep_history else res[: self.n_out]


def _recomputes(partition_fn) -> bool:
    """Whether torch_xla's ``partition_fn`` asks the backward to recompute the forward
    (functorch's ``min_cut_rematerialization_partition``) rather than keep its activations
    (``default_partition``, the default)."""
    name = getattr(partition_fn, "__name__", "") or ""
    return "remat" in name or "min_cut" in name


def _activations(grads, sliced, g_in) -> list:
    """The values of an iteration's forward that its backward reads: computed from the
    iteration's carry or x (``sliced``), not from the grads flowing back (``g_in``)."""
    nodes: dict = {}
    from_g = bodies.depends(grads, g_in, nodes)
    from_x = bodies.depends(grads, sliced, random=True)  # a dropout mask is kept, not drawn again
    sliced_ids = {id(v) for v in sliced}
    g_ids = {id(v) for v in g_in}
    found: dict = {}

    def forward_value(o):
        if id(o) in g_ids:
            return False
        if id(o) in sliced_ids:
            return True
        return type(o) is Out and not from_g.get(id(o.node), False) and from_x.get(id(o.node), False)

    for nid, n in nodes.items():
        if from_g[nid]:
            for o in operands(n.args):
                if forward_value(o):
                    found[id(o)] = o
    for v in grads:
        if forward_value(v):
            found[id(v)] = v
    return list(found.values())


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
    """The loop with its backward: a reverse scan differentiating the body iteration by
    iteration, from the activations the forward kept (``loop.save``) or from the carry each
    iteration started from, recomputing the rest."""

    @staticmethod
    def forward(ctx, loop, *flat):
        nc, nx = len(loop.carry_avals), len(loop.x_avals)
        init, xs, params = flat[:nc], flat[nc : nc + nx], flat[nc + nx :]
        ctx.loop = loop
        ctx.diff = [_differentiable(t) and t.requires_grad for t in flat]
        # What the backward reads, as the values they have now (an in-place update of a
        # parameter before backward must not change the gradient).
        kept_params = [wrap(value_of(p)) for p in params]
        if loop.save:
            res, ctx.backward_body = loop.run_saving(init, xs, params)
            ctx.kept = (res[loop.n_out :], kept_params)
        else:
            res = loop.run_forward(init, xs, keep_history=True)
            ctx.kept = (res[loop.n_out :] + [wrap(value_of(t)) for t in xs], kept_params)
        outs = res[: loop.n_out]
        bodies.mark_non_differentiable(ctx, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        loop = ctx.loop
        sliced, params = ctx.kept
        del ctx.kept
        nc, nx, npar = len(loop.carry_avals), len(loop.x_avals), len(params)
        gouts = [g if g is not None else torch.zeros(_out_shape(loop, i), dtype=_out_dtype(loop, i), device="xla")
                 for i, g in enumerate(grads)]  # fmt: skip
        g_last = [gouts[i] for i in loop.dc]
        g_ys = gouts[nc:]
        acc0 = [torch.zeros_like(p) for p in params]
        if loop.save:
            bbody, bcap = ctx.backward_body
            del ctx.backward_body
        else:
            # Inputs: carried (carry grads, parameter grads so far), sliced (the carry the
            # iteration started from, its x, its outputs' grads), invariant (the parameters).
            avals = loop.grad_avals() + loop.carry_avals + loop.x_avals + loop.y_avals() + loop.param_avals()
            n_acc = len(loop.dc) + npar

            def body(ts):
                k = n_acc
                c, x, gy = ts[k : k + nc], ts[k + nc : k + nc + nx], ts[k + nc + nx : len(ts) - npar]
                return loop.vjp_step(ts[: len(loop.dc)], ts[len(loop.dc) : n_acc], c, x, gy, ts[len(ts) - npar :])

            now = rng.get_seed()
            rng.set_seed(loop.rng_start)  # the recomputed forward's random ops get the forward's seeds
            try:
                bbody, bcap, _ = bodies.trace_body(body, avals, "the backward of scan's body")
            finally:
                rng.set_seed(now)
        outs = loops.scan(bbody, bcap, [value_of(t) for t in g_last + acc0], [value_of(t) for t in sliced + g_ys],
                          loop.length, reverse=True, invariant=[value_of(p) for p in params])  # fmt: skip
        outs = [wrap(o) for o in outs]
        n_gc = len(loop.dc)
        g_init = [None] * nc
        for j, i in enumerate(loop.dc):
            g_init[i] = outs[j]
        g_par = outs[n_gc : n_gc + npar]
        g_xs = [None] * nx
        for j, i in enumerate(loop.dx):
            g_xs[i] = outs[n_gc + npar + j]
        res = g_init + g_xs + list(g_par)
        return (None, *[g if d else None for g, d in zip(res, ctx.diff)])


def _out_shape(loop, i):
    nc = len(loop.carry_avals)
    return loop.carry_avals[i][0] if i < nc else (loop.length, *loop.body.avals[i][0])


def _out_dtype(loop, i):
    return loop.body.avals[i][1]


def value_and_grad_partitioned(
    fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = True,
) -> tuple[Callable, Callable, Callable]:
    """One iteration of ``scan(fn, init, xs)`` as three functions, torch_xla's building blocks of
    a differentiated scan (``scan`` itself does not use them here):

    - ``forward(carry, x) -> (new_carry, (y, partial_activations))``;
    - ``alias_input(partial_activations, x) -> activations``: what ``backward`` reads, as one
      flat tuple (stacked, when both arguments are stacked over iterations);
    - ``backward(grad_new_carry, (grad_y, activations)) -> (grad_carry, grad_x)``.

    The activations are the iteration's inputs (its carry's leaves, then ``x``'s), and
    ``backward`` recomputes the iteration's forward from them under PyTorch's autograd (the
    memory of ``min_cut_rematerialization_partition``; ``partition_fn`` and ``is_fn_pure``
    is accepted for torch_xla's signature). A gradient a leaf does not receive (an integer
    leaf, an unused one) is zeros; ``grad_y`` / ``grad_new_carry`` leaves may be None.

    With ``is_fn_pure`` the three functions are kept per ``fn`` (``_SCAN_COMPUTATION_CACHE``,
    as torch_xla keeps them), for the same ``partition_fn``, leaf shapes, dtypes and
    structures."""
    init_flat, carry_spec = pytree.tree_flatten(init)
    xs_flat, x_spec = pytree.tree_flatten(xs)
    key = (id(partition_fn), carry_spec, x_spec, tuple(bodies.avals_of(init_flat + xs_flat)))
    if is_fn_pure and key in _SCAN_COMPUTATION_CACHE.get(fn, {}):
        return _SCAN_COMPUTATION_CACHE[fn][key]
    n_carry = len(init_flat)

    def forward(carry, x):
        with torch.no_grad():
            new_carry, y = fn(carry, x)
        return new_carry, (y, tuple(t.detach() for t in pytree.tree_leaves(carry)))

    def alias_input(partial_activations, x):
        return tuple(partial_activations) + tuple(pytree.tree_leaves(x))

    def backward(grad_new_carry, grad_y_and_activations):
        grad_y, activations = grad_y_and_activations
        leaves = [t.detach().requires_grad_(_differentiable(t)) for t in activations]
        carry = pytree.tree_unflatten(leaves[:n_carry], carry_spec)
        x = pytree.tree_unflatten(leaves[n_carry:], x_spec)
        with torch.enable_grad():
            outs = pytree.tree_leaves(fn(carry, x))
        grads = pytree.tree_leaves((grad_new_carry, grad_y), is_leaf=lambda g: g is None)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs and wrt else [None] * len(wrt))  # fmt: skip
        res = []
        for t in leaves:
            g = next(got) if t.requires_grad else None
            res.append(torch.zeros_like(t) if g is None else g)
        return pytree.tree_unflatten(res[:n_carry], carry_spec), pytree.tree_unflatten(res[n_carry:], x_spec)

    if is_fn_pure:
        _SCAN_COMPUTATION_CACHE.setdefault(fn, {})[key] = forward, alias_input, backward
    return forward, alias_input, backward


# fn -> {(partition_fn's id, structures, shapes and dtypes): (forward, alias_input, backward)}
_SCAN_COMPUTATION_CACHE: WeakKeyDictionary = WeakKeyDictionary()


def tree_flatten_none(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """``tree``'s leaves without its None leaves, and the function that puts them back:
    ``unflatten(leaves)`` rebuilds ``tree``'s structure, None where ``tree`` had None."""
    leaves, spec = pytree.tree_flatten(tree, is_leaf=lambda v: v is None)
    none = [v is None for v in leaves]

    def unflatten(kept) -> Any:
        kept = iter(kept)
        return pytree.tree_unflatten([None if n else next(kept) for n in none], spec)

    return [v for v in leaves if v is not None], unflatten
