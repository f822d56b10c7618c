"""From an ATen call to an IR node: argument conversion, shape/dtype inference, variants.

The generated table (``generated/dispatch.py``) maps each lowered ``OpOverload`` to a
shim whose Python signature mirrors the ATen schema; the shim calls ``call`` (or
``call_inplace`` / ``call_out``) with the arguments in schema order. Output avals and
the computation dtype come from PyTorch itself (meta kernels, ``elementwise_dtypes``)
once per signature, then from ``OpSpec.cache``.
"""

from __future__ import annotations

from weakref import ref as _weakref

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from xlatorch.runtime import checks
from xlatorch.runtime import tensor as _tensor_module
from xlatorch.runtime.dtypes import PY_SCALAR_DTYPE
from xlatorch.runtime.ir import VALUE_TYPES, Node, Scalar
from xlatorch.runtime.record import COUNTERS
from xlatorch.runtime.rng import next_key
from xlatorch.runtime.source import user_frame
from xlatorch.runtime.tensor import (
    CHECKED_SINCE_SYNC,
    TICKS,
    XlaTensor,
    _in_backward,
    defer_to_owners,
    owner,
    value_of,
    wrap,
    write,
)

__all__ = ["OpSpec", "Info", "dispatch", "call", "call_inplace", "call_out", "scalar", "SHIMS", "RUNTIME_OPS",
           "DECOMPS"]  # fmt: skip

# Argument kinds, from the schema's types (codegen decides; see codegen/schema.py).
# GENERATOR is a synthetic trailing argument of random ops: a fresh seed per call.
TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST, STATIC, GENERATOR = range(7)
# Return kinds.
ONE, TUPLE, LIST = range(3)

PROMOTION = {k.name.lower(): k for k in ELEMENTWISE_TYPE_PROMOTION_KIND}

SHIMS: dict = {}  # OpOverload -> shim, filled by generated/dispatch.py
RUNTIME_OPS: dict = {}  # OpOverload -> hand-written handler (copies, transfers, aliases)
DECOMPS: dict = {}  # OpOverload -> PyTorch decomposition into ops that are lowered


def _no_fallback(func, args, kwargs):
    raise NotImplementedError(f"xlatorch: aten::{func._schema.name} has no lowering and no CPU fallback is installed")


# Ops with no lowering: xlatorch.fallback installs its CPU fallback here when imported (it
# sits above the runtime and calls down into it).
FALLBACK = [_no_fallback]


class Info:
    """What a node's signature determines: output avals, computation dtype, and whether
    the node carries an on-device check (``runtime/checks.py``)."""

    __slots__ = ("avals", "cdtype", "checked")

    def __init__(self, avals, cdtype, checked=False):
        self.avals = avals
        self.cdtype = cdtype
        self.checked = checked


class OpSpec:
    """One lowered ATen overload: everything the runtime needs, from ops.yaml + schema."""

    __slots__ = (
        "name", "overload", "emit", "arg_names", "kinds", "kwarg_only", "returns",
        "promote", "promote_idx", "view", "scatter", "cache", "meta_overload", "check", "check_integral",
        "counter", "mutates", "born",
    )  # fmt: skip

    def __init__(self, name, overload, emit, arg_names, kinds, kwarg_only, returns,
                 promote=None, promote_args=None, view=False, scatter=None, meta_overload=None,
                 check=None, check_integral=False, mutates=()):  # fmt: skip
        self.name = name
        self.overload = overload
        self.emit = emit
        self.arg_names = arg_names
        self.kinds = kinds
        self.kwarg_only = kwarg_only
        self.returns = returns
        self.promote = PROMOTION[promote] if promote else None
        names = promote_args or [n for n, k in zip(arg_names, kinds) if k in (TENSOR, OPT_TENSOR, SCALAR)]
        self.promote_idx = tuple(arg_names.index(n) for n in names)
        self.view = view
        self.scatter = scatter
        self.cache: dict = {}
        # The overload whose meta kernel gives this spec's avals (an in-place variant
        # uses its own, so PyTorch's in-place casting rules and errors apply).
        self.meta_overload = meta_overload or overload
        # The on-device check (ops.yaml ``check``): called like ``emit``, gives L.checks results.
        self.check = check
        self.check_integral = check_integral  # check only when the computation dtype is integral
        # torch_xla's per-op counter: how many times the op was recorded for the device
        self.counter = "xla::" + (name.split("::")[-1].split(".")[0])
        # An in-place op writing several arguments (``_amp_update_scale_``): their positions, in
        # schema order; the node's outputs are their new values, a list argument's one per tensor.
        self.mutates = mutates
        # A constant op (``zeros_like``, ``full``): its node records the storage its result
        # starts (runtime/births.py, which sets this).
        self.born = False

    def __repr__(self):
        return f"OpSpec({self.name})"


def dispatch(func, args, kwargs):
    """``__torch_dispatch__`` body: lowered shim, runtime handler, decomposition, or CPU fallback."""
    shim = SHIMS.get(func)
    if shim is not None:
        return shim(*args, **kwargs)
    handler = RUNTIME_OPS.get(func) or DECOMPS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    # A composite op (aten::to, aten::flatten) reaches dispatch when a decomposition calls
    # it: run its CompositeImplicitAutograd kernel, which calls ops we lower.
    res = func.decompose(*args, **kwargs)
    if res is not NotImplemented:
        return res
    return FALLBACK[0](func, args, kwargs)


_PLACEHOLDER = {True: float("nan")}  # what a failed .item() gives a backward pass that will raise


def defer_error(func, args, kwargs, error: Exception):
    """The outputs of an op that failed on autograd's device thread, carrying the error.

    An exception cannot leave ``__torch_dispatch__`` there (torch 2.13's Python device
    guard aborts the process while unwinding), so the outputs (shapes from the meta
    kernel) and any arguments the op writes hold a failed value instead, and the error
    is raised by the sync that reads them. An op with no tensor result to carry it
    (``.item()``) returns a placeholder and the thread that called ``backward`` raises the
    error when the backward pass returns (``runtime/modules.py``).
    """
    from torch.utils._pytree import tree_map

    from xlatorch.runtime.failure import FailedValueError, cause, failed_value

    if isinstance(error, FailedValueError):  # an input had already failed: keep that cause
        err = cause(error)
    else:
        err = RuntimeError(f"{func._schema.name} failed in a backward pass: {type(error).__name__}: {error}")
    if func is torch.ops.aten._local_scalar_dense.default:
        defer_to_owners(error if isinstance(error, FailedValueError) else err, (owner(),))
        return _PLACEHOLDER.get(args[0].dtype.is_floating_point or args[0].dtype.is_complex, 0)

    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        return "meta" if isinstance(a, torch.device) and a.type == "xla" else a

    mkwargs = tree_map(meta, kwargs)
    if isinstance(mkwargs.get("device"), (str, torch.device)):
        mkwargs["device"] = "meta"
    res = func(*tree_map(meta, args), **mkwargs)
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            dst = args[i] if i < len(args) else kwargs.get(arg.name)
            if type(dst) is XlaTensor:
                write(dst, failed_value((tuple(dst.shape), dst.dtype), err))
                written.append(dst)
    if written and isinstance(res, torch.Tensor):
        return written[0]
    return tree_map(lambda r: wrap(failed_value((tuple(r.shape), r.dtype), err)) if isinstance(r, torch.Tensor)
                    else r, res)  # fmt: skip


def _not_xla(spec, t) -> RuntimeError:
    return RuntimeError(
        f"Input tensor is not an XLA tensor: {t.type()} (aten::{spec.name} got a tensor on "
        f"'{t.device}' together with tensors on 'xla:0'; move it with .to('xla'), or the module "
        f"with module.to(xm.xla_device()))"
    )


def scalar(a) -> Scalar:
    """The leaf for a Python number: a graph parameter (never a constant, see ir.Scalar)."""
    return Scalar(a, PY_SCALAR_DTYPE[type(a)])


def _tensor_value(spec, t):
    if type(t) is XlaTensor:
        return value_of(t)
    if isinstance(t, torch.Tensor):
        if t.dim() == 0 and t.device.type == "cpu":
            return Scalar(t.item(), t.dtype, tensor=True)
        raise _not_xla(spec, t)
    if t is None:
        return None
    return scalar(t)  # a wrapped Python number


def _prepare(spec, args):
    """The converted arguments and their signature, in one pass: the per-op hot path."""
    vals = []
    sig = []
    for a, kind in zip(args, spec.kinds):
        if kind is TENSOR or kind is OPT_TENSOR:
            if type(a) is XlaTensor:
                v = a._st.value if a._vw is None else value_of(a)
                s = v.sig
            else:
                v = _tensor_value(spec, a)
                s = None if v is None else v.sig
        elif kind is STATIC:
            v = s = tuple(a) if type(a) is list else a
            if type(a) is float or type(a) is bool:
                s = _static_sig(a)
        elif kind is SCALAR:
            v = a if a is None else scalar(a)
            s = None if v is None else v.sig
        else:
            if kind is TENSOR_LIST:
                v = tuple(_tensor_value(spec, x) for x in a)
            elif kind is SCALAR_LIST:
                v = tuple(scalar(x) for x in a)
            else:  # GENERATOR
                v = next_key()
            s = _sig(v)
        vals.append(v)
        sig.append(s)
    return tuple(vals), tuple(sig)


def _sig(a):
    if isinstance(a, VALUE_TYPES):
        return a.sig
    if type(a) is tuple:
        return tuple(_sig(x) for x in a)
    if type(a) is float or type(a) is bool:
        return _static_sig(a)
    return a


def _static_sig(a):
    """A float or bool static argument's signature: ``4 == 4.0 == True`` and ``-0.0 == 0.0``,
    but ``arange(4)`` is int64 and ``arange(4.0)`` float32, ``full(s, True)`` is bool."""
    return (bool, a) if type(a) is bool else (float, a.hex())


def node(spec: OpSpec, vals: tuple) -> Node:
    """The IR node applying ``spec`` to converted arguments ``vals``."""
    return _node(spec, vals, tuple(_sig(a) for a in vals))


def _node(spec: OpSpec, vals: tuple, sig: tuple) -> Node:
    info = spec.cache.get(sig)
    if info is None:
        info = spec.cache[sig] = _infer(spec, vals)
    n = Node(spec, vals, info, (spec, sig))
    COUNTERS[spec.counter] += 1
    if info.checked:
        n.tick = (next(TICKS), owner())  # this thread's later updates are undone if it fails (runtime/checks.py)
        CHECKED_SINCE_SYNC.add(n.tick[1])
        if getattr(n, "src", None) is None:
            n.src = user_frame()  # a failed check names the user's line
    return n


def signature(vals: tuple) -> tuple:
    """Arguments' signatures: avals (and scalar kinds) of values, static arguments themselves."""
    return tuple(_sig(a) for a in vals)


def _to_meta(a):
    if type(a) is Scalar:
        return torch.empty((), dtype=a.aval[1], device="meta") if a.tensor else a.value
    if isinstance(a, VALUE_TYPES):
        return torch.empty(a.aval[0], dtype=a.aval[1], device="meta")
    if type(a) is tuple:
        return [_to_meta(x) for x in a]
    return a


def _infer(spec: OpSpec, vals: tuple) -> Info:
    meta = [_to_meta(a) for a in vals]
    args, kwargs = [], {}
    for n, m, ko, k in zip(spec.arg_names, meta, spec.kwarg_only, spec.kinds):
        if k is GENERATOR:
            continue
        if ko:
            kwargs[n] = m
        else:
            args.append(m)
    if kwargs.get("device") is not None:
        kwargs["device"] = "meta"
    res = spec.meta_overload(*args, **kwargs)
    res = [res] if isinstance(res, torch.Tensor) else list(res)
    if spec.mutates:  # the functional op's results, e.g. (Tensor[], Tensor): one flat list
        res = [x for r in res for x in (r if isinstance(r, (list, tuple)) else (r,))]
    # None: an output PyTorch leaves undefined (e.g. a gradient masked out by output_mask).
    avals = tuple(None if r is None else (tuple(r.shape), r.dtype) for r in res)
    return info_of(spec, meta, avals)


def info_of(spec: OpSpec, meta: list, avals: tuple) -> Info:
    """The node's ``Info`` from its arguments as PyTorch sees them (meta or fake tensors and
    numbers, in schema order) and its output avals: computation dtype and on-device check."""
    cdtype = None
    if spec.promote is not None:
        pargs = [meta[i] for i in spec.promote_idx if meta[i] is not None]
        cdtype, _ = elementwise_dtypes(*pargs, type_promotion_kind=spec.promote)
    checked = spec.check is not None and checks.ENABLED
    if checked and spec.check_integral:
        dt = cdtype or next(a[1] for a in avals if a is not None)
        checked = not (dt.is_floating_point or dt.is_complex)
    return Info(avals, cdtype, checked)


def _outputs(spec, n: Node):
    if spec.returns is ONE:
        return wrap(n.outs[0])
    res = [None if o is None else wrap(o) for o in n.outs]
    return res if spec.returns is LIST else tuple(res)


def call(spec: OpSpec, args: tuple):
    """A functional op: one new node, new tensors for its outputs (views alias their base)."""
    n = _node(spec, *_prepare(spec, args))
    if spec.view:
        base = args[0]
        rest = n.args[1:]
        outs = [_view_of(base, (spec, rest, i), o) for i, o in enumerate(n.outs)]
        if spec.returns is ONE:
            return outs[0]
        return outs if spec.returns is LIST else tuple(outs)
    out = _outputs(spec, n)
    if spec.born and _in_backward() == -1:  # gradients are made anew every step: never births
        n.born = _weakref(out._st)
    return out


def _view_of(base: XlaTensor, step, value) -> XlaTensor:
    chain = (base._vw or ()) + (step,)
    return wrap(value, base._st, chain)


def call_inplace(spec: OpSpec, args: tuple):
    """An in-place op: the lowering's result (cast to ``self``'s dtype) becomes ``self``'s value."""
    self = args[0]
    if spec.mutates:
        return _call_mutating(spec, args)
    if spec.kinds[0] is TENSOR_LIST:  # _foreach_*_: one result per tensor of the list
        n = _node(spec, *_prepare(spec, args))
        for t, v in zip(self, n.outs):
            write(t, v if v.aval[1] == t.dtype else convert_value(v, t.dtype))
        return None
    if type(self) is not XlaTensor:
        raise _not_xla(spec, self)
    n = _node(spec, *_prepare(spec, args))
    write(self, n.outs[0])
    return self


def _call_mutating(spec: OpSpec, args: tuple):
    """An in-place op writing several arguments: each gets its part of the node's outputs."""
    targets = []
    for i in spec.mutates:
        a = args[i]
        targets += list(a) if spec.kinds[i] is TENSOR_LIST else [a]
    for t in targets:
        if type(t) is not XlaTensor:
            raise _not_xla(spec, t)
    n = _node(spec, *_prepare(spec, args))
    for t, v in zip(targets, n.outs, strict=True):
        write(t, v if v.aval[1] == t.dtype else convert_value(v, t.dtype))
    return args[0] if spec.returns is ONE else None


def call_out(spec: OpSpec, args: tuple, outs: tuple, returns: bool = True):
    """An ``out=`` op: compute functionally, then write each result into its ``out`` tensor.

    ``returns=False`` for the out= overloads that take a list of tensors and return nothing
    (``unbind_copy.int_out``, ``split_copy.Tensor_out``).
    """
    n = _node(spec, *_prepare(spec, args))
    for t, v in zip(outs, n.outs):
        if type(t) is not XlaTensor:
            raise _not_xla(spec, t)
        if t.dtype != v.aval[1]:
            v = convert_value(v, t.dtype)
        if tuple(t.shape) != v.aval[0]:
            t.data = wrap(v)  # out= resizes, as in PyTorch
        else:
            write(t, v)
    if not returns:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)


def replay_on_cpu(step, cpu: torch.Tensor) -> torch.Tensor:
    """Apply one view step to a CPU tensor with PyTorch's own op."""
    spec, rest, idx = step
    args, kwargs = [cpu], {}
    for name, a, ko in zip(spec.arg_names[1:], rest, spec.kwarg_only[1:]):
        a = getattr(a, "value", a)  # a Scalar leaf
        if ko:
            kwargs[name] = a
        else:
            args.append(a)
    res = spec.overload(*args, **kwargs)
    return res if idx == 0 and isinstance(res, torch.Tensor) else res[idx]


def apply_view(step, base):
    """Replay one view step on a base value."""
    spec, rest, idx = step
    return node(spec, (base,) + rest).outs[idx]


def apply_scatter(step, base, src):
    """The new base after writing ``src`` through one view step."""
    spec, rest, idx = step
    if spec.scatter is None:
        if spec.name == "expand.default":
            if src.aval[0] == base.aval[0]:
                return src  # an expand that broadcasts nothing
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers to a single "
                "memory location. Please clone() the tensor before performing the operation."
            )
        raise NotImplementedError(
            f"xlatorch: in-place update of a view made by aten::{spec.name} is not supported yet; "
            f"apply the op to a .clone() instead"
        )
    return node(spec.scatter, (base, src) + rest + (idx,)).outs[0]


def convert_value(v, dtype: torch.dtype):
    """A value cast to ``dtype`` (the ``_to_copy`` lowering)."""
    from xlatorch.runtime.device import SPECS

    return node(SPECS["_to_copy.default"], (v, dtype, None, None, None, False, None)).outs[0]


def count(name: str) -> None:
    COUNTERS[name] += 1


_tensor_module.DISPATCH = dispatch
