"""A view's strides and storage offset, as PyTorch on CPU gives them.

A device tensor's value has a shape and no layout, but PyTorch decides things from the
strides a tensor reports: ``contiguous()`` returns the tensor itself when it is contiguous
(else a copy), ``reshape`` and ``flatten`` return a view when the strides allow one (else a
copy), ``view`` raises when they do not. Reported contiguous, a transposed view's
``contiguous()`` was the view itself, so writing into it wrote into its base, which on CPU
stays as it was. So a view reports the strides and offset PyTorch's own view op gives over
its base's (``geometry``: the op's meta kernel, once per signature and base layout), and a
view CPU cannot make raises CPU's error when it is made. Every other tensor is contiguous
from offset 0 (results of ops are new buffers, laid out as XLA likes).
"""

from __future__ import annotations

import math

import torch
from torch._prims_common import make_contiguous_strides_for as _contiguous

from xlatorch.runtime.trace.nodes import replay_on_cpu

__all__ = ["GEOMETRY", "geometry", "through_storage"]

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


def through_storage(shape, dtype, chain) -> tuple | None:
    """For a write through view ``chain`` of a storage whose value has ``shape``: when a step
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
    view = torch.empty(shape, dtype=dtype, device="meta")
    for step in chain:
        view = replay_on_cpu(step, view)
    size, stride = tuple(view.shape), tuple(view.stride())
    return (size, stride, view.storage_offset()) if _no_overlap(size, stride) else None


def _no_overlap(size, stride) -> bool:
    """Whether no two elements of a view of ``size`` and ``stride`` share memory."""
    extent = 0  # the span of the dimensions seen so far, in elements
    for st, n in sorted((abs(st), n) for n, st in zip(size, stride) if n > 1):
        if st <= extent:
            return False
        extent += st * (n - 1)
    return True
