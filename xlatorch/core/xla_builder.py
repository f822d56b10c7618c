"""``torch_xla.core.xla_builder``: JAX functions inside PyTorch programs on the device.

``call_jax`` records a JAX function as one node of the lazy graph (``runtime/trace/jax_calls.py``);
``j2t_autograd`` makes a JAX function a differentiable PyTorch function (its backward is
``jax.vjp``, also one node). torch_xla's XLA op builder (``Op``, ``Type``, ``Shape``,
``create_computation``) builds over ``jax.lax`` inside a traced function;
``create_placeholder_tensor`` makes an input without a value, for tracing.
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

__all__ = [
    "Computation",
    "Op",
    "Shape",
    "Type",
    "call_jax",
    "create_builder",
    "create_computation",
    "create_placeholder_tensor",
    "get_computation_hlo",
    "j2t_autograd",
    "mkshape",
    "tensor_shape",
    "xla_computation_as_func",
]


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


# ---------------------------------------------------------------------------------------------
# torch_xla's XLA op builder (``Op``, ``Type``, ``Shape``, ``create_computation``), over jax.lax.
#
# An ``Op`` wraps a JAX value (or a tuple of them: XLA's tuple ops) inside a function JAX is
# tracing; each method is the jax.lax operation of XLA's op of that name, without implicit
# type promotion (as XLA: operands of a binary op share a dtype; a rank-0 operand broadcasts).
# A computation is a traced function (``create_computation``); ``xla_computation_as_func``
# runs one on xla tensors as one node of the lazy graph (``call_jax``).
# ---------------------------------------------------------------------------------------------


class Type:
    """XLA's element type names."""

    F32, F64, BF16, F16 = "f32", "f64", "bf16", "f16"
    U8, S8, U16, S16, U32, S32, U64, S64 = "u8", "s8", "u16", "s16", "u32", "s32", "u64", "s64"
    C64, C128, PRED = "c64", "c128", "pred"


_XLA_PT_TYPE_MAP = {
    Type.F32: torch.float32, Type.F64: torch.float64, Type.BF16: torch.bfloat16, Type.F16: torch.float16,
    Type.U8: torch.uint8, Type.S8: torch.int8, Type.U16: torch.uint16, Type.S16: torch.int16,
    Type.U32: torch.uint32, Type.S32: torch.int32, Type.U64: torch.uint64, Type.S64: torch.int64,
    Type.C64: torch.complex64, Type.C128: torch.complex128, Type.PRED: torch.bool,
}  # fmt: skip
_PT_XLA_TYPE_MAP = {v: k for k, v in _XLA_PT_TYPE_MAP.items()}


def _jax_dtype(xla_type):
    from xlatorch.runtime.base.dtypes import to_jax

    return to_jax(Op.to_torch_type(xla_type))


class Shape:
    """An XLA shape: ``{'type': 'f32', 'sizes': (2, 3)}``, or a tuple of shapes."""

    def __init__(self, shape):
        self._shape = shape

    @classmethod
    def create(cls, dtype, sizes, dynamic_dimensions=None) -> Shape:
        shape = {"type": str(dtype), "sizes": tuple(sizes)}
        if dynamic_dimensions is not None:
            shape["dynamic_dimensions"] = tuple(dynamic_dimensions)
        return Shape(shape)

    @classmethod
    def of(cls, value) -> Shape:
        """The shape of a JAX value (or a tuple of them)."""
        if isinstance(value, tuple):
            return Shape(tuple(cls.of(v).shape for v in value))
        return cls.create(_PT_XLA_TYPE_MAP[_torch_dtype(value.dtype)], value.shape)

    @property
    def shape(self):
        return self._shape

    def is_tuple(self) -> bool:
        return isinstance(self._shape, (list, tuple))

    def tuple_size(self) -> int:
        return len(self._shape)

    def tuple_shape(self, index):
        return self._shape[index]

    def is_dynamic(self) -> bool:
        return "dynamic_dimensions" in self._shape

    def as_scalar(self) -> Shape:
        return Shape.create(self.dtype, ())

    @property
    def rank(self) -> int:
        return len(self._shape["sizes"])

    @property
    def sizes(self) -> tuple:
        return self._shape["sizes"]

    @property
    def dynamic_dimensions(self):
        return self._shape.get("dynamic_dimensions")

    @property
    def dtype(self) -> str:
        return self._shape["type"]


def _torch_dtype(jdtype) -> torch.dtype:
    from xlatorch.runtime.base.dtypes import TORCH_TO_JAX

    for t, j in TORCH_TO_JAX.items():
        if np.dtype(j) == np.dtype(jdtype):
            return t
    raise TypeError(f"xla_builder: no PyTorch dtype for {jdtype}")


class _Builder:
    """The builder ops are made in (a name: JAX traces the function that makes them)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"XlaBuilder({self.name!r})"


class Computation:
    """A built computation: ``fn`` (JAX arrays -> a JAX value or tuple) for ``shapes``."""

    def __init__(self, name: str, fn: Callable, shapes: list[Shape]):
        self.name, self.fn, self.shapes = name, fn, list(shapes)

    def __call__(self, *arrays):
        return self.fn(*arrays)

    def hlo_text(self) -> str:
        args = [jax.ShapeDtypeStruct(s.sizes, _jax_dtype(s.dtype)) for s in self.shapes]
        return jax.jit(self.fn).lower(*args).as_text(dialect="hlo")


def _v(x):
    return x.op if isinstance(x, Op) else x


def _binary(fn):
    def method(self, rhs):
        a, b = self.op, _v(rhs)
        if np.ndim(a) != np.ndim(b) and (np.ndim(a) == 0 or np.ndim(b) == 0):  # XLA broadcasts a scalar
            a, b = jax.numpy.broadcast_arrays(a, b)
        return Op(fn(a, b), self._builder)

    return method


def _unary(fn):
    def method(self):
        return Op(fn(self.op), self._builder)

    return method


def _shift_right(a, b):
    unsigned = jax.numpy.issubdtype(a.dtype, jax.numpy.unsignedinteger)
    return jax.lax.shift_right_logical(a, b) if unsigned else jax.lax.shift_right_arithmetic(a, b)


class Op:
    """An XLA operation being built (a JAX value inside a traced function); the methods are
    XLA's operations (https://openxla.org/xla/operation_semantics), lowered to ``jax.lax``."""

    def __init__(self, op, builder=None):
        self.op = op
        self._builder = builder or _Builder("xla_builder")

    def shape(self) -> Shape:
        return Shape.of(self.op)

    def builder(self) -> _Builder:
        return self._builder

    def build(self, name):
        raise NotImplementedError(
            "xla_builder: build a computation with create_computation(name, fn, shapes) "
            "(xlatorch traces fn with JAX; an op cannot be built on its own)"
        )

    def reshape(self, sizes, dimensions=None, inferred_dimension=None):
        return Op(jax.lax.reshape(self.op, tuple(sizes), dimensions), self._builder)

    def broadcast(self, sizes):
        return Op(jax.lax.broadcast(self.op, tuple(sizes)), self._builder)

    def broadcast_in_dim(self, sizes, dimensions):
        return Op(jax.lax.broadcast_in_dim(self.op, tuple(sizes), tuple(dimensions)), self._builder)

    def slice(self, start_indices, limit_indices, strides=None):
        return Op(jax.lax.slice(self.op, start_indices, limit_indices, strides), self._builder)

    def slice_in_dim(self, start_index, limit_index, dimno, stride=1):
        return Op(jax.lax.slice_in_dim(self.op, start_index, limit_index, stride, dimno), self._builder)

    def dynamic_slice(self, start_indices, slice_sizes):
        return Op(jax.lax.dynamic_slice(self.op, [_v(i) for i in start_indices], slice_sizes), self._builder)

    def dynamic_update_slice(self, update, start_indices):
        starts = [_v(i) for i in start_indices]
        return Op(jax.lax.dynamic_update_slice(self.op, _v(update), starts), self._builder)

    def cast(self, to_type):
        return Op(jax.lax.convert_element_type(self.op, _jax_dtype(to_type)), self._builder)

    def bitcast(self, to_type):
        return Op(jax.lax.bitcast_convert_type(self.op, _jax_dtype(to_type)), self._builder)

    def pad(self, value, config):
        """``config``: one ``(low, high, interior)`` per dimension."""
        return Op(jax.lax.pad(self.op, _v(value), [tuple(c) for c in config]), self._builder)

    def reduce(self, init_value, computation, dimensions):
        comp = Op.make_computation("Reduce", computation, (init_value.shape().as_scalar(),) * 2)
        return Op(jax.lax.reduce(self.op, _v(init_value), comp, tuple(dimensions)), self._builder)

    def reduce_all(self, init_value, computation):
        return self.reduce(init_value, computation, range(np.ndim(self.op)))

    def select(self, true_value, false_value):
        return Op(jax.lax.select(self.op, _v(true_value), _v(false_value)), self._builder)

    def transpose(self, permutation):
        return Op(jax.lax.transpose(self.op, tuple(permutation)), self._builder)

    def triangualr_solve(self, b, left_side, lower, unit_diagonal, transpose_a):  # torch_xla's spelling
        """Solve ``op(self) @ x = b`` (``left_side``) or ``x @ op(self) = b`` for triangular ``self``."""
        x = jax.lax.linalg.triangular_solve(self.op, _v(b), left_side=left_side, lower=lower,
                                            transpose_a=transpose_a, unit_diagonal=unit_diagonal)  # fmt: skip
        return Op(x, self._builder)

    triangular_solve = triangualr_solve

    def clamp(self, min_value, max_value):
        return Op(jax.lax.clamp(_v(min_value), self.op, _v(max_value)), self._builder)

    def get_tuple_element(self, index):
        return Op(self.op[index], self._builder)

    def conditional(self, true_operand, false_operand, true_computation, false_computation):
        t = Op.make_computation("CondTrue", true_computation, (true_operand,))
        f = Op.make_computation("CondFalse", false_computation, (false_operand,))
        if true_operand is false_operand:
            return Op(jax.lax.cond(self.op, t, f, true_operand.op), self._builder)
        return Op(jax.lax.cond(self.op, lambda a, b: t(a), lambda a, b: f(b), true_operand.op, false_operand.op),
                  self._builder)  # fmt: skip

    def mkconditional(self, ops, true_fn, false_fn, **kwargs):
        operand = Op.tuple(ops)
        return self.conditional(operand, operand, true_fn, false_fn)

    def while_loop(self, condition_computation, body_computation):
        cond = Op.make_computation("Condition", condition_computation, (self,))
        body = Op.make_computation("Body", body_computation, (self,))
        return Op(jax.lax.while_loop(cond, body, self.op), self._builder)

    @classmethod
    def mkwhile(cls, ops, condition_fn, body_fn, **kwargs):
        return Op.tuple(ops).while_loop(condition_fn, body_fn)

    def get_dimension_size(self, dimension):
        return Op(jax.numpy.int32(np.shape(self.op)[dimension]), self._builder)

    def rev(self, dimensions):
        return Op(jax.lax.rev(self.op, tuple(dimensions)), self._builder)

    def scalar_like(self, value):
        return Op(jax.numpy.full(np.shape(self.op), value, self.op.dtype), self._builder)

    def zeros_like(self):
        return self.scalar_like(0)

    def ones_like(self):
        return self.scalar_like(1)

    @classmethod
    def wrap_function(cls, fn):
        """``fn`` over Ops as a function of JAX values: a tuple argument is passed as its
        elements; a tuple or list result becomes a tuple op."""

        def wrapper(*args, **kwargs):
            if len(args) == 1 and isinstance(args[0], tuple):
                args = args[0]
            result = fn(*[Op(a) for a in args], **kwargs)
            return Op.tuple(result).op if isinstance(result, (tuple, list)) else _v(result)

        return wrapper

    @classmethod
    def make_computation(cls, name, computation, args_or_shapes, **kwargs):
        if isinstance(computation, Computation):
            return computation
        shapes = [a if isinstance(a, Shape) else a.shape() for a in args_or_shapes]
        return Computation(name, functools.partial(Op.wrap_function(computation), **kwargs), shapes)

    @classmethod
    def tuple(cls, ops, builder=None):
        return Op(tuple(_v(o) for o in ops), builder)

    @classmethod
    def concat_in_dim(cls, ops, dimension, builder=None):
        return Op(jax.lax.concatenate([_v(o) for o in ops], dimension), builder)

    @classmethod
    def call(cls, computation, ops, builder=None):
        comp = Op.make_computation("Call", computation, ops)
        return Op(comp(*[_v(o) for o in ops]), builder)

    @classmethod
    def constant(cls, builder, value):
        from xlatorch.runtime.base.dtypes import to_jax

        t = torch.as_tensor(value)
        return Op(jax.numpy.asarray(t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy(), to_jax(t.dtype)),
                  builder)  # fmt: skip

    @classmethod
    def scalar(cls, builder, value, dtype=None):
        return Op(jax.numpy.asarray(value, _jax_dtype(dtype)), builder)

    @classmethod
    def zero(cls, builder, dtype=None):
        return cls.scalar(builder, 0, dtype)

    @classmethod
    def one(cls, builder, dtype=None):
        return cls.scalar(builder, 1, dtype)

    @classmethod
    def iota(cls, builder, shape, iota_dimension):
        s = shape if isinstance(shape, Shape) else Shape(shape)
        return Op(jax.lax.broadcasted_iota(_jax_dtype(s.dtype), s.sizes, iota_dimension), builder)

    @classmethod
    def to_torch_type(cls, dtype):
        return _XLA_PT_TYPE_MAP[dtype] if dtype else torch.float32

    @classmethod
    def from_torch_type(cls, dtype):
        return _PT_XLA_TYPE_MAP[dtype]


_OPS = {  # XLA's elementwise ops: method name -> jax.lax function
    "__add__": (_binary, jax.lax.add), "__sub__": (_binary, jax.lax.sub), "__mul__": (_binary, jax.lax.mul),
    "__matmul__": (_binary, jax.lax.dot), "__truediv__": (_binary, jax.lax.div), "__pow__": (_binary, jax.lax.pow),
    "__mod__": (_binary, jax.lax.rem), "__and__": (_binary, jax.lax.bitwise_and),
    "__or__": (_binary, jax.lax.bitwise_or), "__xor__": (_binary, jax.lax.bitwise_xor),
    "__eq__": (_binary, jax.lax.eq), "__ne__": (_binary, jax.lax.ne), "__le__": (_binary, jax.lax.le),
    "__lt__": (_binary, jax.lax.lt), "__ge__": (_binary, jax.lax.ge), "__gt__": (_binary, jax.lax.gt),
    "__lshift__": (_binary, jax.lax.shift_left), "__rshift__": (_binary, _shift_right),
    "atan2": (_binary, jax.lax.atan2), "max": (_binary, jax.lax.max), "min": (_binary, jax.lax.min),
    "__neg__": (_unary, jax.lax.neg), "__not__": (_unary, jax.lax.bitwise_not),
    "__invert__": (_unary, jax.lax.bitwise_not),
    "acos": (_unary, jax.lax.acos), "asin": (_unary, jax.lax.asin), "atan": (_unary, jax.lax.atan),
    "ceil": (_unary, jax.lax.ceil), "cos": (_unary, jax.lax.cos), "cosh": (_unary, jax.lax.cosh),
    "erf": (_unary, jax.lax.erf), "erfc": (_unary, jax.lax.erfc), "erfinf": (_unary, jax.lax.erf_inv),
    "exp": (_unary, jax.lax.exp), "expm1": (_unary, jax.lax.expm1), "floor": (_unary, jax.lax.floor),
    "log": (_unary, jax.lax.log), "log1p": (_unary, jax.lax.log1p), "sqrt": (_unary, jax.lax.sqrt),
    "real": (_unary, jax.lax.real), "imag": (_unary, jax.lax.imag), "clz": (_unary, jax.lax.clz),
    "conj": (_unary, jax.lax.conj), "rsqrt": (_unary, jax.lax.rsqrt), "sin": (_unary, jax.lax.sin),
    "sinh": (_unary, jax.lax.sinh), "tan": (_unary, jax.lax.tan), "tanh": (_unary, jax.lax.tanh),
}  # fmt: skip
for _name, (_kind, _fn) in _OPS.items():
    setattr(Op, _name, _kind(_fn))
Op.__hash__ = object.__hash__  # __eq__ builds an op; Ops stay hashable by identity


def create_builder(name: str) -> _Builder:
    """A builder named ``name`` (ops made from its parameters carry it)."""
    return _Builder(name)


def mkshape(dtype, sizes, dynamic_dimensions=None) -> Shape:
    return Shape.create(dtype, sizes, dynamic_dimensions=dynamic_dimensions)


def tensor_shape(tensor, device="") -> Shape | list[Shape]:
    """The XLA shape of a tensor (or of each of a list of them)."""
    if isinstance(tensor, (list, tuple)):
        return [tensor_shape(t, device) for t in tensor]
    return Shape.create(Op.from_torch_type(tensor.dtype), tuple(tensor.shape))


def create_computation(name: str, fn: Callable, shapes: list[Shape], **kwargs) -> Computation:
    """The computation ``fn(*params, **kwargs)`` builds from one parameter per shape (``fn``
    takes and returns Ops; a tuple op is a tuple result). Traced by JAX when it runs."""

    def run(*arrays):
        builder = _Builder(name)
        return _v(fn(*[Op(a, builder) for a in arrays], **kwargs))

    return Computation(name, run, shapes)


def get_computation_hlo(computation: Computation) -> str:
    """The HLO text of a computation (lowered for its parameters' shapes)."""
    return computation.hlo_text()


def xla_computation_as_func(computation: Computation, name: str | None = None) -> Callable:
    """A function of a list of xla tensors running ``computation`` on them as one node of the
    lazy graph (no sync); returns the list of its results."""
    name = name or f"xla::{computation.name}"

    def fn(input_tensors):
        out = call_jax(computation.fn, tuple(input_tensors), name=name, override_hash=("xla_builder", computation))
        return list(out) if isinstance(out, tuple) else [out]

    return fn


def create_placeholder_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """An xla tensor of ``shape`` and ``dtype`` with no value: graphs can read it (it is one of
    their inputs, like any device data; nothing is transferred), but computing anything from
    it, or reading it, raises. For tracing a program without its data."""
    from xlatorch.runtime.base.dtypes import to_jax
    from xlatorch.runtime.base.topology import current_device, jax_device
    from xlatorch.runtime.ir.values import Data
    from xlatorch.runtime.trace.tensor import wrap

    dev = current_device()
    arr = jax.device_put(np.zeros((), to_jax(dtype)), jax_device(dev))
    arr = jax.numpy.broadcast_to(arr, tuple(shape))  # no host buffer of the full size
    arr.delete()  # a buffer that is gone: what a placeholder is to XLA
    return wrap(Data(arr, (tuple(shape), dtype), dev))
