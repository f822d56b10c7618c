"""``fori_loop`` and ``while_loop`` on xla tensors: one XLA while loop whose body is compiled once.

PyTorch's own ``torch._higher_order_ops.while_loop`` on xla tensors lowers the same way
(``runtime/trace/loops.py`` registers it when xlatorch is imported).
"""

from __future__ import annotations

import torch
from torch._higher_order_ops.while_loop import while_loop as _torch_while_loop

from xlatorch.runtime.trace import loops

__all__ = ["fori_loop", "while_loop"]


def fori_loop(lower, upper, body_fun, *input_value):
    """``input_value = body_fun(*input_value)`` for ``upper - lower`` iterations, as one XLA loop.

    Args:
      lower, upper: the bounds (ints or one-element integer xla tensors).
      body_fun: ``(*values) -> values`` (a tensor or a tuple of them), traced once.
      input_value: the initial values (xla tensors).

    Returns:
      ``(remaining iterations (0), *final values)``, as torch_xla returns them.
    """
    device = next((t.device for t in input_value if isinstance(t, torch.Tensor)), torch.device("xla"))
    count = upper - lower
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(int(count), dtype=torch.int64, device=device)

    def cond_fn(i, *values):
        return i > 0

    def body_fn(i, *values):
        res = body_fun(*values)
        return (i - 1, *(res if isinstance(res, (tuple, list)) else (res,)))

    return loops.run_while(cond_fn, body_fn, (count, *input_value), name="fori_loop")


def while_loop(cond_fn, body_fn, carried_inputs):
    """PyTorch's ``while_loop``: ``carried = body_fn(*carried)`` while ``cond_fn(*carried)``
    holds, lowered on xla tensors to one XLA while loop."""
    return _torch_while_loop(cond_fn, body_fn, carried_inputs)
