"""``torch_xla.experimental.mark_pattern_utils``: mark the inputs and outputs of a pattern
(a StableHLO composite) with ``StableHLOCompositeBuilder``.

Each mark is ``torch.ops.xla.mark_tensor``, the identity on values and gradients, carrying the
pattern's name, the tensor's position, the pattern instance's id and its attributes (JSON), so
that graph transformations (``torch.export``, Dynamo) see the boundaries. On xla tensors,
marking the outputs outlines the ops between the marked inputs and them into one node lowered
to ``stablehlo.composite`` (``jax.lax.composite``: the name, the attributes, and the region as
its decomposition), which XLA inlines where it has no special lowering for it. Values the
region reads that were not marked as inputs are operands of the composite too; the region's
on-device checks (index bounds) are computed beside it.
"""

from __future__ import annotations

import json
import uuid

import jax
import numpy as np
import torch

from xlatorch.runtime.trace import bodies, loops
from xlatorch.runtime.trace.dispatch import RUNTIME_OPS
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, wrap

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
# The composite's outputs of a builder whose outputs are being marked: {builder id: [Out]}.
_OUTLINED: dict = {}


def _mark_on_device(x, name, pos, id, is_input, attr=None):
    outs = None if is_input else _OUTLINED.get(id)
    return wrap(outs[pos] if outs else value_of(x))  # a new tensor: the composite's output, or x's value


RUNTIME_OPS[torch.ops.xla.mark_tensor.default] = _mark_on_device


def _jax_attr(v):
    if isinstance(v, (list, tuple)):
        kind = type(v[0])
        return np.asarray(v, np.float32 if kind is float else np.int64 if kind is int else np.bool_)
    if isinstance(v, bool) or isinstance(v, str):
        return v
    return np.float32(v) if isinstance(v, float) else np.int64(v)


def _run_composite(ops, body, name, attrs, found):
    if found is not None and body.checked:
        # The region's on-device checks (index bounds) are computed beside the composite, whose
        # results stay the pattern's own; XLA drops the rest of that copy (its values are unused).
        body.run(list(ops), found)

    def decomposition(*xs, **_):
        return tuple(body.run(list(xs)))

    return list(jax.lax.composite(decomposition, name)(*ops, **{k: _jax_attr(v) for k, v in attrs}))


_COMPOSITE = loops._spec("xlatorch::composite", _run_composite, ("body", "name", "attr"))


def _outline(name: str, attr: dict | None, inputs: list, outputs: list) -> list:
    """The outputs of the composite node computing ``outputs`` (values) from ``inputs``."""
    body, captured = bodies.body_of(outputs, inputs, f"the composite {name}")
    ops = (*inputs, *captured)
    attrs = tuple(sorted((attr or {}).items()))
    attrs = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs)
    sig = (tuple(v.sig for v in ops), body, name, attrs)
    return loops._make(_COMPOSITE, (ops, body, name, attrs), sig, body.avals, body.checked)


class StableHLOCompositeBuilder:
    """Marks the input and output tensors of one instance of a pattern (a StableHLO composite).

    Args:
      name: the composite op's name.
      attr: its attributes (str, float, int, bool, or lists of one of int / float / bool).
    """

    def __init__(self, name: str, attr: dict | None = None):
        self.name, self.attr = name, attr
        self.id = uuid.uuid4().hex
        self._inputs: list = []
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
        marked = self._mark(tensors, is_input=True)
        as_tuple = marked if isinstance(marked, tuple) else (marked,)
        if all(type(t) is XlaTensor for t in as_tuple):
            self._inputs = [value_of(t) for t in as_tuple]
        return marked

    def mark_outputs(self, *tensors: torch.Tensor):
        """Mark the composite's outputs (once per builder); use the returned tensors in their place.
        On xla tensors whose inputs were marked: the ops between are outlined into one
        ``stablehlo.composite`` node (no sync)."""
        if self._inputs and tensors and all(type(t) is XlaTensor for t in tensors):
            _OUTLINED[self.id] = _outline(self.name, self.attr, self._inputs, [value_of(t) for t in tensors])
        try:
            return self._mark(tensors, is_input=False)
        finally:
            _OUTLINED.pop(self.id, None)
