"""In-place view ops (``t_``, ``transpose_``, ``squeeze_``, ``unsqueeze_``, ``as_strided_``,
``set_``), and ``as_strided``, which indexes storage.

An in-place view op changes the tensor's own shape: the tensor is rebound to the
functional view of its storage (``t_`` becomes ``t``), so it keeps aliasing its base
and every other view, and later writes through it scatter into the shared storage.

``as_strided``'s strides and offset count elements of the tensor's storage, not of the
tensor: ``x[1:].as_strided((2,), (1,), 0)`` starts at ``x[0]``. Applied to a view's own
value it indexed the view's elements (read ``x[1]``, ``x[2]``: a silent divergence), so
``as_strided`` of a view is a view of the storage's value, one step from it.
"""

from __future__ import annotations

import torch

from xlatorch.runtime.ir.ops import SPECS
from xlatorch.runtime.trace.dispatch import RUNTIME_OPS, call
from xlatorch.runtime.trace.strides import STORAGE_LAYOUT
from xlatorch.runtime.trace.tensor import wrap

__all__ = ["install", "set_to_view"]

aten = torch.ops.aten


def as_strided(self, size, stride, storage_offset=None):
    """``aten.as_strided``: over the storage's value (contiguous, from offset 0; or, for the
    result of an op laid out otherwise, ``STORAGE_LAYOUT``, the value in that order), where
    the strides and offset PyTorch gives count. Out of the storage's bounds it raises CPU's
    error."""
    if storage_offset is None:  # PyTorch's default: the tensor's own offset
        storage_offset = self.storage_offset()
    st = self._st
    layout = STORAGE_LAYOUT.get(st)
    if self._vw is not None or layout is not None:
        if st.value.aval[1] != self.dtype:
            raise NotImplementedError(
                f"xlatorch: as_strided of a view whose dtype ({self.dtype}) is not its storage's "
                f"({st.value.aval[1]}) is not supported; apply it to a .clone() of the view instead"
            )
        self = wrap(st.value, st, None, None if layout is None else (layout, 0))  # the storage, as a tensor
        if layout is not None:  # its elements in memory order: the value permuted to it, flat
            order = sorted(range(len(layout)), key=lambda d: -layout[d])
            self = aten.view.default(aten.permute.default(self, order), (-1,))
    _check_bounds(size, stride, storage_offset, self)
    return call(SPECS["as_strided.default"], (self, size, stride, storage_offset))


def _set_tensor(self, source):
    """``aten.set_.source_Tensor``: ``self`` shares ``source``'s storage, shape and layout
    (the data setter). As a CPU fallback it was a copy: later writes to either did not show
    in the other."""
    _check_set_source(self, source)
    self.data = source  # XlaTensor.data: metadata and storage
    return self


def set_to_view(self, source, storage_offset, size, stride=()):
    """``aten.set_.source_Tensor_storage_offset``, above autograd (PyTorch's composite passes
    ``source``'s storage, which a device tensor's wrapper does not hold): ``self`` shares
    ``as_strided`` of ``source`` (contiguous strides by default)."""
    if not stride:
        stride = torch._prims_common.make_contiguous_strides_for(size)
    return aten.set_.source_Tensor(self, aten.as_strided.default(source, size, stride, storage_offset))


def _check_set_source(self, source) -> None:
    if not isinstance(source, torch.Tensor) or source.device != self.device:
        where = source.device if isinstance(source, torch.Tensor) else type(source).__name__
        raise RuntimeError(f"xlatorch: set_ of a tensor on {self.device} to a source on {where}; move it there first")
    if source.dtype != self.dtype:
        raise RuntimeError(f"Could not set tensor of type {source.dtype} to a tensor of type {self.dtype}")


def _set_storage(self, *args, **kwargs):
    raise NotImplementedError(
        "xlatorch: set_ with a Storage is not supported on the xla device (device tensors have no host "
        "storage); use set_(tensor) with a tensor on the device"
    )


def _rebind(functional):
    def inplace_view(self, *args, **kwargs):
        # Called inside __torch_dispatch__ (below autograd): ATen overloads only.
        self.data = functional(self, *args, **kwargs)  # XlaTensor.data: metadata and storage
        return self

    inplace_view.__name__ = functional.__name__ + "_inplace"
    return inplace_view


def _check_bounds(size, stride, offset, storage) -> None:
    """CPU's bounds check of an as_strided view over ``storage`` (the meta kernel has none)."""
    if any(s < 0 for s in stride):
        raise RuntimeError(f"as_strided: Negative strides are not supported at the moment, got strides: {list(stride)}")
    item = storage.element_size()
    need = 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    if need > storage.numel():
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and itemsize {item} "
            f"requiring a storage size of {need * item} are out of bounds for storage of size {storage.numel() * item}"
        )


def install() -> None:
    """Register the handlers (called by ``xlatorch.runtime.device.install``)."""
    RUNTIME_OPS.update(
        {
            aten.t_.default: _rebind(aten.t.default),
            aten.transpose_.default: _rebind(aten.transpose.int),
            aten.squeeze_.default: _rebind(aten.squeeze.default),
            aten.squeeze_.dim: _rebind(aten.squeeze.dim),
            aten.squeeze_.dims: _rebind(aten.squeeze.dims),
            aten.unsqueeze_.default: _rebind(aten.unsqueeze.default),
            aten.as_strided.default: as_strided,
            aten.set_.source_Tensor: _set_tensor,
            aten.set_.default: lambda self: _set_tensor(self, aten.new_empty.default(self, (0,))),
            aten.set_.source_Storage: _set_storage,
            aten.set_.source_Storage_storage_offset: _set_storage,
            aten.as_strided_copy.default: lambda *args: aten.clone.default(as_strided(*args)),
            aten.as_strided_.default: _rebind(as_strided),
            # The autograd layer above does the detaching; the tensor itself is unchanged.
            aten.detach_.default: lambda self: self,
        }
    )
