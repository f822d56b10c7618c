"""From an ATen call to an IR node: argument conversion and the op's variants.

The generated table (``generated/dispatch.py``) maps each lowered ``OpOverload`` to a
shim whose Python signature mirrors the ATen schema; the shim calls ``call`` (or
``call_inplace`` / ``call_out``) with the arguments in schema order; ``nodes.py`` makes the
node (output avals and computation dtype from PyTorch's meta kernels, once per signature).
"""

from __future__ import annotations

import os
from weakref import ref as _weakref

import torch

from xlatorch.runtime.base.dtypes import PY_SCALAR_DTYPE
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.threads import TICKS, _get_ident, _in_backward, owner
from xlatorch.runtime.ir import values as _ir
from xlatorch.runtime.ir.ops import (
    GENERATOR,
    HOST_SCALARS,
    LIST,
    ONE,
    OPT_TENSOR,
    SCALAR,
    SCALAR_LIST,
    STATIC,
    TENSOR,
    TENSOR_LIST,
    OpSpec,
    _sig,
    _static_sig,
)
from xlatorch.runtime.ir.rng import next_key
from xlatorch.runtime.ir.values import Node, Out, Scalar
from xlatorch.runtime.trace import strides
from xlatorch.runtime.trace import tensor as _tensor_module
from xlatorch.runtime.trace.nodes import (
    _node,
    check_cast,
    check_refused,
    convert_value,
    error_on_cpu,
    first_dtype,
    scalar,
)
from xlatorch.runtime.trace.strides import geometry
from xlatorch.runtime.trace.tensor import Storage, XlaTensor, value_of, wrap, write

__all__ = [
    "dispatch", "call", "call_inplace", "decomposition", "SHIMS", "RUNTIME_OPS", "DECOMPS", "FALLBACK",
]  # fmt: skip

SHIMS: dict = {}  # OpOverload -> shim, filled by generated/dispatch.py
RUNTIME_OPS: dict = {}  # OpOverload -> hand-written handler (copies, transfers, aliases)
DECOMPS: dict = {}  # OpOverload -> PyTorch decomposition into ops that are lowered


def decomposition(op, checks=(None, None)):
    """PyTorch's decomposition of ``op`` (ops.yaml ``decompose``), run after CPU's checks that the
    ops it decomposes into do not make: ``(validate, refuse_dtypes)`` of its ops.yaml entry. An
    error it raises is CPU's where CPU's kernel raises one for these arguments (``error_on_cpu``)."""
    decomp = torch._decomp.decomposition_table[op]
    validate, refused = checks

    def run(*args, **kwargs):
        if validate is not None:
            validate(*args, **kwargs)
        if refused is not None:
            check_refused(refused, first_dtype(args), args, ())  # its results are not known: every rule applies
        try:
            return decomp(*args, **kwargs)
        except Exception:  # the decomposition's checks, in PyTorch's reference's words: CPU's instead
            cpu_error = error_on_cpu(op, *args, **kwargs)
            if cpu_error is not None:
                raise cpu_error from None
            raise

    return run


def _no_fallback(func, args, kwargs):
    raise NotImplementedError(f"xlatorch: aten::{func._schema.name} has no lowering and no CPU fallback is installed")


# Ops with no lowering: xlatorch.fallback installs its CPU fallback here when imported (it
# sits above the runtime and calls down into it).
FALLBACK = [_no_fallback]


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


def _not_xla(spec, t) -> RuntimeError:
    if t.device.type == "xla":  # on the device, yet no device data: a tracer's tensor
        kind = type(t).__name__
        return RuntimeError(
            f"xlatorch: aten::{spec.name} got a {kind} (a tensor of a trace: torch.compile, torch.export, "
            f"make_fx) together with real xla tensors, which hold device data; both say '{t.device}'. "
            f"A real tensor cannot enter a trace's ops: it was made outside the traced function (a global, "
            f"a tensor kept from an earlier call) or by a factory the trace did not see; pass it as an "
            f"argument, or create it inside the function"
        )
    return RuntimeError(
        f"Input tensor is not an XLA tensor: {t.type()} (aten::{spec.name} got a tensor on "
        f"'{t.device}' together with tensors on 'xla:0'; move it with .to('xla'), or the module "
        f"with module.to(xm.xla_device()))"
    )


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


def _host_scalars(spec, t) -> tuple:
    """A ``host_scalars`` argument (foreach's ``scalars``): the values of a 1-d CPU tensor, one
    traced scalar each, so new values never recompile. PyTorch's own kernels read it on the
    host too, and reject what they reject here."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        got = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(f"Expected scalars to be on CPU, got {got} instead. (aten::{spec.name})")
    if t.dim() != 1:
        raise RuntimeError(f"Expected packed scalar Tensor to be of dimension 1. Got {t.dim()} instead.")
    dtype = t.dtype
    return tuple(Scalar(x, dtype) for x in t.tolist())


def _prepare(spec, args):
    """The converted arguments and their signature, in one pass: the per-op hot path.

    Each tuple of argument kinds gets its own straight-line converter (``_converter``), made
    once; it does exactly what the loop of ``_convert`` does, without the loop."""
    conv = spec.prepare
    if conv is None:
        key = (tuple(spec.kinds), _defaults(spec))
        conv = spec.prepare = _CONVERTERS.get(key) or _converter(*key)
        _fuse(spec)
    if len(args) == len(spec.kinds):
        return conv(spec, args)
    return _convert(spec, args)


_DEFAULTS: dict = {}  # OpSpec -> _defaults(spec)


def _defaults(spec) -> tuple:
    """Per argument: the schema's default of a Scalar argument that has a number for one
    (``alpha=1``, ``beta=1``, ``negative_slope=0.01``), else None. An argument that equals it
    enters the graph as a constant, not as a parameter: such defaults never change from step
    to step, and XLA drops a multiplication by a constant 1 (addmm's ``beta * self + alpha *
    m1 @ m2``). Any other value is a parameter, as every scalar is: at most one more graph."""
    d = _DEFAULTS.get(spec)
    if d is None:
        d = []
        for kind, arg in zip(spec.kinds, _schema_args(spec)):
            v = getattr(arg, "default_value", None) if kind is SCALAR else None
            d.append(v if type(v) is int or type(v) is float else None)
        d = _DEFAULTS[spec] = tuple(d)
    return d


def _schema_args(spec) -> list:
    """The schema's arguments in ``spec.arg_names``' order (None where one is not found)."""
    overload = spec.overload
    schema = getattr(overload, "_schema", None)
    by_name = {a.name: a for a in schema.arguments} if schema is not None else {}
    return [by_name.get(n) for n in spec.arg_names]


def _convert(spec, args):
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
            d = _defaults(spec)[len(vals)]
            if a is None:
                v = s = None
            elif d is not None and type(a) is type(d) and a == d:  # the schema's default: a constant
                v, s = a, _sig(a)
            else:
                v = scalar(a)
                s = v.sig
        else:
            if kind is TENSOR_LIST:
                v = tuple(_tensor_value(spec, x) for x in a)
            elif kind is SCALAR_LIST:
                v = tuple(scalar(x) for x in a)
            elif kind is HOST_SCALARS:
                v = _host_scalars(spec, a)
            else:  # GENERATOR
                v = next_key()
            s = _sig(v)
        vals.append(v)
        sig.append(s)
    return tuple(vals), tuple(sig)


# Per argument kind: the lines converting argument ``a{i}`` to value ``v{i}`` and signature ``s{i}``
# (the branches of ``_convert``).
_LINES = {
    TENSOR: (
        "if type(a{i}) is XlaTensor and a{i}._vw is None:",
        "    v{i} = a{i}._st.value",
        "    s{i} = v{i}.sig",
        "else:",
        "    v{i} = _tensor_value(spec, a{i})",
        "    s{i} = None if v{i} is None else v{i}.sig",
    ),
    STATIC: (
        "t{i} = type(a{i})",
        "v{i} = s{i} = tuple(a{i}) if t{i} is list else a{i}",
        "if t{i} is float or t{i} is bool:",
        "    s{i} = _static_sig(a{i})",
    ),
    SCALAR: (
        "if a{i} is None:",
        "    v{i} = s{i} = None",
        "else:",
        "    v{i} = Scalar(a{i}, PY_SCALAR_DTYPE[type(a{i})])",  # nodes.scalar, inline
        "    s{i} = v{i}.sig",
    ),
    TENSOR_LIST: (  # a foreach op's lists: each tensor as TENSOR's fast case, else _tensor_value
        "v{i} = tuple([x._st.value if type(x) is XlaTensor and x._vw is None else _tensor_value(spec, x)"
        " for x in a{i}])",
        "s{i} = tuple([None if x is None else x.sig for x in v{i}])",  # _sig of each: values or None
    ),
    # A Scalar argument with a number default (``_defaults``): D{i}, of type T{i}
    "default": (
        "if a{i} is None:",
        "    v{i} = s{i} = None",
        "elif type(a{i}) is T{i} and a{i} == D{i}:",
        "    v{i} = a{i}",
        "    s{i} = _static_sig(a{i}) if T{i} is float else a{i}",
        "else:",
        "    v{i} = Scalar(a{i}, PY_SCALAR_DTYPE[type(a{i})])",
        "    s{i} = v{i}.sig",
    ),
    SCALAR_LIST: ("v{i} = tuple(scalar(x) for x in a{i})", "s{i} = _sig(v{i})"),
    GENERATOR: ("v{i} = next_key()", "s{i} = _sig(v{i})"),
    HOST_SCALARS: ("v{i} = _host_scalars(spec, a{i})", "s{i} = _sig(v{i})"),
}
_LINES[OPT_TENSOR] = _LINES[TENSOR]
_CONVERTERS: dict = {}  # (kinds, Scalar defaults) -> converter


def _made_here(what: str) -> str:
    """The file name of code made at run time here: inside xlatorch's folder, so that Dynamo
    never traces it (a training step under ``torch.compile`` broke its graph in a fused shim,
    file ``<string>``) and the user's line is never one of its lines."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"<{what}>")


def _converter(kinds: tuple, defaults: tuple):
    """A function ``(spec, args) -> (vals, sig)`` for arguments of ``kinds`` (with the Scalar
    defaults ``defaults``, ``_defaults``), as ``_convert``."""
    n = len(kinds)
    names = ", ".join(f"a{i}" for i in range(n))
    lines = ["def convert(spec, args):"] + ([f"    {names}{',' if n == 1 else ''} = args"] if n else [])
    scope = {"XlaTensor": XlaTensor, "_tensor_value": _tensor_value, "_static_sig": _static_sig, "scalar": scalar,
             "_sig": _sig, "next_key": next_key, "Scalar": Scalar, "PY_SCALAR_DTYPE": PY_SCALAR_DTYPE,
             "_host_scalars": _host_scalars}  # fmt: skip
    lines += _arg_lines(kinds, defaults, scope)
    vs = "".join(f"v{i}, " for i in range(n))
    ss = "".join(f"s{i}, " for i in range(n))
    lines.append(f"    return ({vs}), ({ss})")
    exec(compile("\n".join(lines), _made_here("converter"), "exec"), scope)  # noqa: S102 - from the fixed _LINES
    conv = _CONVERTERS[(kinds, defaults)] = scope["convert"]
    return conv


def _arg_lines(kinds, defaults, scope) -> list:
    """The lines converting each argument ``a{i}`` (``_LINES``); a default's value and type go
    into ``scope`` as ``D{i}`` and ``T{i}``."""
    lines = []
    for i, (k, d) in enumerate(zip(kinds, defaults)):
        if d is not None:
            scope[f"D{i}"], scope[f"T{i}"] = d, type(d)
            k = "default"
        lines += ["    " + line.format(i=i) for line in _LINES[k]]
    return lines


# The names a fused shim's code uses besides its parameters (``_fuse``).
_FUSED_NAMES = frozenset(
    "XlaTensor _tensor_value _static_sig scalar _sig next_key Scalar PY_SCALAR_DTYPE spec cache counter _node Node "
    "COUNTERS _in_backward _weakref _new DEVICE Storage _reads _host_scalars info n out vals sig st t r "
    "CACHED_VIEWS IR Out _alloc _get_ident _owner TICKS PENDING bw sid vstep geo _geometry _GEOMETRY lay "
    "_result_layout STORAGE_LAYOUT".split()
)


def _fuse(spec: OpSpec) -> None:
    """Replace the generated shim of a functional op with one function doing what the shim,
    ``call``, the argument converter, ``_node`` and ``wrap`` (or ``_view_of``) do, in one frame:
    the per-op path.

    Only for a shim that is exactly ``return call(S, (its parameters in schema order))``, of
    an op that returns one tensor. The first node of a signature, and a checked one, still go
    through ``_node``; births are asked at each call (they change)."""
    shim = SHIMS.get(spec.overload)
    code = getattr(shim, "__code__", None)
    if code is None or spec.returns is not ONE or spec.mutates or code.co_flags & 0x0C:
        return  # not a plain function, or *args / **kwargs
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    plain = code.co_varnames == params == tuple(spec.arg_names) and code.co_names[:1] == ("call",)
    if not plain or len(code.co_names) != 2 or shim.__globals__.get(code.co_names[1]) is not spec:
        return
    if _FUSED_NAMES.intersection(params) or any(p[:1] in "avstDT" and p[1:].isdigit() for p in params):
        return  # a parameter would shadow a name of the fused code
    n = len(params)
    pos = ", ".join(params[: code.co_argcount])
    kw = ", ".join(params[code.co_argcount :])
    head = pos + (", *, " + kw if kw else "")
    lines = [f"def fused({head}):"]
    lines += [f"    a{i} = {p}" for i, p in enumerate(params)]
    scope = {}
    lines += _arg_lines(spec.kinds, _defaults(spec), scope)
    vs = "".join(f"v{i}, " for i in range(n))
    ss = "".join(f"s{i}, " for i in range(n))
    lines += [
        f"    vals = ({vs})",
        f"    sig = ({ss})",
        "    info = cache.get(sig)",
        "    if info is None or not info.fast or IR._multi or IR.DEBUG_SOURCE:",
        "        n = _node(spec, vals, sig)",
        "        out = n.outs[0]",
        "    else:",  # Node(spec, vals, info, info.key) and its Out, inline (ir/values.py)
        "        n = _alloc(Node)",
        "        n.spec, n.args, n.info, n.key, n.dev = spec, vals, info, info.key, 0",
        "        out = _alloc(Out)",
        "        out.node, out.idx, out.aval, out.sig = n, 0, info.one, info.one",
        "        n.outs = (out,)",
        "        COUNTERS[counter] += 1",
    ]
    if spec.view:  # _view_of(a0, (spec, rest, 0), out, n.info), inline
        lines += [
            "    vstep = (spec, n.args[1:], 0)",
            "    geo = _GEOMETRY.get((n.info, a0._geo, 0), _geometry)",  # strides.geometry's lookup, inline
            "    if geo is _geometry:",
            "        geo = _geometry(n.info, vstep, a0)",
            "    if geo is None:",
            "        t = _new(XlaTensor, out.aval[0], dtype=out.aval[1], device=DEVICE)",
            "    else:",
            "        t = _new(XlaTensor, out.aval[0], geo[0], geo[1], dtype=out.aval[1], device=DEVICE)",
            "        t._geo = geo",
            "    COUNTERS['CreateXlaTensor'] += 1",
            "    t._st = st = a0._st",
            "    t._vw, t._vc = (a0._vw or ()) + (vstep,), (st.gen, out)",
            "    r = _weakref(t)",
            "    CACHED_VIEWS.append(r)",
            "    if len(st.refs) >= 16:",
            "        st.refs = [r for r in st.refs if _reads(r(), st)]",
            "    st.refs.append(r)",
            "    return t",
        ]
    else:  # wrap(out, geo=...), inline, with Storage(out, _weakref(t)) (trace/tensor.py)
        laid = " or ".join(
            f"(type(a{i}) is XlaTensor and a{i}._geo is not None)"
            for i, k in enumerate(spec.kinds)
            if k is TENSOR or k is OPT_TENSOR
        )
        a_s = "".join(f"a{i}, " for i in range(n))
        lines += [
            f"    lay = _result_layout(spec, n.info, ({a_s})) if {laid or 'False'} else None",
            "    if lay is None:",
            "        t = _new(XlaTensor, out.aval[0], dtype=out.aval[1], device=DEVICE)",
            "    else:",
            "        t = _new(XlaTensor, out.aval[0], lay[0], 0, dtype=out.aval[1], device=DEVICE)",
            "        t._geo = lay",
            "    COUNTERS['CreateXlaTensor'] += 1",
            "    t._st = st = _alloc(Storage)",
            "    st.refs = [_weakref(t)]",
            "    bw = _in_backward()",
            "    st.owner = _get_ident() if bw == -1 else _owner()",
            "    st.gen = st.sid = sid = next(TICKS)",
            "    st.prev, st.first, st.sharding, st.dev, st.value = None, 0, None, n.dev, out",
            "    PENDING[sid] = _weakref(st)",
            "    if lay is not None:",
            "        STORAGE_LAYOUT[st] = lay[0]",
            "    if bw == -1 and spec.born:",  # as call(): births
            "        n.born = _weakref(st)",
            "    return t",
        ]
    scope |= {"XlaTensor": XlaTensor, "_tensor_value": _tensor_value, "_static_sig": _static_sig, "scalar": scalar,
             "_sig": _sig, "next_key": next_key, "Scalar": Scalar, "PY_SCALAR_DTYPE": PY_SCALAR_DTYPE, "spec": spec,
             "cache": spec.cache, "counter": spec.counter, "_node": _node, "Node": Node, "COUNTERS": COUNTERS,
             "_in_backward": _in_backward, "_weakref": _weakref, "_new": torch.Tensor._make_wrapper_subclass,
             "DEVICE": _tensor_module.DEVICE, "Storage": Storage, "_reads": _tensor_module._reads,
             "_host_scalars": _host_scalars, "CACHED_VIEWS": _tensor_module.CACHED_VIEWS, "IR": _ir, "Out": Out,
             "_alloc": object.__new__, "_get_ident": _get_ident, "_owner": owner, "TICKS": TICKS,
             "PENDING": _tensor_module.PENDING, "_geometry": geometry, "_GEOMETRY": strides.GEOMETRY,
             "_result_layout": strides.result_layout, "STORAGE_LAYOUT": strides.STORAGE_LAYOUT}  # fmt: skip
    # noqa below: source built above from the fixed _LINES and the shim's parameters
    exec(compile("\n".join(lines), _made_here(f"fused {spec.name}"), "exec"), scope)  # noqa: S102
    fused = scope["fused"]
    fused.__defaults__, fused.__kwdefaults__ = shim.__defaults__, shim.__kwdefaults__
    fused.__name__ = fused.__qualname__ = shim.__name__
    fused.__wrapped__ = shim
    SHIMS[spec.overload] = fused


def _outputs(spec, n: Node):
    if spec.returns is ONE:
        return wrap(n.outs[0])
    res = [None if o is None else wrap(o) for o in n.outs]
    return res if spec.returns is LIST else tuple(res)


def call(spec: OpSpec, args: tuple):
    """A functional op: one new node, new tensors for its outputs (views alias their base)."""
    conv = spec.prepare  # _prepare, inline: the per-op path
    vals, sig = conv(spec, args) if conv is not None and len(args) == len(spec.kinds) else _prepare(spec, args)
    n = _node(spec, vals, sig)
    if spec.view:
        base = args[0]
        rest = n.args[1:]
        outs = [_view_of(base, (spec, rest, i), o, n.info) for i, o in enumerate(n.outs)]
        if spec.returns is ONE:
            return outs[0]
        return outs if spec.returns is LIST else tuple(outs)
    if spec.returns is ONE:
        laid = False
        for a in args:  # an input laid out otherwise than contiguous: the result as CPU lays it out
            if type(a) is XlaTensor and a._geo is not None:
                laid = True
                break
        out = wrap(n.outs[0], geo=strides.result_layout(spec, n.info, args) if laid else None)
    else:
        out = _outputs(spec, n)
    if spec.born and _in_backward() == -1:  # gradients are made anew every step: never births
        n.born = _weakref(out._st)
    return out


def _view_of(base: XlaTensor, step, value, info) -> XlaTensor:
    chain = (base._vw or ()) + (step,)
    geo = strides.GEOMETRY.get((info, base._geo, step[2]), geometry)  # strides.geometry's lookup, inline
    if geo is geometry:
        geo = geometry(info, step, base)
    return wrap(value, base._st, chain, geo)


def call_inplace(spec: OpSpec, args: tuple):
    """An in-place op: the lowering's result (cast to ``self``'s dtype) becomes ``self``'s value."""
    self = args[0]
    if spec.mutates:
        return _call_mutating(spec, args)
    if spec.kinds[0] is TENSOR_LIST:  # _foreach_*_: one result per tensor of the list
        n = _node(spec, *_prepare(spec, args))
        _safe_cast([v.aval[1] for v in n.outs], self)  # the functional op's results (its meta_overload)
        for t, v in zip(self, n.outs):
            write(t, v if v.aval[1] == t.dtype else convert_value(v, t.dtype))
        return None
    if type(self) is not XlaTensor:
        raise _not_xla(spec, self)
    if spec.promote is not None:  # an elementwise op (TensorIterator on CPU) reading what it writes
        for a in args:
            if type(a) is XlaTensor and a._st is self._st and strides.overlap(self, a) == strides.PARTIAL:
                raise RuntimeError(strides.PARTIAL_OVERLAP)
    n = _node(spec, *_prepare(spec, args))  # its shape and dtype are checked with its signature (nodes.py)
    write(self, n.outs[0])
    return self


def _safe_cast(rtypes, targets) -> None:
    """CPU's rule for a foreach in-place op: the type of each result (``rtypes``) casts safely
    to the tensor it writes (as ``nodes._check_in_place`` for one tensor)."""
    for rtype, t in zip(rtypes, targets):
        check_cast(rtype, t.dtype)


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


def count(name: str) -> None:
    COUNTERS[name] += 1


_tensor_module.DISPATCH = _tensor_module.LAZY = dispatch
_tensor_module.SHIMS = SHIMS
