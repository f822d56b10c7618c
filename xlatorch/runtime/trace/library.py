"""Custom ops in the ``xla`` namespace (torch_xla's ``xm.XLA_LIB``) whose ``XLA`` kernels run
on xla tensors.

torch_xla registers a custom op's device kernel under the ``XLA`` dispatch key. xla tensors
here are Python-dispatched (``__torch_dispatch__``) and never reach that key, so a kernel
registered for it is also entered in the dispatch table of hand-written handlers: given xla
tensors it runs on them and records its ops into the lazy graph, as torch_xla's does.
"""

from __future__ import annotations

import torch

from xlatorch.runtime.trace.dispatch import RUNTIME_OPS

__all__ = ["XlaLibrary"]


class XlaLibrary(torch.library.Library):
    """A ``torch.library.Library`` (here in namespace ``xla``, kind ``DEF``): ``define`` op
    schemas, ``impl`` their kernels. A kernel for the ``XLA`` key (or ``PrivateUse1``, the
    key the xla device has here) is the op's kernel for xla tensors."""

    def impl(self, op_name, fn, dispatch_key: str = "", *args, **kwargs):
        super().impl(op_name, fn, dispatch_key, *args, **kwargs)
        if dispatch_key in ("XLA", "PrivateUse1") and fn is not None:
            name = op_name if isinstance(op_name, str) else op_name.name()
            name = name.split("::")[-1]
            base, _, overload = name.partition(".")
            RUNTIME_OPS[getattr(getattr(getattr(torch.ops, self.ns), base), overload or "default")] = fn
