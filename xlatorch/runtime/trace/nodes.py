"""From converted arguments to an IR node: output avals and computation dtype from PyTorch's
own meta kernels (once per signature, then ``OpSpec.cache``), and the view steps a tensor
replays on its base (``apply_view``), writes through (``apply_scatter``) or runs on CPU.
"""

from __future__ import annotations

import torch
from torch._prims_common import elementwise_dtypes

from xlatorch.runtime.base import config
from xlatorch.runtime.base.dtypes import PY_SCALAR_DTYPE
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.source import user_frame
from xlatorch.runtime.base.threads import CHECKED_SINCE_SYNC, TICKS, owner
from xlatorch.runtime.ir.ops import GENERATOR, SPECS, Info, OpSpec, _sig
from xlatorch.runtime.ir.values import VALUE_TYPES, Node, Scalar

__all__ = ["node", "scalar", "info_of", "apply_view", "apply_scatter", "convert_value", "replay_on_cpu"]


def scalar(a) -> Scalar:
    """The leaf for a Python number: a graph parameter (never a constant, see ir.Scalar)."""
    return Scalar(a, PY_SCALAR_DTYPE[type(a)])


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
        n.tick = (next(TICKS), owner())  # this thread's later updates are undone if it fails (runtime/lower/checks.py)
        CHECKED_SINCE_SYNC.add(n.tick[1])
        if getattr(n, "src", None) is None:
            n.src = user_frame()  # a failed check names the user's line
    return n


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
    checked = spec.check is not None and config.CHECKS
    if checked and spec.check_integral:
        dt = cdtype or next(a[1] for a in avals if a is not None)
        checked = not (dt.is_floating_point or dt.is_complex)
    return Info(avals, cdtype, checked)


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
    return node(SPECS["_to_copy.default"], (v, dtype, None, None, None, False, None)).outs[0]
