"""In-place view ops (``t_``, ``transpose_``, ``squeeze_``, ``unsqueeze_``, ``as_strided_``).

An in-place view op changes the tensor's own shape: the tensor is rebound to the
functional view of its storage (``t_`` becomes ``t``), so it keeps aliasing its base
and every other view, and later writes through it scatter into the shared storage.
"""

from __future__ import annotations

import torch

from xlatorch.runtime.trace.dispatch import RUNTIME_OPS

__all__ = ["install"]

aten = torch.ops.aten


def _rebind(functional):
    def inplace_view(self, *args, **kwargs):
        # Called inside __torch_dispatch__ (below autograd): ATen overloads only.
        self.data = functional(self, *args, **kwargs)  # XlaTensor.data: metadata and storage
        return self

    inplace_view.__name__ = functional.__name__ + "_inplace"
    return inplace_view


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
            aten.as_strided_.default: _rebind(aten.as_strided.default),
            # The autograd layer above does the detaching; the tensor itself is unchanged.
            aten.detach_.default: lambda self: self,
        }
    )
