"""A view's strides and storage offset, as PyTorch on CPU gives them.

A device tensor's value has a shape and no layout, but PyTorch decides things from the
strides a tensor reports: ``contiguous()`` returns the tensor itself when it is contiguous
(else a copy), ``reshape`` and ``flatten`` return a view when the strides allow one (else a
copy), ``view`` raises when they do not. Reported contiguous, a transposed view's
``contiguous()`` was the view itself, so writing into it wrote into its base, which on CPU
stays as it was. So a view reports the strides and offset PyTorch's own view op gives over
its base's (``geometry``: the op's meta kernel, once per signature and base layout), and a
view CPU cannot make raises CPU's error when it is made.

The result of an op with an input so laid out reports the layout CPU gives it (``x.t() * 2``
is transposed on CPU: ``result_layout``, the op's meta kernel over its inputs' strides, once
per signature and input layouts); its storage remembers it (``STORAGE_LAYOUT``), for
``as_strided``, which counts elements in that order. Reported contiguous, ``contiguous()``
of it returned the result itself, so a write into the "copy" changed the original. Every
other result is contiguous from offset 0. The device's value of a tensor is always its
logical, row-major array: a layout is what PyTorch sees, not how XLA stores it.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch._prims_common import make_contiguous_strides_for as _contiguous

from xlatorch.runtime.trace.nodes import call_meta, replay_on_cpu

__all__ = ["GEOMETRY", "geometry", "through_storage", "result_layout", "layout_like", "dense", "STORAGE_LAYOUT",
           "self_overlapping", "overlap", "NO", "FULL", "PARTIAL"]  # fmt: skip

# (Info of the view's signature, the base's ``_geo``, output index) -> (strides, offset), or
# None for a contiguous view from offset 0 (the default a new tensor gets). Cleared when full
# (the fused shims hold it: never rebound).
GEOMETRY: dict = {}
_LIMIT = 4096


def geometry(info, step, base) -> tuple | None:
    """(strides, storage offset) of view ``step`` (``(spec, rest, idx)``) applied to device
    tensor ``base``, or None when they are a contiguous tensor's from offset 0. Raises
    PyTorch's error for a view it cannot make (``view`` over incompatible strides). A tensor's
    layout is its ``_geo`` (set on the views that are not contiguous from 0): no call into
    PyTorch per view."""
    key = (info, base._geo, step[2])
    g = GEOMETRY.get(key, geometry)
    if g is geometry:
        geo = base._geo
        strides, offset = geo if geo is not None else (_contiguous(base.shape), 0)
        g = _compute(step, tuple(base.shape), strides, offset, base.dtype)
        if len(GEOMETRY) >= _LIMIT:
            GEOMETRY.clear()
        GEOMETRY[key] = g
    return g


def _compute(step, shape, strides, offset, dtype) -> tuple | None:
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if math.prod(shape) else offset
    meta = torch.empty(max(extent, 1), dtype=dtype, device="meta").as_strided(shape, strides, offset)
    out = replay_on_cpu(step, meta)  # PyTorch's view op over the base's layout (raises as CPU does)
    got, off = tuple(out.stride()), out.storage_offset()
    return None if off == 0 and got == _contiguous(out.shape) else (got, off)


# View ops whose elements can share memory (overlapping windows, a broadcast): a write through
# a chain with one of them is not the composition of each step's scatter.
_MAY_OVERLAP = frozenset(("unfold.default", "expand.default"))


def through_storage(st, shape, dtype, chain) -> tuple | None:
    """For a write through view ``chain`` of storage ``st``, whose value has ``shape``: when a step
    of it may overlap (``_MAY_OVERLAP``) and the view it ends in does not, ``(size, stride,
    offset)`` of that view over the storage's elements, so that the write is one
    ``as_strided_scatter`` of exactly them, as on CPU. Step by step, the overlapping step
    would write back its other copies of an element, stale (``x.unfold(0, 3, 2)[1].zero_()``
    left the element shared with the next window as it was). None otherwise: the steps'
    scatters are exact, or the final view overlaps itself (into a broadcast the scatter raises
    CPU's error)."""
    for step in chain:  # a loop, not any(): a write through a view runs this
        if step[0].name in _MAY_OVERLAP:
            break
    else:
        return None
    if st in STORAGE_LAYOUT:
        raise NotImplementedError(
            "xlatorch: a write through an unfold or expand view of an op's result laid out otherwise than "
            "contiguous is not supported; write through a view of its .contiguous() copy instead"
        )
    view = torch.empty(shape, dtype=dtype, device="meta")
    for step in chain:
        view = replay_on_cpu(step, view)
    size, stride = tuple(view.shape), tuple(view.stride())
    return (size, stride, view.storage_offset()) if _no_overlap(size, stride) else None


def dense(size, stride) -> bool:
    """Whether a tensor of ``size`` and ``stride`` covers exactly as many elements as it has."""
    if 0 in size:
        return True
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(size, stride) if n != 1):
        if st != expected:
            return False
        expected *= n
    return True


def _no_overlap(size, stride) -> bool:
    """Whether no two elements of a view of ``size`` and ``stride`` share memory."""
    extent = 0  # the span of the dimensions seen so far, in elements
    for st, n in sorted((abs(st), n) for n, st in zip(size, stride) if n > 1):
        if st <= extent:
            return False
        extent += st * (n - 1)
    return True


def _layout(t) -> tuple:
    """``t``'s (strides, storage offset): its ``_geo``, or contiguous from 0."""
    geo = t._geo
    return geo if geo is not None else (_contiguous(t.shape), 0)


def self_overlapping(t) -> bool:
    """Whether more than one element of ``t`` is one memory location (an expanded view): CPU
    refuses to write into such a tensor (``has_internal_overlap``: a stride 0 over a size > 1)."""
    geo = t._geo
    return geo is not None and any(st == 0 and n > 1 for n, st in zip(t.shape, geo[0]))


NO, FULL, PARTIAL = range(3)


def overlap(a, b) -> int:
    """How two device tensors share memory, as CPU decides it (``get_overlap_status``): ``FULL``
    (the same elements in the same order), ``PARTIAL`` (some), or ``NO`` (none; also for
    tensors that are not dense, which CPU lets through)."""
    if a is b:
        return FULL
    if a._st is not b._st or a.numel() == 0 or b.numel() == 0:
        return NO
    (sa, oa), (sb, ob) = _layout(a), _layout(b)
    if not (dense(a.shape, sa) and _no_overlap(a.shape, sa) and dense(b.shape, sb) and _no_overlap(b.shape, sb)):
        return NO
    a0, b0 = oa * a.element_size(), ob * b.element_size()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if (a0, a1) == (b0, b1):
        return PARTIAL if tuple(sa) != tuple(sb) or a.dtype != b.dtype else FULL
    return PARTIAL if a0 < b1 and b0 < a1 else NO


SELF_OVERLAP = (
    "unsupported operation: more than one element of the written-to tensor refers to a single memory location. "
    "Please clone() the tensor before performing the operation."
)
PARTIAL_OVERLAP = (
    "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory "
    "location. Please clone() the tensor before performing the operation."
)


# (Info of an op's signature, each argument's ``_geo``) -> the layout CPU gives its result
# ((strides, 0)), or None: contiguous. Cleared when full.
RESULT_LAYOUT: dict = {}
# Storage -> the strides of the tensor it was made for, where not contiguous (as_strided of it
# or its views counts elements in that order: trace/views.py).
STORAGE_LAYOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def result_layout(spec, info, args) -> tuple | None:
    """The layout CPU gives the one result of op ``spec`` (signature ``info``) called with
    ``args`` (schema order), some of them device tensors laid out otherwise than contiguous:
    PyTorch's meta kernel over arguments with the same strides (TensorIterator's rule for
    pointwise ops, ``preserve_format`` for clones and ``*_like``). None: contiguous."""
    key = (info, tuple([getattr(a, "_geo", None) for a in args]))
    g = RESULT_LAYOUT.get(key, result_layout)
    if g is result_layout:
        g = _result_layout(spec, args)
        if len(RESULT_LAYOUT) >= _LIMIT:
            RESULT_LAYOUT.clear()
        RESULT_LAYOUT[key] = g
    return g


def _result_layout(spec, args) -> tuple | None:
    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if type(a) in (list, tuple) and any(isinstance(x, torch.Tensor) for x in a):
            return [meta(x) for x in a]
        return a

    try:
        out = call_meta(spec, spec.overload, [meta(a) for a in args])
    except Exception:  # no meta kernel, or one that needs values: contiguous, as before
        return None
    if not isinstance(out, torch.Tensor) or out.storage_offset() != 0:
        return None
    got = tuple(out.stride())  # a storage's layout: dense (as_strided counts in its order)
    return None if got == _contiguous(out.shape) or not dense(tuple(out.shape), got) else (got, 0)


def layout_like(t: torch.Tensor, memory_format=None) -> tuple | None:
    """The layout a copy of ``t`` gets (``.to``, a transfer) in ``memory_format``
    (``preserve_format`` by default: ``t``'s own strides when dense), as ``(strides, 0)``,
    or None: contiguous."""
    preserve = memory_format in (None, torch.preserve_format)
    if memory_format is torch.contiguous_format or (preserve and t.is_contiguous()):
        return None
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    out = torch.empty_like(meta, memory_format=memory_format or torch.preserve_format)
    got = tuple(out.stride())
    return None if got == _contiguous(out.shape) else (got, 0)
