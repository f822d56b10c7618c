"""``torch_xla.core.xla_builder``: JAX functions inside PyTorch programs on the device.

``call_jax`` records a JAX function as one node of the lazy graph (``runtime/trace/jax_calls.py``);
``j2t_autograd`` makes a JAX function a differentiable PyTorch function (its backward is
``jax.vjp``, also one node). torch_xla's XLA builder API (``create_builder``, ``Op``...) is not
provided: JAX is xlatorch's builder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from xlatorch.runtime.trace.bodies import mark_non_differentiable
from xlatorch.runtime.trace.jax_calls import TRACED as _JAX_TO_XLA_COMPUTATION_CACHE
from xlatorch.runtime.trace.jax_calls import call_jax as _call_jax

__all__ = ["call_jax", "j2t_autograd"]


def call_jax(jax_func: Callable, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, name=None,
             override_hash=None):  # fmt: skip
    """Call ``jax_func`` (``jax.jit``-traceable, pure) with the xla tensors of ``args`` / ``kwargs``
    as JAX arrays; its results come back as xla tensors, in the same pytree.

    Recorded as one node of the lazy graph: nothing syncs or runs at the call, the function is
    traced with the step's graph and compiled into it. Calls are keyed by ``jax_func``'s identity
    (or ``override_hash``: give one when the function is made anew at every call, e.g. a
    closure), the arguments' structure, their non-tensor values and the tensors' shapes and
    dtypes. Not differentiable by itself: see ``j2t_autograd``.

    Args:
      jax_func: the JAX function.
      args: its positional arguments (pytrees; xla tensors become JAX arrays).
      kwargs: its keyword arguments.
      name: a name for messages and the graph's dumps.
      override_hash: the cache key to use instead of ``jax_func``'s identity.
    """
    return _call_jax(jax_func, args, kwargs, name=name, override_hash=override_hash)


def _jax_to_xla_computation_cache_elements() -> int:
    """How many (function, signature) pairs ``call_jax`` has traced (torch_xla's tests count them)."""
    return len(_JAX_TO_XLA_COMPUTATION_CACHE)


def j2t_autograd(fn: Callable) -> Callable:
    """A PyTorch function computing the JAX function ``fn`` on xla tensors, with autograd: its
    backward is ``jax.vjp(fn)`` on the device (torch_xla's ``j2t_autograd``). Tensors are the
    differentiable inputs; other arguments are constants of the call."""

    @functools.wraps(fn)
    def torch_fn(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_tensor)
        pos = [i for i, a in enumerate(leaves) if _is_tensor(a)]
        call = _Call(fn, leaves, tree, pos)
        outs = _JaxFunction.apply(call, *[leaves[i] for i in pos])
        return jax.tree_util.tree_unflatten(call.out_tree, list(outs))

    return torch_fn


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class _Call:
    """``fn`` as a function of its tensor leaves only, and its vjp; keyed by ``fn``'s identity
    and the other leaves (the closures made here are new at every call)."""

    def __init__(self, fn, leaves, tree, pos):
        self.fn, self.tree, self.pos = fn, tree, pos
        self.leaves = [None if i in set(pos) else a for i, a in enumerate(leaves)]
        self.key = (id(fn), tree, tuple(pos), repr(self.leaves))
        self.out_tree = None

    def flat(self, *arrays):
        leaves = list(self.leaves)
        for i, a in zip(self.pos, arrays):
            leaves[i] = a
        args, kwargs = jax.tree_util.tree_unflatten(self.tree, leaves)
        return self.fn(*args, **kwargs)

    def forward(self, tensors):
        outs = call_jax(lambda *xs: jax.tree_util.tree_leaves(self.flat(*xs)), tuple(tensors),
                        name=getattr(self.fn, "__name__", None), override_hash=("j2t", self.key))  # fmt: skip
        self.out_tree = jax.tree_util.tree_structure(jax.eval_shape(self.flat, *[_spec(t) for t in tensors]))
        return outs

    def backward(self, primals, cts):
        def vjp(primals, cts):
            outs, pull = jax.vjp(lambda *xs: jax.tree_util.tree_leaves(self.flat(*xs)), *primals)
            cts = [c if _float(o.dtype) else np.zeros(o.shape, jax.dtypes.float0) for c, o in zip(cts, outs)]
            return [None if g.dtype == jax.dtypes.float0 else g for g in pull(cts)]

        return call_jax(vjp, (tuple(primals), tuple(cts)), override_hash=("j2t vjp", self.key))


def _spec(t):
    from xlatorch.runtime.base.dtypes import to_jax

    return jax.ShapeDtypeStruct(tuple(t.shape), to_jax(t.dtype))


def _float(dtype) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.inexact)


class _JaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call = call
        ctx.save_for_backward(*tensors)
        outs = call.forward(tensors)
        mark_non_differentiable(ctx, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *cts):
        # Autograd gives zeros for outputs it has no gradient for (set_materialize_grads).
        return (None, *ctx.call.backward(ctx.saved_tensors, list(cts)))
