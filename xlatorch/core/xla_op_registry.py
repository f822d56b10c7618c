"""``torch_xla.core.xla_op_registry``: a PyTorch operation on xla tensors whose lowering is
written with the XLA op builder (``xla_builder.Op``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from xlatorch.core import xla_builder as xb

__all__ = ["Op", "register"]


class Op:
    """The operation ``name`` lowered by ``opfn(*ops, **kwargs)`` (Ops in, an Op or a tuple of
    them out), built once per input shapes and keyword arguments."""

    def __init__(self, name: str, opfn: Callable):
        self._name, self._opfn = name, opfn
        self._opname = "xla::_op_" + name
        self._lock = threading.Lock()
        self._computations: dict = {}

    def __call__(self, *args, **kwargs):
        """Run on xla tensors ``args`` (keyword arguments are Python constants of the lowering):
        one node of the lazy graph; one tensor, or a list of them for several results."""
        shapes = xb.tensor_shape(args)
        key = (tuple((s.dtype, s.sizes) for s in shapes), repr(sorted(kwargs.items())))
        with self._lock:
            computation = self._computations.get(key)
            if computation is None:
                computation = xb.create_computation(self._name, self._opfn, shapes, **kwargs)
                self._computations[key] = computation
        result = xb.xla_computation_as_func(computation, self._opname)(list(args))
        return result[0] if len(result) == 1 else result


def register(name: str, opfn: Callable) -> Op:
    """A PyTorch operation ``name`` whose XLA lowering is ``opfn`` (see ``Op``)."""
    return Op(name, opfn)
