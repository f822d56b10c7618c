"""A JAX function called on xla tensors: one node of the lazy graph (``call_jax``).

The node's lowering is the user's function itself, applied to its operands' JAX values while
the step's graph is traced by JAX: no sync, no execution of its own, and XLA optimises it
with the rest of the step. Its outputs' avals come from ``jax.eval_shape`` once per
signature. A call is keyed by the function's identity (or the caller's ``override_hash``),
the arguments' structure and non-tensor values, and the tensors' avals: the same call in the
next step hits the same executable.

``xlatorch.core.xla_builder.j2t_autograd`` builds PyTorch autograd on it: the backward is
another call, of ``jax.vjp`` (it recomputes the forward inside the backward's node; XLA may
share the two when they are in one step's graph).
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from xlatorch.runtime.base.dtypes import to_jax, to_torch
from xlatorch.runtime.ir.body import Keyed
from xlatorch.runtime.ir.ops import STATIC, TENSOR_LIST, TUPLE, Info, OpSpec
from xlatorch.runtime.trace.bodies import values_of
from xlatorch.runtime.trace.nodes import _node
from xlatorch.runtime.trace.tensor import wrap

__all__ = ["call_jax", "JaxCall", "TRACED"]

_TENSOR = object()  # marks where a tensor goes among a call's leaves


class JaxCall(Keyed):
    """What a node needs to call the function: the function, its arguments' structure (a JAX
    tree of the positional and keyword arguments) and their non-tensor leaves; identified by
    ``key`` (never by the function object's own equality)."""

    __slots__ = ("fn", "tree", "leaves", "out_tree", "name")

    def __init__(self, fn, tree, leaves, key, name):
        super().__init__(key)
        self.fn, self.tree, self.leaves, self.name = fn, tree, leaves, name
        self.out_tree = None

    def __repr__(self):
        return f"JaxCall({self.name})"

    def apply(self, arrays):
        """The function's flat outputs on the tensors' JAX values (``arrays``, in order)."""
        it = iter(arrays)
        args, kwargs = jax.tree_util.tree_unflatten(self.tree, [next(it) if a is _TENSOR else a for a in self.leaves])
        out = self.fn(*args, **kwargs)
        flat, tree = jax.tree_util.tree_flatten(out)
        self.out_tree = tree
        return flat


def _emit(out, operands, call):
    return call.apply(operands)


_SPEC = OpSpec("xlatorch::call_jax", None, _emit, ("operands", "fn"), (TENSOR_LIST, STATIC), (False, False), TUPLE)
# (call key, operand signatures) -> (output avals, output tree): one entry per trace of a function.
TRACED: dict = {}
_OUT = TRACED


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def call_jax(fn, args, kwargs=None, name=None, override_hash=None):
    """``fn(*args, **kwargs)`` with the xla tensors in ``args`` / ``kwargs`` (pytrees) as JAX
    arrays, recorded as one node; its JAX results come back as xla tensors, in the same tree.

    Raises:
      BodyError: an argument is a tensor that is not on the xla device.
      Any error of tracing ``fn`` with ``jax.eval_shape``, at the call.
    """
    leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs or {})), is_leaf=_is_tensor)
    tensors = [a for a in leaves if _is_tensor(a)]
    vals = values_of(tensors, f"call_jax({_name(fn, name)})")
    statics = tuple(_TENSOR if _is_tensor(a) else a for a in leaves)
    key = (override_hash if override_hash is not None else id(fn), tree, _static_key(statics), _jax_config())
    call = JaxCall(fn, tree, statics, key, _name(fn, name))
    sigs = tuple(v.sig for v in vals)
    found = _OUT.get((key, sigs))
    if found is None:
        specs = [jax.ShapeDtypeStruct(v.aval[0], to_jax(v.aval[1])) for v in vals]
        shapes = jax.eval_shape(lambda *xs: call.apply(xs), *specs)
        avals = tuple((tuple(s.shape), to_torch(s.dtype)) for s in shapes)
        found = _OUT[(key, sigs)] = (avals, call.out_tree)
    avals, out_tree = found
    sig = (sigs, call)
    if sig not in _SPEC.cache:
        _SPEC.cache[sig] = Info(avals, None)
    outs = [wrap(o) for o in _node(_SPEC, (tuple(vals), call), sig).outs]
    return jax.tree_util.tree_unflatten(out_tree, outs)


def _jax_config() -> tuple:
    """The JAX settings a function's trace depends on: changing one makes another call (and
    another graph), never a stale executable."""
    c = jax.config
    return (c.jax_default_matmul_precision, c.jax_enable_x64, c.jax_numpy_rank_promotion, c.jax_numpy_dtype_promotion)


def _name(fn, name) -> str:
    return name or getattr(fn, "__qualname__", None) or type(fn).__name__


def _static_key(statics) -> tuple:
    out = []
    for a in statics:
        if a is _TENSOR:
            out.append("T")
            continue
        try:
            hash(a)
            out.append((type(a), a))
        except TypeError:
            out.append(("id", id(a)) if not isinstance(a, np.ndarray) else ("np", a.tobytes(), a.shape, str(a.dtype)))
    return tuple(out)
