"""``gradient_accumulation``: a training step over micro-batches as one XLA loop.

Each iteration runs the user's ``train_step`` on one micro-batch and differentiates its loss
(divided by the number of micro-batches) with respect to the model's parameters on the
device; the loop carries the summed loss and gradients. Compiled once, whatever the number
of micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xlatorch.runtime.trace import bodies, loops
from xlatorch.runtime.trace.bodies import BodyError
from xlatorch.runtime.trace.tensor import value_of, wrap

__all__ = ["gradient_accumulation"]


def gradient_accumulation(
    train_step: Callable, iterable_tensors: tuple[torch.Tensor, ...], model: torch.nn.Module, *carried_tensors
):
    """Accumulate the gradients of ``train_step`` over the leading dimension of ``iterable_tensors``.

    Args:
      train_step: ``(*micro-batch slices, *carried) -> loss`` or ``(loss, *new carried)``;
        traced once.
      iterable_tensors: xla tensors sharing their leading dimension (the micro-batches).
      model: its parameters that require grad get the accumulated gradients (added to
        ``.grad`` when it is set), as ``loss.backward()`` per micro-batch would.
      carried_tensors: tensors carried from one micro-batch to the next.

    Returns:
      The mean of the micro-batches' losses, followed by the final carried tensors if any.
    """
    if not iterable_tensors:
        raise ValueError("iterable_tensors cannot be empty")
    steps = iterable_tensors[0].size(0)
    for i, t in enumerate(iterable_tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Element {i} of iterable_tensors is not a tensor")
        if t.numel() == 0:
            raise ValueError(f"Element {i} of iterable_tensors is empty")
        if t.size(0) != steps:
            raise ValueError(f"Element {i} of iterable_tensors has inconsistent first dimension")
    params = [p for p in model.parameters() if p.requires_grad]
    carried = list(carried_tensors)
    device = iterable_tensors[0].device
    loss0 = torch.zeros((), dtype=torch.float32, device=device)
    init = [loss0] + [torch.zeros_like(p) for p in params] + carried
    n_init, n_par = len(init), len(params)
    xs = list(iterable_tensors)
    avals = bodies.avals_of(init) + [(tuple(t.shape[1:]), t.dtype) for t in xs]

    def body(ts):
        loss_sum, grads_sum = ts[0], ts[1 : 1 + n_par]
        with torch.enable_grad():
            res = train_step(*ts[n_init:], *ts[1 + n_par : n_init])
            loss, *new = res if isinstance(res, (tuple, list)) else (res,)
            if len(new) != len(carried):
                raise BodyError(f"xlatorch: train_step returned {len(new)} carried tensors for {len(carried)}")
            loss = loss / steps
            got = torch.autograd.grad(loss, params, allow_unused=True) if params else ()
        grads = [s if g is None else s + g for s, g in zip(grads_sum, got)]
        return [loss_sum + loss.detach().float(), *grads, *[t.detach() for t in new]]

    # The micro-batches and carried tensors are the user's: train_step may not write them.
    b, captured, _ = bodies.trace_body(
        body, avals, "the body of gradient_accumulation", frozen=range(1 + n_par, len(avals))
    )
    outs = [
        wrap(o)
        for o in loops.scan(
            b, captured, [value_of(t) for t in init], bodies.values_of(xs, "gradient_accumulation"), steps
        )
    ]
    loss, grads, carried_out = outs[0], outs[1 : 1 + n_par], outs[1 + n_par : n_init]
    with torch.no_grad():
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
    return (loss, *carried_out) if carried else loss
