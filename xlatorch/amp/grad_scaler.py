"""``xlatorch.amp.GradScaler``: ``torch.amp.GradScaler`` on the device, without host syncs.

PyTorch's scaler reads ``found_inf`` on the host (``.item()``) to decide whether to call
``optimizer.step()``: on a lazy device that is a graph cut and a wait every step. Here the
unscale/inf check (``_amp_foreach_non_finite_check_and_unscale_``) and the scale update
(``_amp_update_scale_``) are lowered ops (``ops.yaml``), and an optimizer whose ``step``
takes ``found_inf`` (``xlatorch.amp.syncfree``) gets the flag as a device tensor and skips
the update with a select in the graph.
"""

from __future__ import annotations

import inspect

import torch

from xlatorch.runtime.base.topology import world_size
from xlatorch.runtime.trace.collectives import all_reduce

__all__ = ["GradScaler"]


def takes_found_inf(optimizer) -> bool:
    """Whether ``optimizer.step`` accepts ``found_inf`` (a sync-free optimizer)."""
    return "found_inf" in inspect.signature(optimizer.step).parameters


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for the ``xla`` device (arguments as PyTorch's, ``device`` fixed).

    ``scale``, ``unscale_`` and ``update`` never sync. ``step`` never syncs with a sync-free
    optimizer (``xlatorch.amp.syncfree.SGD/Adam/AdamW``): it passes ``found_inf`` (a device
    tensor, summed over replicas in a multi-replica job) and the optimizer skips the update on
    the device. With any other optimizer ``step`` is PyTorch's: one ``.item()`` per step.

    Args:
      init_scale: initial scale factor.
      growth_factor: factor the scale grows by after ``growth_interval`` clean steps.
      backoff_factor: factor the scale shrinks by after a step with an inf or NaN gradient.
      growth_interval: clean steps in a row before the scale grows.
      enabled: ``False`` makes every method a no-op (as PyTorch's).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:  # fmt: skip
        super().__init__("xla", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)  # fmt: skip

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        if not takes_found_inf(optimizer):
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        found_inf = sum(optimizer_state["found_inf_per_device"].values())
        if world_size() > 1:  # every replica skips the same steps
            found_inf = all_reduce("sum", found_inf)
        return optimizer.step(*args, found_inf=found_inf, **kwargs)
