"""Applying one node's lowering while a graph is traced by JAX.

The generic part of every lowering lives here, once: promoting arguments are cast
to the computation dtype PyTorch would use, and results are cast to (and checked
against) the avals PyTorch's meta kernels gave when the node was created.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlatorch.runtime.base import record
from xlatorch.runtime.base.dtypes import to_jax, weak_number
from xlatorch.runtime.base.source import fmt_src
from xlatorch.runtime.ir.ops import HOST_SCALARS, SCALAR, SCALAR_LIST, TENSOR_LIST, Info

__all__ = ["emit_node", "hlo_scopes"]


def _op_name(spec) -> str:
    name = spec.name[:-8] if spec.name.endswith(".default") else spec.name
    return name if "::" in name else "aten::" + name


def hlo_scopes(nodes) -> list[str] | None:
    """Per-node ``aten::<op>(file.py:12)`` names for the HLO metadata under ``XLA_HLO_DEBUG``, else None.

    (Not ``@``: XLA cuts an ``op_name`` at ``@`` when it converts StableHLO to HLO.)
    """
    if not record.HLO_DEBUG:
        return None
    out = []
    for n in nodes:
        src = getattr(n, "src", None)
        out.append(_op_name(n.spec) + (f"({fmt_src(src)})" if src is not None else ""))
    return out


_SCALARS: dict = {}  # OpSpec -> positions of its Scalar arguments


def _aval_struct(aval):
    return None if aval is None else jax.ShapeDtypeStruct(aval[0], to_jax(aval[1]))


def emit_node(spec, args, info, scope=None, checks=None, casts=None):
    """The JAX values of a node's outputs, given its arguments' JAX values; ``scope`` names the
    node in the HLO metadata (default: its ATen op; ``XLA_HLO_DEBUG`` adds the source line).
    A checked node (``info.checked``) appends its ``L.checks`` results to ``checks``. ``casts``
    (a dict kept for one trace) reuses an argument's cast to a computation dtype made for an
    earlier node: a learning rate or a shared scalar read by many ops is cast once."""
    # Every HLO op carries the ATen op it lowers (op_name metadata "jit(...)/aten::mm/dot_general"):
    # profiles and HLO dumps name PyTorch's ops. Lowering only; keys and the disk cache ignore it.
    if scope is None:
        scope = _op_name(spec)
    with jax.named_scope(scope):
        return _emit(spec, args, info, checks, casts)


def _cast(a, cd, casts):
    if not hasattr(a, "dtype") or a.dtype == cd:
        return a
    if casts is None:
        return a.astype(cd)
    key = (id(a), cd)
    c = casts.get(key)
    if c is None:  # the entry holds ``a``: its id is not reused while the trace lasts
        c = casts[key] = (a, a.astype(cd))
    return c[1]


def _emit_groups(spec, args, info, checks, casts):
    """A foreach op whose elements compute in different dtypes (``info.cdtype`` a tuple, one per
    element: float32 and bfloat16 tensors in one list): each group of one computation dtype
    lowers alone, as CPU runs each element's op by itself; results in the list's order."""
    groups: dict = {}
    for j, cd in enumerate(info.cdtype):
        groups.setdefault(cd, []).append(j)
    if len(info.avals) != len(info.cdtype):
        raise AssertionError(f"aten::{spec.name}: {len(info.avals)} results for {len(info.cdtype)} elements")
    lists = [k is TENSOR_LIST or k is SCALAR_LIST or k is HOST_SCALARS for k in spec.kinds]
    out = [None] * len(info.cdtype)
    for cd, idx in groups.items():
        part = [[a[j] for j in idx] if is_list else a for a, is_list in zip(args, lists)]
        sub = Info(tuple(info.avals[j] for j in idx), cd, info.checked)
        for j, r in zip(idx, _emit(spec, part, sub, checks, casts)):
            out[j] = r
    return out


def _emit(spec, args, info, checks=None, casts=None):
    pos = _SCALARS.get(spec)
    if pos is None:
        pos = _SCALARS[spec] = tuple(i for i, k in enumerate(spec.kinds) if k is SCALAR)
    for i in pos:
        a = args[i]
        if type(a) is int or type(a) is float:
            # A Scalar argument at the schema's default (trace/dispatch.py, ``_defaults``): a
            # weakly typed constant of the graph, as a traced scalar would be a parameter
            args = list(args)
            args[i] = weak_number(a)
    if info.cdtype is not None:
        if type(info.cdtype) is tuple:
            return _emit_groups(spec, args, info, checks, casts)
        cd = to_jax(info.cdtype)
        args = list(args)
        for i, common in info.rounds:  # CPU's value: rounded to the common dtype first
            if args[i] is not None:
                args[i] = _cast(args[i], common, casts)
        for i in spec.promote_idx:
            a = args[i]
            if type(a) is list or type(a) is tuple:  # a foreach op's list: each element
                args[i] = [_cast(x, cd, casts) for x in a]
            elif a is not None:
                args[i] = _cast(a, cd, casts)
    avals = info.avals
    out = [_aval_struct(a) for a in avals]
    first = out[0] if len(out) == 1 and spec.returns == 0 else tuple(out)
    if info.checked and checks is not None:
        found = spec.check(first, *args)
        checks.extend(found if isinstance(found, list) else [found])
    res = spec.emit(first, *args)
    if not isinstance(res, (tuple, list)):
        res = (res,)
    if len(res) != len(avals):
        raise AssertionError(f"lowering of aten::{spec.name} returned {len(res)} values, expected {len(avals)}")
    fixed = []
    for r, s in zip(res, out):
        if s is None:  # an output PyTorch leaves undefined
            fixed.append(None)
            continue
        if not isinstance(r, jax.Array):  # a tracer is one (a Python number or numpy array is not)
            r = jnp.asarray(r)
        if r.dtype != s.dtype:
            r = r.astype(s.dtype)
        if r.shape != s.shape:
            # Lowerings may return a scalar or a lower-rank value that broadcasts.
            if r.size == 1 or r.ndim < len(s.shape):
                r = jnp.broadcast_to(r.reshape(()) if r.size == 1 else r, s.shape)
            else:
                raise AssertionError(
                    f"lowering of aten::{spec.name} produced shape {r.shape}, PyTorch expects {s.shape}"
                )
        fixed.append(r)
    return fixed
