"""Tensors handled in batches: ``ToXlaTensorArena`` converts every selected tensor of a nested
structure with one call, ``CoalescingBuckets`` runs a collective over buckets of tensors
(torch_xla's ``xm.ToXlaTensorArena`` and ``xm.CoalescingBuckets``; ``xm`` re-exports both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["ToXlaTensorArena", "CoalescingBuckets"]


class ToXlaTensorArena:
    """Replace the values of a structure that ``select_fn`` picks with what ``convert_fn``
    makes of all of them at once (one list in, one list out, same order): one transfer or one
    sync for every tensor instead of one each.

    Args:
      convert_fn: list of the selected values -> list of their replacements.
      select_fn: which values to replace.
    """

    def __init__(self, convert_fn: Callable[[list], list], select_fn: Callable[[Any], bool]):
        self._convert_fn = convert_fn
        self._select_fn = select_fn
        self._tensors: list = []

    def transform(self, inputs: Any) -> Any:
        """``inputs`` with each selected value replaced; containers (lists, tuples, dicts,
        namedtuples) are rebuilt as ``torch.utils._pytree`` rebuilds them. A value reached
        twice is converted once."""
        index: dict = {}  # id -> position in the batch (values stay alive in self._tensors)
        self._tensors = []

        def collect(v):
            if self._select_fn(v) and id(v) not in index:
                index[id(v)] = len(self._tensors)
                self._tensors.append(v)
            return v

        tree_map(collect, inputs)
        converted = list(self._convert_fn(self._tensors)) if self._tensors else []
        if len(converted) != len(self._tensors):
            raise ValueError(f"xlatorch: ToXlaTensorArena's convert_fn returned {len(converted)} values for "
                             f"{len(self._tensors)} inputs")  # fmt: skip
        return tree_map(lambda v: converted[index[id(v)]] if id(v) in index else v, inputs)


class CoalescingBuckets:
    """Run ``func`` over ``input_list`` in buckets of about ``bucket_cap_mb`` MB: a bucket of
    one tensor is passed as the tensor (the uncoalesced collective), a larger one as a list;
    with ``output_list``, each call also gets the outputs of its bucket's tensors. Calling the
    object returns one result per input tensor, in order.

    A tensor larger than the cap joins a bucket holding less than half the cap when the two
    stay within twice the cap, and that bucket is flushed; otherwise a bucket is flushed when
    the next tensor would take it past the cap (torch_xla's rule, so the collectives have the
    same sizes).
    """

    def __init__(self, func: Callable, input_list: list, output_list: list | None = None,
                 bucket_cap_mb: int = 160):  # fmt: skip
        if not isinstance(input_list, list) or any(not isinstance(v, torch.Tensor) for v in input_list):
            raise TypeError(f"`input_list` needs to be a list of Tensors, but given {type(input_list)}.")
        if output_list is not None:
            if not isinstance(output_list, list) or any(not isinstance(v, torch.Tensor) for v in output_list):
                raise TypeError(f"`output_list` needs to be a list of Tensors, but given {type(output_list)}.")
            if len(output_list) != len(input_list):
                raise ValueError(f"`output_list` length doesn't match `input_list` length: {len(output_list)} vs "
                                 f"{len(input_list)}.")  # fmt: skip
        self._func = func
        self._input_list = input_list
        self._output_list = output_list
        self._bucket_cap = bucket_cap_mb * 1024 * 1024
        self._total = 0
        self._tensor_bucket: list = []
        self._output_bucket: list | None = [] if output_list else None
        self._out_tensors: list = []

    def flush(self) -> None:
        """Run ``func`` on the current bucket (if any) and start a new one."""
        if len(self._tensor_bucket) == 1:
            out = self._output_bucket[0] if self._output_bucket else None
            self._out_tensors.append(self._func(self._tensor_bucket[0], out))
        elif self._tensor_bucket:
            self._out_tensors.extend(self._func(self._tensor_bucket, self._output_bucket))
        self._total = 0
        self._tensor_bucket = []
        self._output_bucket = [] if self._output_list else None

    def add(self, tensor: torch.Tensor, idx: int) -> None:
        """Put input ``idx`` (``tensor``) into the current bucket."""
        self._total += tensor.numel() * tensor.element_size()
        self._tensor_bucket.append(tensor)
        if self._output_list is not None:
            self._output_bucket.append(self._output_list[idx])

    def __call__(self) -> list:
        for idx, tensor in enumerate(self._input_list):
            size = tensor.numel() * tensor.element_size()
            total = self._total + size
            if size > self._bucket_cap and self._total < 0.5 * self._bucket_cap and total <= 2 * self._bucket_cap:
                self.add(tensor, idx)
                self.flush()
            else:
                if total > self._bucket_cap:
                    self.flush()
                self.add(tensor, idx)
        self.flush()
        if len(self._out_tensors) != len(self._input_list):
            raise RuntimeError(f"xlatorch: CoalescingBuckets' func returned {len(self._out_tensors)} results for "
                               f"{len(self._input_list)} inputs")  # fmt: skip
        return self._out_tensors
