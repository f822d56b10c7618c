"""``syncfree.SGD``, ``Adam``, ``AdamW``: PyTorch's update, skipped on the device when ``found_inf`` is set.

Each is the ``torch.optim`` class itself (same hyperparameters, defaults, state and
``state_dict``), so on finite gradients the update is PyTorch's. ``step(found_inf=t)`` runs
that update, then keeps, for every parameter and state tensor, the old value where
``t != 0`` (``torch.where``: a select in the step's graph, so NaN/inf updates never leak).
State created by a skipped first step is zeros (Adam's moments and step count are then
exactly as if no step had run; SGD's momentum buffer too when ``dampening`` is 0, the
default: PyTorch starts the buffer at the gradient, zeros plus an undamped gradient give
the same).

Adam and AdamW default to ``capturable=True``: their step count stays on the device, so a
skipped step does not count and bias correction needs no host value.
"""

from __future__ import annotations

import torch

__all__ = ["SGD", "Adam", "AdamW"]


class _SkipOnInf:
    """Adds ``found_inf`` to a ``torch.optim`` optimizer's ``step``."""

    def step(self, closure=None, found_inf: torch.Tensor | None = None):
        """One update; skipped on the device where ``found_inf`` is non-zero. Never syncs.

        Args:
          closure: re-evaluates the model and returns the loss (as in ``torch.optim``).
          found_inf: a device scalar from ``GradScaler``; ``None`` runs the plain update.

        Returns:
          The closure's loss, or None.
        """
        if found_inf is None:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            before = {}
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        state = self.state.get(p, {})
                        before[p] = (p.clone(), {k: v.clone() for k, v in state.items() if torch.is_tensor(v)})
            super().step()
            skip = found_inf != 0
            for p, (old, old_state) in before.items():
                p.copy_(torch.where(skip, old, p))
                for k, v in self.state.get(p, {}).items():  # .get: no empty state where PyTorch keeps none
                    if torch.is_tensor(v):
                        v.copy_(torch.where(skip, old_state[k] if k in old_state else torch.zeros_like(v), v))
        return loss


class SGD(_SkipOnInf, torch.optim.SGD):
    """``torch.optim.SGD`` whose ``step`` takes ``found_inf`` (see the module docstring)."""


class Adam(_SkipOnInf, torch.optim.Adam):
    """``torch.optim.Adam`` whose ``step`` takes ``found_inf``; ``capturable`` defaults to True."""

    def __init__(self, params, *args, capturable: bool = True, **kwargs):
        super().__init__(params, *args, capturable=capturable, **kwargs)


class AdamW(_SkipOnInf, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` takes ``found_inf``; ``capturable`` defaults to True."""

    def __init__(self, params, *args, capturable: bool = True, **kwargs):
        super().__init__(params, *args, capturable=capturable, **kwargs)
