"""``torch_xla.experimental.mark_pattern_utils``: mark the inputs and outputs of a pattern
(a StableHLO composite) with ``StableHLOCompositeBuilder``.

Each mark is ``torch.ops.xla.mark_tensor``, the identity on values and gradients, carrying the
pattern's name, the tensor's position, the pattern instance's id and its attributes (JSON), so
that graph transformations (``torch.export``, Dynamo) see the boundaries. xlatorch does not
yet outline the marked region into a ``stablehlo.composite`` op in its programs: the region's
ops are inlined (the values are the same); a warning says so once per process when the marks
reach the xla device.
"""

from __future__ import annotations

import json
import uuid
import warnings

import torch

from xlatorch.runtime.trace.dispatch import RUNTIME_OPS
from xlatorch.runtime.trace.tensor import value_of, wrap

__all__ = ["StableHLOCompositeBuilder"]

_ATTR_TYPES = (str, float, int, bool)


def _serialize_attr(attr: dict | None) -> str | None:
    """``attr`` as JSON, after checking it holds what a composite's attributes can hold."""
    if attr is None:
        return None
    if not isinstance(attr, dict):
        raise ValueError("Composite attr must be a Python dictionary.")
    for k, v in attr.items():
        if not isinstance(k, str):
            raise ValueError("Composite attr name must be a Python str.")
        ok = (
            len({type(e) for e in v}) == 1 and type(v[0]) in (int, float, bool)
            if isinstance(v, (list, tuple)) and v
            else type(v) in _ATTR_TYPES
        )
        if not ok:
            raise ValueError(
                "Composite attr value must be either Python str, float, int, bool, list[int], list[float], list[bool]."
            )
    return json.dumps(attr)


@torch.library.custom_op("xla::mark_tensor", mutates_args=())
def mark_tensor(x: torch.Tensor, name: str, pos: int, id: str, is_input: bool, attr: str | None = None) -> torch.Tensor:
    """Mark ``x`` as input (or output) ``pos`` of instance ``id`` of pattern ``name``: the identity."""
    return x.clone()


mark_tensor.register_fake(lambda x, name, pos, id, is_input, attr=None: torch.empty_like(x))
mark_tensor.register_autograd(lambda ctx, grad: (grad, None, None, None, None, None))
_WARNED = []


def _mark_on_device(x, name, pos, id, is_input, attr=None):
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"xlatorch does not build StableHLO composites in its programs yet: the ops of pattern "
                      f"'{name}' are inlined (values unchanged)", stacklevel=3)  # fmt: skip
    return wrap(value_of(x))  # a new tensor on the same value: the identity, no node


RUNTIME_OPS[torch.ops.xla.mark_tensor.default] = _mark_on_device


class StableHLOCompositeBuilder:
    """Marks the input and output tensors of one instance of a pattern (a StableHLO composite).

    Args:
      name: the composite op's name.
      attr: its attributes (str, float, int, bool, or lists of one of int / float / bool).
    """

    def __init__(self, name: str, attr: dict | None = None):
        self.name, self.attr = name, attr
        self.id = uuid.uuid4().hex
        _serialize_attr(attr)  # a bad attribute is an error here, not at mark_outputs

    def _mark(self, tensors, is_input: bool):
        attr = None if is_input else _serialize_attr(self.attr)
        marked = []
        for pos, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"input must be a torch tensor. Got {type(t)}.")
            marked.append(torch.ops.xla.mark_tensor(t, name=self.name, pos=pos, id=self.id, is_input=is_input,
                                                    attr=attr))  # fmt: skip
        return marked[0] if len(marked) == 1 else tuple(marked)

    def mark_inputs(self, *tensors: torch.Tensor):
        """Mark the composite's inputs (once per builder); use the returned tensors in their place."""
        return self._mark(tensors, is_input=True)

    def mark_outputs(self, *tensors: torch.Tensor):
        """Mark the composite's outputs (once per builder); use the returned tensors in their place."""
        return self._mark(tensors, is_input=False)
