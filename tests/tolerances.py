"""Tolerances from what an algorithm can amplify, not from the figure one machine gave.

CPU PyTorch and XLA add in different orders (and XLA's order differs between processors), so
the gradients of the same step differ by rounding: by up to about ``NOISE`` times the largest
element of the tensor's gradient. Plain SGD passes that on unamplified. An adaptive optimizer
(Adam, AdamW, RMSprop, Adagrad, ...) divides each element's gradient by its own running
magnitude, so the relative error of an element's step is its gradient's, ``NOISE * max|g| / |g|``,
and an element whose gradient is as small as the noise (a true gradient of zero, a sum that
cancels) takes a full step of either sign whatever the noise was: up to twice the largest step
of its tensor apart. ``AdaptiveSteps`` records those figures on the CPU reference run and turns
them into one tolerance per element.
"""

from __future__ import annotations

import torch

# A float32 gradient is a sum (over the batch, the features, the positions) whose order the
# backends choose: its rounding is bounded by (number of terms) * eps * (largest term) and is
# about sqrt(terms) * eps in practice. The tests' sums have up to a few thousand terms.
NOISE = 64 * torch.finfo(torch.float32).eps


class AdaptiveSteps:
    """Records each parameter's gradient and step on the CPU reference run of an adaptive
    optimizer; ``assert_close`` compares another run's parameters with a tolerance per element.

    Call ``before(params)`` after ``backward()`` and ``after(params)`` after ``opt.step()``.
    """

    def __init__(self, rtol: float = 1e-4, atol: float = 1e-5):
        self.rtol, self.atol = rtol, atol
        self.grads: list[list[torch.Tensor | None]] = []
        self._old: list[torch.Tensor] = []
        self.steps: list[list[torch.Tensor]] = []

    def before(self, params) -> None:
        params = list(params)
        self.grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
        self._old = [p.detach().clone() for p in params]

    def after(self, params) -> None:
        self.steps.append([p.detach() - o for p, o in zip(params, self._old)])

    def bound(self, i: int) -> torch.Tensor:
        """How far parameter ``i`` of another float32 run may be from the reference's, per element."""
        total = torch.zeros_like(self.steps[0][i])
        for grads, steps in zip(self.grads, self.steps):
            g, step = grads[i], steps[i]
            if g is None:
                continue
            largest = step.abs().max()
            noise = NOISE * g.abs().max()
            relative = noise / g.abs().clamp_min(torch.finfo(g.dtype).tiny)  # the step's relative error
            total += largest * torch.clamp(relative, max=2.0)
        return total

    def assert_close(self, got_params, want_params, names=None) -> None:
        """Every element within ``atol + rtol * |want| + bound``; the message names the worst."""
        for i, (got, want) in enumerate(zip(got_params, want_params)):
            got, want = got.detach().cpu(), want.detach()
            allowed = self.atol + self.rtol * want.abs() + self.bound(i)
            err = (got - want).abs()
            if not bool((err <= allowed).all()):
                k = int(torch.argmax(err - allowed))
                name = names[i] if names else f"parameter {i}"
                raise AssertionError(
                    f"{name}: element {k} is {got.flatten()[k].item()!r}, want {want.flatten()[k].item()!r} "
                    f"(difference {err.flatten()[k].item():.3g}, allowed {allowed.flatten()[k].item():.3g}; "
                    f"{int((err > allowed).sum())} of {err.numel()} elements outside)"
                )

    def margin(self, got_params, want_params) -> float:
        """The largest share of its tolerance any element uses (below 1 passes)."""
        worst = 0.0
        for i, (got, want) in enumerate(zip(got_params, want_params)):
            got, want = got.detach().cpu(), want.detach()
            allowed = self.atol + self.rtol * want.abs() + self.bound(i)
            worst = max(worst, float(((got - want).abs() / allowed).max()))
        return worst


def recorded_step(opt, params, record=None) -> None:
    """``opt.step()``, with ``record`` (an ``AdaptiveSteps``, or None) seeing ``params`` before
    and after it."""
    params = list(params)
    if record:
        record.before(params)
    opt.step()
    if record:
        record.after(params)
