"""Ops whose output shape depends on the data, and ``resize_``.

A data-dependent op (``nonzero``, ``masked_select``, boolean-mask indexing) costs one
small graph cut: its count is computed on the device and transferred to the host
(one value), and then an IR node is built whose static output size is that count,
so the data itself stays on the device. Each such op bumps the counter
``xla::<op>``; PyTorch's meta kernels cannot give these shapes, so the handlers
build the node's ``Info`` themselves (its hash includes the count).
"""

from __future__ import annotations

import functools

import torch

from xlatorch.runtime.base.record import cause
from xlatorch.runtime.base.threads import BODIES
from xlatorch.runtime.ir.ops import SPECS, Info, signature
from xlatorch.runtime.ir.values import Node
from xlatorch.runtime.trace import views
from xlatorch.runtime.trace.dispatch import RUNTIME_OPS, SHIMS, count
from xlatorch.runtime.trace.nodes import error_on_cpu
from xlatorch.runtime.trace.outs import check_out_overlap, write_outs
from xlatorch.runtime.trace.tensor import DEVICE, XlaTensor, value_of, wrap

__all__ = ["install"]

aten = torch.ops.aten


def _host_count(mask: torch.Tensor) -> int:
    """The number of non-zeros of a device tensor: a graph cut and a one-value transfer."""
    # Called inside __torch_dispatch__: ATen overloads, not composite Tensor methods.
    return int(aten._local_scalar_dense(aten.sum(aten.ne.Scalar(mask, 0))))


def _sized_node(name: str, vals: tuple, aval) -> Node:
    """A node of ``name``'s lowering whose single output has the host-known ``aval``."""
    spec = SPECS[name]
    return Node(spec, vals, Info((aval,), None), (spec, signature(vals), aval))


def nonzero(self):
    """aten.nonzero on the device: one graph cut to read the count, then a sized gather node."""
    count("xla::nonzero")
    with cause("data-dependent aten::nonzero"):
        n = _host_count(self)
    return wrap(_sized_node("nonzero.default", (value_of(self),), ((n, self.dim()), torch.int64)).outs[0])


def masked_select(self, mask):
    """aten.masked_select on the device: one graph cut to read the count, then a sized gather node."""
    count("xla::masked_select")
    if type(mask) is not XlaTensor:
        mask = aten._to_copy(mask, device=DEVICE)
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    with cause("data-dependent aten::masked_select"):
        n = _host_count(aten.expand(mask, shape))
    vals = (value_of(self), value_of(mask))
    return wrap(_sized_node("masked_select.default", vals, ((n,), self.dtype)).outs[0])


def _out(op, handler, name: str, dtype):
    """The out= overload ``op`` of a data-dependent op: CPU's refusals of the out= tensor (of
    another dtype than ``dtype(*args)``: CPU's own error; an input's memory), then
    ``handler``'s result written into it."""
    spec = SPECS[name]

    def run(*args, out):
        if out.dtype != dtype(*args):  # CPU checks it first
            error = error_on_cpu(op, *args, out=out)
            if error is not None:
                raise error
        check_out_overlap(spec, args, (out,), True)
        write_outs((out,), (value_of(handler(*args)),))
        return out

    return run


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _long_indices(indices) -> list:
    """Boolean masks replaced by the long indices of their Trues (``nonzero``), as PyTorch does."""
    out = []
    for t in indices:
        if not _is_mask(t):
            out.append(t)
            continue
        if type(t) is not XlaTensor:
            t = aten._to_copy(t, device=DEVICE)
        out.extend(aten.unbind.int(nonzero(t), 1))
    return out


_INDEX_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


def _checked_indices(self, indices) -> list:
    """Index tensors as PyTorch takes them for an accelerator tensor: CPU ones (any size)
    moved to the device; dtypes and mask shapes checked now, raising CPU's IndexError."""
    out = []
    d = 0  # the dim of ``self`` the next index applies to
    for t in indices:
        if t is None:
            out.append(t)
            d += 1
            continue
        if t.dtype not in _INDEX_DTYPES:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        if _is_mask(t):
            for j, n in enumerate(t.shape):
                if d + j >= self.dim() or self.shape[d + j] != n:
                    raise IndexError(
                        f"The shape of the mask {list(t.shape)} at index {j} does not match the shape of the "
                        f"indexed tensor {list(self.shape)} at index {d + j}"
                    )
            d += t.dim()
        else:
            d += 1
        out.append(t if type(t) is XlaTensor else aten._to_copy(t, device=DEVICE))
    return out


def _index(shim, self, indices):
    """aten.index.Tensor: boolean masks cost one graph cut each (their count), then the lowering."""
    indices = _checked_indices(self, indices)
    if any(_is_mask(t) for t in indices):
        count("xla::index_mask")
        with cause("data-dependent boolean-mask indexing"):
            indices = _long_indices(indices)
    return shim(self, indices)


def _index_put(shim, self, indices, values, accumulate=False):
    """aten.index_put(_): a lone mask is lowered statically; a mask among other indices is converted."""
    indices = _checked_indices(self, indices)
    given = [t for t in indices if t is not None]
    if any(_is_mask(t) for t in given) and len(given) != 1:
        count("xla::index_put_mask")
        with cause("data-dependent boolean-mask indexing"):
            indices = _long_indices(indices)
    return shim(self, indices, values, accumulate)


def equal(self, other):
    """aten.equal: same sizes and every element equal (dtypes promote, NaN is unequal to itself).

    Its result is a Python bool, so it syncs like ``.item()``: one graph cut, one value read.
    """
    if tuple(self.shape) != tuple(other.shape):
        return False
    with cause("torch.equal"):
        return bool(aten._local_scalar_dense(aten.all.default(aten.eq.Tensor(self, other))))


def linalg_check_errors(info, api_name, *, is_matrix):
    """aten._linalg_check_errors (``linalg.cholesky``, ``inv``, ``solve``, ``lu_factor`` call it
    with their factorization's ``info``): CPU's error for a failed one, as PyTorch's CUDA kernels
    raise it, by reading ``info`` (one graph cut and a transfer of its values; the ``_ex`` variants
    do not check, and do not cut). Inside a body traced once (a loop, ``torch_xla.compile``)
    nothing can be read: there the factorization is left unchecked."""
    if BODIES or info.numel() == 0:
        return
    with cause(f"{api_name}'s error check"):
        host = aten._to_copy.default(info, device="cpu")
    aten._linalg_check_errors.default(host, api_name, is_matrix=is_matrix)


def resize_(self, size, *, memory_format=None):
    """aten.resize_, as on CPU: within its storage (its offset plus the new element count
    fit), the tensor becomes the view of its storage at its offset with the new size and
    contiguous strides (``as_strided``): it still shares the storage with every view made
    before (as a new storage, writes through it stopped showing in them). Past the storage,
    the tensor is the same view of a new storage holding the old one's elements, then zeros
    (PyTorch leaves them uninitialised; CPU grows the storage itself, so views made before
    keep sharing it: here they keep the old one).
    """
    size = tuple(int(s) for s in size)
    if tuple(self.shape) == size:
        return self
    n_new = 1
    for s in size:
        n_new *= s
    n_storage = 1
    for s in self._st.value.aval[0]:
        n_storage *= s
    offset = self.storage_offset()
    mf = torch.contiguous_format if memory_format in (None, torch.preserve_format) else memory_format
    strides = torch.empty(size, device="meta", memory_format=mf).stride()
    # Called inside __torch_dispatch__: ATen overloads, not composite Tensor methods.
    if offset + n_new <= n_storage:
        self.data = views.as_strided(self, size, strides, offset)
        return self
    flat = aten.clone.default(views.as_strided(self, (n_storage,), (1,), 0))  # in the storage's order
    flat = aten.cat.default([flat, aten.new_zeros.default(flat, (offset + n_new - n_storage,))])
    if offset == 0 and strides == torch._prims_common.make_contiguous_strides_for(size):
        self.data = wrap(value_of(aten.view.default(flat, size)))  # the new storage's own tensor (out=)
    else:
        self.data = views.as_strided(flat, size, strides, offset)
    return self


def install() -> None:
    """Register the handlers (called by ``xlatorch.runtime.device.install``)."""
    RUNTIME_OPS.update(
        {
            aten.nonzero.default: nonzero,
            aten.masked_select.default: masked_select,
            aten.nonzero.out: _out(aten.nonzero.out, nonzero, "nonzero.default", lambda self: torch.int64),
            aten.masked_select.out: _out(
                aten.masked_select.out, masked_select, "masked_select.default", lambda self, mask: self.dtype
            ),
            aten.resize_.default: resize_,
            aten.equal.default: equal,
            # Asked by the ``data`` setter (resize_, out=): any two device tensors are compatible.
            aten._has_compatible_shallow_copy_type.default: lambda self, from_: True,
            aten._linalg_check_errors.default: linalg_check_errors,
        }
    )
    SHIMS[aten.index.Tensor] = functools.partial(_index, SHIMS[aten.index.Tensor])
    for op in (aten.index_put.default, aten.index_put_.default):
        if op in SHIMS:
            SHIMS[op] = functools.partial(_index_put, SHIMS[op])
