"""``assume_pure``: a pure function traced once per input signature, then replayed
(``assume_pure_torch``: the same, forward only, as torch_xla has it).

The first call with a new signature (tensor shapes, dtypes and ``requires_grad``, the other
arguments' values) traces the function into a body (``runtime/trace/bodies.py``); every later
call records one node that computes the whole function - no per-op tracing, so a call costs
the same whatever the number of ops inside. The backward is traced once too (the function's
forward recomputed and differentiated in one body).

The function must be pure: its result depends only on its arguments; the Python numbers it
uses are constants of its program. A tensor it reads from
outside its arguments (a module's weight in a closure) is an error, as its value would be
frozen at the first call: pass it as an argument (``assume_pure(torch.func.functional_call)``
for a module). Random ops would draw the same numbers at every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from xlatorch.runtime.ir.values import Data, Out, operands
from xlatorch.runtime.trace import bodies, loops
from xlatorch.runtime.trace.bodies import BodyError, mark_non_differentiable
from xlatorch.runtime.trace.tensor import value_of, wrap

__all__ = ["assume_pure", "assume_pure_torch", "PureModule", "j2t_autograd"]


def assume_pure(fn: Callable, *, add_rng_seed_argument: bool = False) -> Callable:
    """``fn`` traced once per input signature and replayed afterwards (see the module docstring).

    Args:
      fn: a pure function of tensors (and other arguments, part of the signature).
      add_rng_seed_argument: not supported yet (raises).
    """
    if add_rng_seed_argument:
        raise NotImplementedError("xlatorch: assume_pure(add_rng_seed_argument=True) is not supported yet")
    cache: dict = {}

    @functools.wraps(fn)
    def pure(*args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        pos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        tensors = [leaves[i] for i in pos]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        key = _signature(leaves, spec, pos, tensors, grad)
        entry = cache.get(key)
        if entry is None:
            entry = cache[key] = _Traced(fn, leaves, spec, pos, tensors)
        if not grad:
            return entry.unflatten(entry.forward(tensors))
        return entry.unflatten(_Pure.apply(entry, *tensors))

    pure.__wrapped__ = fn
    return pure


def _signature(leaves, spec, pos, tensors, grad) -> tuple:
    return (spec, tuple(pos), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors), grad,
            tuple(_hashable(a) for i, a in enumerate(leaves) if i not in set(pos)))  # fmt: skip


# assume_pure_torch(use_cache=True)'s traces: {(function, signature): trace}. Clear it to trace anew.
_XLA_COMPUTATION_CACHE: dict = {}


def assume_pure_torch(func: Callable, use_cache: bool = False) -> Callable:
    """torch_xla's forward-only ``assume_pure``: ``func`` (pure, as for ``assume_pure``) runs
    as one node of the graph computing its whole body, traced from placeholders at each call,
    or with ``use_cache=True`` once per input signature (kept in ``_XLA_COMPUTATION_CACHE``;
    later calls do not run ``func``'s Python at all).

    No backward: decorate with gradients disabled (``torch.set_grad_enabled(False)``), as
    torch_xla requires; a call that would need gradients raises (``assume_pure`` has them).
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            "xlatorch: assume_pure_torch is forward-only: decorate (and call) with gradients disabled "
            "(torch.set_grad_enabled(False)), or use assume_pure, which has a backward"
        )

    @functools.wraps(func)
    def pure(*args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        pos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        tensors = [leaves[i] for i in pos]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise RuntimeError(
                f"xlatorch: assume_pure_torch({_name(func)}) is forward-only but was called with gradients "
                "enabled on inputs that require grad: call it under torch.no_grad(), or use assume_pure"
            )
        if not use_cache:
            return _forward_only(_Traced(func, leaves, spec, pos, tensors), tensors)
        key = (func, _signature(leaves, spec, pos, tensors, False))
        entry = _XLA_COMPUTATION_CACHE.get(key)
        if entry is None:
            entry = _XLA_COMPUTATION_CACHE[key] = _Traced(func, leaves, spec, pos, tensors)
        return _forward_only(entry, tensors)

    pure.__wrapped__ = func
    return pure


def _forward_only(entry, tensors):
    with torch.no_grad():
        return entry.unflatten(entry.forward(tensors))


def _hashable(a):
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


class _Traced:
    """One signature's trace: the forward body and, once asked for, the backward body."""

    def __init__(self, fn, leaves, spec, pos, tensors):
        # The other arguments only: the tensors of the first call are not kept.
        self.leaves = [None if i in set(pos) else a for i, a in enumerate(leaves)]
        self.fn, self.spec, self.pos = fn, spec, pos
        self.avals = bodies.avals_of(tensors)
        self.out_spec = None
        self.backward_body = None

        def body(ts):
            return self.call(ts)

        with torch.no_grad():
            self.body, self.captured, _ = bodies.trace_body(body, self.avals, f"the body of assume_pure({_name(fn)})",
                                                           constants=True)  # fmt: skip
        _check_constants(self.captured, fn)

    def call(self, ts) -> list:
        leaves = list(self.leaves)
        for i, t in zip(self.pos, ts):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        outs, self.out_spec = pytree.tree_flatten(self.fn(*args, **kwargs))
        return outs

    def forward(self, tensors) -> list:
        return [wrap(o) for o in loops.call(self.body, bodies.values_of(tensors, "assume_pure"), self.captured)]

    def unflatten(self, outs):
        return pytree.tree_unflatten(list(outs), self.out_spec)

    def backward(self, tensors, grads) -> list:
        n = len(tensors)
        diff = [t.requires_grad for t in tensors]
        if self.backward_body is None:
            out_avals = list(self.body.avals)

            def body(ts):
                xs = [t.detach().requires_grad_(d) for t, d in zip(ts[:n], diff)]
                with torch.enable_grad():
                    outs = self.call(xs)
                    pairs = [(o, g) for o, g in zip(outs, ts[n:]) if o.requires_grad]
                    wrt = [x for x in xs if x.requires_grad]
                    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]

            name = f"the backward of assume_pure({_name(self.fn)})"
            self.backward_body = bodies.trace_body(body, self.avals + out_avals, name, constants=True)[:2]
        b, captured = self.backward_body
        vals = bodies.values_of(list(tensors) + list(grads), "assume_pure")
        outs = iter(wrap(o) for o in loops.call(b, vals, captured))
        return [next(outs) if d else None for d in diff]


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_constants(captured, fn) -> None:
    """A traced pure function may capture numbers and constants it made itself, not device data."""
    stack = list(captured)
    seen = set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if type(v) is Data:
            raise BodyError(f"xlatorch: assume_pure({_name(fn)}) reads a tensor of shape {v.aval[0]} that is not "
                            f"one of its arguments; its value would be frozen at the first call: pass it as an "
                            f"argument (for a module, assume_pure(torch.func.functional_call))")  # fmt: skip
        if type(v) is Out:
            stack.extend(operands(v.node.args))


class _Pure(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, *tensors):
        ctx.entry = entry
        ctx.inputs = [wrap(value_of(t)) for t in tensors]
        for t, k in zip(ctx.inputs, tensors):
            t.requires_grad_(k.requires_grad)
        outs = entry.forward(tensors)
        mark_non_differentiable(ctx, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        grads = [
            torch.zeros(a[0], dtype=a[1], device="xla") if g is None else g for g, a in zip(grads, entry.body.avals)
        ]
        return (None, *entry.backward(ctx.inputs, grads))


def j2t_autograd(fn):
    """A JAX function as a differentiable PyTorch function on xla tensors (its backward is
    ``jax.vjp``): ``xlatorch.core.xla_builder.j2t_autograd``, where torch_xla keeps it."""
    from xlatorch.core.xla_builder import j2t_autograd as _j2t

    return _j2t(fn)


class PureModule(torch.nn.Module):
    """``module`` whose forward is known to be pure (no side effects, a function of its inputs,
    parameters and buffers): its forward is ``assume_pure`` over ``torch.func.functional_call``,
    traced once per input signature and then replayed, backward included."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._module = module
        self._pure_forward = assume_pure(functools.partial(_pure_forward, module))

    def forward(self, *args, **kwargs):
        return self._pure_forward(dict(self._module.named_parameters()), dict(self._module.named_buffers()),
                                  args, kwargs)  # fmt: skip


def _pure_forward(module, params, buffers, args, kwargs):
    return torch.func.functional_call(module, (params, buffers), args, kwargs)
