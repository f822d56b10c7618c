"""``torch_xla.experimental.callback``: run host code once a tensor's value exists."""

from __future__ import annotations

import threading

import torch

from xlatorch.core import step_closures

__all__ = ["on_ready_callback", "on_ready_event"]


def _ready(tensor) -> bool:
    from xlatorch.runtime.ir.values import Out
    from xlatorch.runtime.trace.tensor import value_of

    return type(value_of(tensor)) is not Out


def on_ready_callback(tensor: torch.Tensor, callback) -> None:
    """Call ``callback(tensor)`` once ``tensor`` is computed: on a background thread now if
    it already is, else after the step that computes it (``xm.mark_step`` / a sync), from
    that step's closures. Does not sync."""
    if tensor.device.type != "xla" or _ready(tensor):
        threading.Thread(target=callback, args=(tensor,), daemon=True).start()
    else:
        step_closures.add(callback, (tensor,), run_async=True)


def on_ready_event(tensor: torch.Tensor) -> threading.Event:
    """A ``threading.Event`` set once ``tensor`` is computed (``on_ready_callback``)."""
    event = threading.Event()
    on_ready_callback(tensor, lambda _: event.set())
    return event
