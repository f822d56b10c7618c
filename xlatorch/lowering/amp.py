"""Loss-scaling lowerings for ``torch.amp.GradScaler``: unscaling with an inf/NaN check, and
the scale update. Both stay on the device: ``found_inf`` is a device value, never read by
the host, so a step with an overflow is skipped by a select in the graph.
"""

from __future__ import annotations

import jax.numpy as jnp


def non_finite_check_and_unscale(out, self, found_inf, inv_scale):
    """``_amp_foreach_non_finite_check_and_unscale_``: each gradient times ``inv_scale``; ``found_inf``
    becomes 1 if any gradient holds an inf or NaN (and keeps its value otherwise).

    Returns the new gradients followed by the new ``found_inf``. Half-precision gradients are
    multiplied in float32 and rounded once, as PyTorch's CPU and CUDA kernels do.
    """
    found = found_inf
    grads = []
    for g in self:
        found = jnp.where(jnp.all(jnp.isfinite(g)), found, jnp.ones_like(found))
        acc = g.astype(jnp.float32) if g.dtype in (jnp.float16, jnp.bfloat16) else g
        grads.append((acc * inv_scale.astype(acc.dtype)).astype(g.dtype))
    return [*grads, found]


def update_scale(out, self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    """``_amp_update_scale_``: back the scale off after an overflow, grow it after
    ``growth_interval`` clean steps in a row (only to a finite value); count clean steps.

    Returns the new scale and the new growth tracker.
    """
    found = found_inf != 0
    clean = growth_tracker + 1
    grow = clean == growth_interval
    grown = (self * scale_growth_factor).astype(self.dtype)
    backed = (self * scale_backoff_factor).astype(self.dtype)
    scale = jnp.where(found, backed, jnp.where(grow & jnp.isfinite(grown), grown, self))
    tracker = jnp.where(found | grow, jnp.zeros_like(growth_tracker), clean.astype(growth_tracker.dtype))
    return scale, tracker
