"""From converted arguments to an IR node: output avals and computation dtype from PyTorch's
own meta kernels (once per signature, then ``OpSpec.cache``), and the view steps a tensor
replays on its base (``apply_view``), writes through (``apply_scatter``) or runs on CPU.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from xlatorch.runtime.base import config
from xlatorch.runtime.base.dtypes import PY_SCALAR_DTYPE, to_jax
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.source import user_frame
from xlatorch.runtime.base.threads import CHECKED_SINCE_SYNC, TICKS, owner
from xlatorch.runtime.ir.ops import GENERATOR, HOST_SCALARS, SPECS, Info, OpSpec, _sig
from xlatorch.runtime.ir.values import VALUE_TYPES, Node, Scalar

__all__ = [
    "node",
    "scalar",
    "info_of",
    "call_meta",
    "apply_view",
    "apply_scatter",
    "error_on_cpu",
    "convert_value",
    "replay_on_cpu",
    "run_node_on_cpu",
]


def scalar(a) -> Scalar:
    """The leaf for a Python number: a graph parameter (never a constant, see ir.Scalar)."""
    return Scalar(a, PY_SCALAR_DTYPE[type(a)])


def node(spec: OpSpec, vals: tuple) -> Node:
    """The IR node applying ``spec`` to converted arguments ``vals``."""
    return _node(spec, vals, tuple(_sig(a) for a in vals))


def _node(spec: OpSpec, vals: tuple, sig: tuple) -> Node:
    # Its path for a cached, unchecked signature is inlined in the fused shims (dispatch._fuse).
    info = spec.cache.get(sig)
    if info is None:
        info = spec.cache[sig] = _infer(spec, vals)
    key = info.key
    if key is None:  # equal signatures share the Info, so its nodes share one key tuple
        key = info.key = (spec, sig)
        # An unchecked node with one output, not large: a fused shim makes the next ones inline
        info.fast = not info.checked and not info.big and info.one is not None
    n = Node(spec, vals, info, key)
    COUNTERS[spec.counter] += 1
    if info.checked:
        n.tick = (next(TICKS), owner())  # this thread's later updates are undone if it fails (runtime/lower/checks.py)
        CHECKED_SINCE_SYNC.add(n.tick[1])
        if getattr(n, "src", None) is None:
            n.src = user_frame() or _frame()  # a failed check names the user's line
    return n


def _frame() -> tuple:
    """Where the op was called from when no frame is the user's file: the innermost code with
    no file (``python -c``, stdin, ``exec``, a notebook cell), else the outermost frame."""
    f = sys._getframe(2)
    while True:
        fn = f.f_code.co_filename
        if fn.startswith("<") and not fn.startswith("<frozen"):
            return fn, f.f_lineno
        if f.f_back is None:
            return fn, f.f_lineno
        f = f.f_back


def _to_meta(a):
    if type(a) is Scalar:
        return torch.empty((), dtype=a.aval[1], device="meta") if a.tensor else a.value
    if isinstance(a, VALUE_TYPES):
        return torch.empty(a.aval[0], dtype=a.aval[1], device="meta")
    if type(a) is tuple:
        return [_to_meta(x) for x in a]
    return a


def _host_tensor(a: tuple) -> torch.Tensor:
    """A ``HOST_SCALARS`` argument's traced scalars as the CPU tensor PyTorch takes."""
    return torch.tensor([s.value for s in a], dtype=a[0].aval[1] if a else torch.float64)


def meta_args(spec: OpSpec, vals: tuple) -> list:
    """A node's converted arguments as PyTorch's meta kernels take them, in schema order."""
    return [_host_tensor(a) if k is HOST_SCALARS else _to_meta(a) for a, k in zip(vals, spec.kinds)]


def _infer(spec: OpSpec, vals: tuple) -> Info:
    meta = meta_args(spec, vals)
    if spec.index_dtype is not None:
        _check_index_dtype(spec.index_dtype, meta)
    if spec.validate is not None:
        spec.validate(*meta)
    refused = spec.refuse_dtypes
    try:
        res = call_meta(spec, spec.meta_overload, meta)
    except Exception:
        # A meta kernel may refuse the dtype in words of its own (replication_pad1d's
        # RuntimeError "... for 'torch.bool'"): CPU's error, where a rule says it.
        kernel = None if refused is None else _kernel_dtype(spec, meta)
        if kernel is not None:
            check_refused(refused, kernel, meta)
        # A 0-d CPU tensor argument (masked_fill's value) with its value: CPU's checks read it.
        args = [torch.tensor(a.value, dtype=a.aval[1]) if type(a) is Scalar and a.tensor else m
                for a, m in zip(vals, meta)]  # fmt: skip
        cpu_error = call_meta(spec, functools.partial(error_on_cpu, spec.meta_overload), args)
        if cpu_error is not None:
            raise cpu_error from None
        raise
    res = [res] if isinstance(res, torch.Tensor) else list(res)
    if spec.meta_overload is spec.overload and isinstance(vals[0], VALUE_TYPES) and _in_place(spec.overload):
        _check_in_place(spec, vals)
    if spec.mutates:  # the functional op's results, e.g. (Tensor[], Tensor): one flat list
        res = [x for r in res for x in (r if isinstance(r, (list, tuple)) else (r,))]
    # None: an output PyTorch leaves undefined (e.g. a gradient masked out by output_mask).
    avals = tuple(None if r is None else (tuple(r.shape), r.dtype) for r in res)
    if refused is not None:  # an op taking ``dtype`` runs its kernel in the result's
        check_refused(refused, _kernel_dtype(spec, meta) or avals[0][1], meta, avals)
    return info_of(spec, meta, avals)


def _kernel_dtype(spec: OpSpec, meta: list) -> torch.dtype | None:
    """The dtype CPU's kernel runs in: the result's for an op taking a ``dtype``, its tensors'
    promoted dtype for an elementwise op (not the computation dtype xlatorch's lowering may widen
    to: ``celu`` of integers, ``float16`` math in float32), else its first tensor's; None: the
    result's."""
    if "dtype" in spec.arg_names:  # the result's (cumsum of bools gives int64)
        return None
    if spec.promote is None:
        return first_dtype(meta)
    tensors = [meta[i] for i in spec.promote_idx if isinstance(meta[i], torch.Tensor)]
    if not tensors:
        return None
    return elementwise_dtypes(*tensors, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


def first_dtype(args) -> torch.dtype | None:
    """The dtype of the first tensor among ``args`` (a list argument's first), None if none."""
    t = _first_tensor(args)
    return None if t is None else t.dtype


def _first_tensor(args) -> torch.Tensor | None:
    for a in args:
        a = a[0] if type(a) in (list, tuple) and a else a
        if isinstance(a, torch.Tensor):
            return a
    return None


def check_refused(rules, dtype: torch.dtype, args=(), avals=None) -> None:
    """Raise CPU's error when the op computes in a dtype its CPU kernel has no implementation for
    (ops.yaml ``refuse_dtypes``: ``abs`` of a bool tensor, ``softmax`` of an integer one).

    Where CPU runs no kernel it takes any dtype: a rule with ``empty_ok`` is not applied when
    a result (``avals``) has no elements (``softmax`` of an empty int tensor, ``linspace`` of
    0 steps), one with ``scalar_ok`` when the first tensor among ``args`` is 0-d (``kthvalue``
    / ``mode`` / ``cummax`` of a 0-d tensor: CPU returns it). ``avals`` None: the results are
    not known yet, and ``empty_ok`` rules wait for them (``()``: none known, every rule applies)."""
    for dtypes, exc, msg, scalar_ok, empty_ok in rules:
        if dtype not in dtypes:
            continue
        if empty_ok and (avals is None or any(a is not None and type(a) is tuple and 0 in a[0] for a in avals)):
            continue
        if scalar_ok:
            first = _first_tensor(args)
            if first is not None and first.dim() == 0:
                continue
        raise exc(msg.format(**_dtype_names(dtype)))


def _in_place(op) -> bool:
    """Whether ``op`` writes its first argument (``add_``), and only that."""
    args = op._schema.arguments
    return bool(args) and args[0].is_write and not any(a.is_write for a in args[1:])


@functools.cache
def _functional(op):
    """The functional twin of in-place ``op``, taking the same arguments (``aten.add.Tensor`` for
    ``aten.add_.Tensor``, ``aten.pow.Tensor_Tensor`` for ``aten.pow_.Tensor``); None if there
    is none, or if it is a view op (``squeeze_``'s twin: the in-place op changes the shape)."""
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1].rstrip("_"), None)
    if packet is None:
        return None
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in packet.overloads():
        twin = getattr(packet, name)
        s = twin._schema
        if [(a.name, str(a.type)) for a in s.arguments] == want and not s.is_mutable:
            return None if any(r.alias_info is not None for r in s.returns) else twin
    return None


def _check_in_place(spec: OpSpec, vals: tuple) -> None:
    """CPU's rules for an in-place op, which PyTorch's meta kernels skip for some ops: the
    result keeps ``self``'s shape (``a.eq_(b)`` with ``a`` of [5, 1] and ``b`` of [5, 5] wrote
    a [5, 5] value into ``a``) and its type casts safely to ``self``'s dtype (TensorIterator's
    check: not a float into an integer tensor, a complex into a real one, a number into a bool
    one; ``int32.mul_(float32)`` wrote truncated values). Judged by the functional twin's meta
    kernel, once per signature."""
    shape, dtype = vals[0].aval
    twin = _functional(spec.overload)
    if twin is None:
        return
    try:
        want = call_meta(spec, twin, meta_args(spec, vals))
    except Exception:  # noqa: BLE001 - the twin's own rules are not the in-place op's: judged by the meta above
        return
    if not isinstance(want, torch.Tensor):
        return
    if tuple(want.shape) != shape:
        raise RuntimeError(f"output with shape {list(shape)} doesn't match the broadcast shape {list(want.shape)}")
    check_cast(want.dtype, dtype)


def check_cast(rtype: torch.dtype, dtype: torch.dtype) -> None:
    """TensorIterator's rule for writing a result of type ``rtype`` into a tensor of ``dtype``,
    with CPU's message: not a float into an integer tensor, a complex into a real one, a number
    into a bool one."""
    if rtype is not dtype and not torch.can_cast(rtype, dtype):
        raise RuntimeError(
            f"result type {dtype_name(rtype)} can't be cast to the desired output type {dtype_name(dtype)}"
        )


# Arguments CPU's kernel is run on to find its error (error_on_cpu): at most this many elements.
_CPU_ERROR_ELEMENTS = 1 << 22


def error_on_cpu(op, *args, **kwargs) -> Exception | None:
    """The exception CPU raises for a call PyTorch's meta kernel (or decomposition) refused, or
    None: ``op`` called on CPU with ``args`` / ``kwargs``, every tensor not on CPU (meta, xla)
    replaced by zeros of its shape and dtype.

    Meta kernels check what CPU's kernels check, in words (and exception types) of their own:
    ``amax`` over an empty dimension is an IndexError naming ``amax()`` on CPU, a RuntimeError
    of PyTorch's reference on meta. So, only once the meta kernel has raised, CPU's kernel runs
    on zeros, and what it raises is what the user gets: CPU's error, at the call. Not for
    arguments over ``_CPU_ERROR_ELEMENTS`` elements (the meta kernel's error stands), nor where
    CPU takes the zeros. CPU's random generator is left as it was."""
    if kwargs.get("device") is not None:
        kwargs["device"] = "cpu"
    flat = [t for a in (*args, *kwargs.values()) for t in (a if type(a) in (list, tuple) else (a,))]
    if sum(t.numel() for t in flat if isinstance(t, torch.Tensor)) > _CPU_ERROR_ELEMENTS:
        return None

    def on_cpu(a):
        if type(a) in (list, tuple):
            return [on_cpu(x) for x in a]
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            return torch.zeros(a.shape, dtype=a.dtype, device="cpu")
        return a

    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        try:
            op(*[on_cpu(a) for a in args], **{k: on_cpu(v) for k, v in kwargs.items()})
        except Exception as e:  # noqa: BLE001 - whatever CPU raises is the user's error
            return e
    return None


def call_meta(spec: OpSpec, op, meta, kwargs=None):
    """``op`` (one of ``spec``'s overloads) called with ``meta``, its arguments in schema order
    as meta tensors (or fewer: the rest default); keyword-only ones by name, a generator
    left out, a device made ``meta``; ``kwargs`` (an out= overload's outs) added."""
    args, kwargs = [], dict(kwargs or {})
    for n, m, ko, k in zip(spec.arg_names, meta, spec.kwarg_only, spec.kinds):
        if k is GENERATOR:
            continue
        if ko:
            kwargs[n] = m
        else:
            args.append(m)
    if kwargs.get("device") is not None:
        kwargs["device"] = "meta"
    return op(*args, **kwargs)


# c10's names of the dtypes, as CPU's messages print them: ScalarType ("Float") and, for the
# classic types, the legacy tensor type ("torch.FloatTensor"; others print as "CPUBoolType").
_SCALAR_TYPE = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.float16: "Half", torch.float32: "Float", torch.float64: "Double", torch.bool: "Bool",
    torch.bfloat16: "BFloat16", torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble", torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64",
}  # fmt: skip
_LEGACY = ("Byte", "Char", "Short", "Int", "Long", "Half", "Float", "Double")


def dtype_name(dtype: torch.dtype) -> str:
    """c10's name of ``dtype``, as CPU's messages print it ("Float")."""
    return _SCALAR_TYPE.get(dtype) or str(dtype).removeprefix("torch.").capitalize()


def _dtype_names(dtype: torch.dtype) -> dict:
    name = dtype_name(dtype)
    return {"scalar_type": name, "tensor_type": f"torch.{name}Tensor" if name in _LEGACY else f"CPU{name}Type"}


def _check_index_dtype(rules, meta) -> None:
    """Raise CPU's error for an index argument of a dtype CPU rejects (ops.yaml ``index_dtype``):
    each tensor of a list is checked; several arguments are checked as the dtype they promote to
    (``embedding_bag``'s indices and offsets); ``empty_ok``: an index with no elements is not."""
    for pos, dtypes, exc, msg, empty_ok in rules:
        got = [t.dtype for p in pos for t in (meta[p] if type(meta[p]) is list else (meta[p],))
               if isinstance(t, torch.Tensor) and not (empty_ok and t.numel() == 0)]  # fmt: skip
        if len(pos) > 1 and got:
            got = [functools.reduce(torch.promote_types, got)]
        for dt in got:
            if dt not in dtypes:
                raise exc(msg.format(**_dtype_names(dt)))


def info_of(spec: OpSpec, meta: list, avals: tuple) -> Info:
    """The node's ``Info`` from its arguments as PyTorch sees them (meta or fake tensors and
    numbers, in schema order) and its output avals: computation dtype and on-device check."""
    cdtype = None if spec.promote is None else _computation_dtype(spec, meta)
    checked = spec.check is not None and config.CHECKS
    if checked and spec.check_integral:
        dt = (cdtype[0] if type(cdtype) is tuple else cdtype) or next(a[1] for a in avals if a is not None)
        checked = not (dt.is_floating_point or dt.is_complex)
    rounds = () if cdtype is None or type(cdtype) is tuple else _rounded(spec, meta, cdtype)
    return Info(avals, cdtype, checked, rounds)


def _rounded(spec: OpSpec, meta: list, cdtype: torch.dtype) -> tuple:
    """The tensor arguments CPU rounds to the common dtype before computing in a wider one:
    TensorIterator casts every operand to the common dtype, so a 0-d float32 tensor with a
    bfloat16 tensor is a bfloat16 value when ``pow``, ``atan2`` or ``x < t`` compute in float32
    (an integer tensor likewise). Not a number (the op's own rule, ``L.pointwise.in_result_dtype``)
    nor a 0-d operand CPU's kernel reads as given (ops.yaml ``keeps_scalar``: ``mul``, ``div``)."""
    args = [meta[i] for i in spec.promote_idx]
    if not any(isinstance(a, torch.Tensor) for a in args) or any(isinstance(a, list) for a in args):
        return ()  # no tensor, or a foreach op's lists (each element's promotion: _computation_dtype)
    common = elementwise_dtypes(*(meta[i] for i in spec.promote_idx if meta[i] is not None),
                                type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]  # fmt: skip
    if common == cdtype or not (common.is_floating_point or common.is_complex):
        return ()
    return tuple(
        (i, to_jax(common)) for i in spec.promote_idx
        if isinstance(meta[i], torch.Tensor) and meta[i].dtype != common
        and not (meta[i].dim() == 0 and i in spec.keeps_scalar)
    )  # fmt: skip


def _computation_dtype(spec: OpSpec, meta: list):
    """The dtype a promoting op computes in. A foreach op (list arguments) computes each element
    as its single op would (CPU runs ``add`` per tensor: bfloat16 in float32, its number in
    the result's dtype): the dtype of element ``j`` promotes the ``j``-th of each list with the
    other arguments; one dtype if all agree, else a tuple with one per element (``emit_node``
    lowers each group of equal dtypes alone)."""
    pargs = [_numbers(meta[i]) if spec.kinds[i] is HOST_SCALARS else meta[i] for i in spec.promote_idx]
    pargs = [a for a in pargs if a is not None]
    n = next((len(a) for a in pargs if type(a) is list), None)
    if n is None:
        return elementwise_dtypes(*pargs, type_promotion_kind=spec.promote)[0]
    each = tuple(
        elementwise_dtypes(*(a[j] if type(a) is list else a for a in pargs), type_promotion_kind=spec.promote)[0]
        for j in range(n)
    )
    if not each:
        return None
    return each[0] if all(d == each[0] for d in each) else each


def _numbers(t: torch.Tensor) -> list:
    """A ``HOST_SCALARS`` tensor as the numbers PyTorch's kernel reads from it (promotion sees
    only their kind; a fake tensor on the compiled path has no values)."""
    one = True if t.dtype == torch.bool else 1j if t.dtype.is_complex else 1.0 if t.dtype.is_floating_point else 1
    return [one] * t.shape[0]


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


def run_node_on_cpu(n, conv) -> list:
    """Node ``n``'s op run by PyTorch on CPU, its arguments converted by ``conv`` (values to CPU
    tensors); its results flattened in the order of ``n.outs``. A random op's generator is
    left out (CPU's own RNG).

    An in-place op runs on copies of what it writes (``conv``'s tensors are never written): its
    results are its first argument's new values; one writing several arguments runs as its
    functional variant (``meta_overload``), whose results are their new values."""
    spec = n.spec
    plan = _PLANS.get(spec, _PLANS)
    if plan is _PLANS:
        plan = _PLANS[spec] = _plan(spec)
    if plan is not None:  # the common case: each argument converted, in order
        npos, kw, dev = plan
        vals = [conv(a) for a in n.args]
        if 0 <= dev < len(vals) and vals[dev] is not None:
            vals[dev] = "cpu"
        res = spec.overload(*vals[:npos], **dict(zip(kw, vals[npos:]))) if kw else spec.overload(*vals)
        if isinstance(res, torch.Tensor) or res is None:
            return [res]
        return [x for r in res for x in (r if isinstance(r, (list, tuple)) else (r,))]
    op = spec.meta_overload if spec.mutates else spec.overload
    writes = _writes(op)
    inplace = bool(writes)
    args, kwargs = [], {}
    for i, (name, a, ko, kind) in enumerate(zip(spec.arg_names, n.args, spec.kwarg_only, spec.kinds)):
        if kind is GENERATOR:
            continue
        a = _host_tensor(a) if kind is HOST_SCALARS else conv(a)
        if i in writes:
            a = _copied(a)
        elif name == "device" and a is not None:
            a = "cpu"
        if ko:
            kwargs[name] = a
        else:
            args.append(a)
    res = op(*args, **kwargs)
    if inplace:
        res = args[0]
    res = [res] if isinstance(res, torch.Tensor) or res is None else list(res)
    return [x for r in res for x in (r if isinstance(r, (list, tuple)) else (r,))]


_WRITES: dict = {}  # ATen overload -> positions of the arguments it writes in place
_PLANS: dict = {}  # OpSpec -> how run_node_on_cpu passes its arguments (_plan), or None


def _writes(op) -> frozenset:
    writes = _WRITES.get(op)
    if writes is None:
        writes = _WRITES[op] = frozenset(
            i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
    return writes


def _plan(spec):
    """For a functional op writing nothing, with no generator or host-scalars argument, how
    ``run_node_on_cpu`` calls it with every argument converted in schema order: ``(positional
    count, keyword-only names, position of a ``device`` argument or -1)``; None otherwise.
    ATen's keyword-only arguments come after its positional ones."""
    if spec.mutates or any(k is GENERATOR or k is HOST_SCALARS for k in spec.kinds) or _writes(spec.overload):
        return None
    names, ko = list(spec.arg_names), list(spec.kwarg_only)
    npos = ko.index(True) if True in ko else len(names)
    if not all(ko[npos:]):
        return None
    return npos, tuple(names[npos:]), names.index("device") if "device" in names else -1


def _copied(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if type(a) is list:
        return [_copied(x) for x in a]
    return a


def apply_view(step, base):
    """Replay one view step on a base value."""
    spec, rest, idx = step
    return node(spec, (base,) + rest).outs[idx]


def apply_scatter(step, base, src):
    """The new base after writing ``src`` through one view step."""
    spec, rest, idx = step
    if spec.scatter is None:
        if spec.name == "expand.default" and src.aval[0] == base.aval[0]:
            return src  # an expand that broadcasts nothing (one that does: trace/tensor.write refuses it)
        raise NotImplementedError(
            f"xlatorch: in-place update of a view made by aten::{spec.name} is not supported yet; "
            f"apply the op to a .clone() instead"
        )
    return node(spec.scatter, (base, src) + rest + (idx,)).outs[0]


def convert_value(v, dtype: torch.dtype):
    """A value cast to ``dtype`` (the ``_to_copy`` lowering)."""
    return node(SPECS["_to_copy.default"], (v, dtype, None, None, None, False, None)).outs[0]
