"""``out=`` ops: CPU's rules for the out= tensors (their dtype, their memory against the
inputs'), the functional node's results written into them, resized as PyTorch resizes outs.
Called by the generated out= shims (generated/dispatch.py) and by the runtime's own out= ops
(``dynamic.py``) and CPU fallback (``fallback/cpu.py``)."""

from __future__ import annotations

import functools
import warnings

import torch

from xlatorch.runtime.ir.ops import GENERATOR, OpSpec
from xlatorch.runtime.trace import strides
from xlatorch.runtime.trace.dispatch import _not_xla, _prepare
from xlatorch.runtime.trace.nodes import _node, call_meta, convert_value, error_on_cpu, meta_args
from xlatorch.runtime.trace.tensor import XlaTensor, wrap, write

__all__ = ["call_out", "check_out_overlap", "write_outs"]

aten = torch.ops.aten


def call_out(spec: OpSpec, args: tuple, outs: tuple, returns: bool = True):
    """An ``out=`` op: compute functionally, then write each result into its ``out`` tensor.

    ``returns=False`` for the out= overloads that take a list of tensors and return nothing
    (``unbind_copy.int_out``, ``split_copy.Tensor_out``).
    """
    check_out_overlap(spec, args, outs, spec.distinct_out)
    vals, sig = _prepare(spec, args)
    _check_out(spec, vals, sig, outs)
    if "dtype" in spec.arg_names and len(outs) == 1:
        k = spec.arg_names.index("dtype")
        if k < len(args) and args[k] is None:
            # No dtype given: CPU computes in the out='s (sum, mean, cumsum, prod of floats into
            # an int64 out= cast each element first: sum([1.5, 2.5, 3.7]) is 6, not 7)
            vals, sig = _prepare(spec, (*args[:k], outs[0].dtype, *args[k + 1 :]))
    write_outs(outs, _node(spec, vals, sig).outs)
    if not returns:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)


def check_out_overlap(spec: OpSpec, args: tuple, outs: tuple, distinct: bool) -> None:
    """CPU's refusals of ``outs`` before an out= op runs: a tensor not on the device, one whose
    elements overlap each other, one sharing part of an input's memory (or all of it:
    ``distinct``, ops.yaml ``distinct_out``)."""
    for t in outs:
        if type(t) is not XlaTensor:
            raise _not_xla(spec, t)
        if strides.self_overlapping(t):  # before a resize too, as on CPU
            raise RuntimeError(strides.SELF_OVERLAP)
        for a in args:
            for x in a if type(a) is list or type(a) is tuple else (a,):
                if type(x) is XlaTensor and x._st is t._st:
                    how = strides.overlap(t, x)
                    if how == strides.PARTIAL or (how == strides.FULL and distinct):
                        raise RuntimeError(strides.PARTIAL_OVERLAP)


def write_outs(outs: tuple, values, warn: bool = True) -> None:
    """Each value written into its out= tensor, converted to its dtype and resized to its
    shape as PyTorch resizes outs (``warn``: with CPU's warning when the out= had elements,
    which PyTorch's own resize of a meta twin gives, at the user's line)."""
    for t, v in zip(outs, values):
        if t.dtype != v.aval[1]:
            v = convert_value(v, t.dtype)
        if tuple(t.shape) != v.aval[0]:
            if warn and t.numel():
                aten._resize_output_(torch.empty(t.shape, dtype=t.dtype, device="meta"), v.aval[0], "meta")
            t.data = wrap(v)  # out= resizes, as in PyTorch
        else:
            write(t, v)


_OUT_CHECKED: set = set()  # (spec, signature, the outs' avals) whose out= tensors PyTorch accepts


def _check_out(spec: OpSpec, vals: tuple, sig: tuple, outs: tuple) -> None:
    """PyTorch's rules for ``out=`` tensors, as the out= overload's meta kernel applies them
    (once per signature): the dtype the op requires (exactly, for ``mm`` or ``abs``; one the
    result casts to safely, for ``add``), which the functional node does not see; CPU raises
    where the device wrote ``torch.abs(x, out=int_tensor)``'s truncated values."""
    key = (spec, sig, tuple([(tuple(t.shape), t.dtype) for t in outs]))
    if key in _OUT_CHECKED:
        return
    overload = spec.out_overload
    meta = meta_args(spec, vals)
    # A random op's meta refuses outs its CPU kernel takes (bernoulli's ints): left to the op
    if overload is not None and GENERATOR not in spec.kinds:
        params = [a for a in overload._schema.arguments if a.is_out]
        metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outs]
        if len(params) == 1 and isinstance(params[0].type, torch.ListType):  # Tensor[] out
            kw = {params[0].name: metas}
        else:
            kw = {a.name: m for a, m in zip(params, metas)}
        with warnings.catch_warnings():  # a resized out= warns at each call (write_outs), not here
            warnings.simplefilter("ignore")
            try:
                call_meta(spec, overload, meta, kw)
            except NotImplementedError:
                pass  # no meta kernel for it: nothing to check by
            except Exception:  # the meta kernel's words: CPU's where CPU refuses the outs too
                cpu_error = call_meta(spec, functools.partial(error_on_cpu, overload), meta, kw)
                if cpu_error is not None:
                    raise cpu_error from None
                raise
    if spec.validate_out is not None:
        res = call_meta(spec, spec.meta_overload, meta)
        results = [r.dtype for r in (res if isinstance(res, (tuple, list)) else (res,))]
        spec.validate_out([t.dtype for t in outs], results, *meta)
    _OUT_CHECKED.add(key)
