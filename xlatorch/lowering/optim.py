"""Fused optimizer steps (``torch.optim.AdamW(fused=True)``, Hugging Face ``Trainer``'s default):
every parameter's update in the step's graph, as PyTorch's fused kernels compute it.
"""

from __future__ import annotations

import jax.numpy as jnp


def fused_adamw(out, self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):  # fmt: skip
    """``_fused_adamw_``: AdamW on each parameter (decoupled weight decay, bias-corrected moments,
    ``amsgrad`` keeping the largest second moment), with ``state_steps`` already counting this
    step. ``grad_scale`` unscales the gradients (written back); a set ``found_inf`` skips the
    whole step, as the kernel does.

    Returns the new parameters, gradients, first moments, second moments and (``amsgrad``) the
    largest second moments, each list in order."""
    params, new_grads, m1s, m2s, maxes = [], [], [], [], []
    for i, (p, g, m, v, step) in enumerate(zip(self, grads, exp_avgs, exp_avg_sqs, state_steps)):
        dt = p.dtype
        calc = jnp.float32 if dt in (jnp.float16, jnp.bfloat16) else dt
        gc = g.astype(calc)
        if grad_scale is not None:
            gc = gc / grad_scale.astype(calc)
        new_g = gc.astype(g.dtype)
        if maximize:
            gc = -gc
        step = step.astype(jnp.float64)
        bc1 = 1 - jnp.power(jnp.asarray(beta1, jnp.float64), step)
        bc2_sqrt = jnp.sqrt(1 - jnp.power(jnp.asarray(beta2, jnp.float64), step))
        step_size = jnp.asarray(lr / bc1).astype(calc)
        pc = p.astype(calc)
        pc = pc - jnp.asarray(lr * weight_decay).astype(calc) * pc  # decoupled weight decay
        mc = m.astype(calc)
        mc = mc + (1 - jnp.asarray(beta1, calc)) * (gc - mc)
        vc = v.astype(calc) * jnp.asarray(beta2, calc) + (1 - jnp.asarray(beta2, calc)) * gc * gc
        if amsgrad:
            mx = jnp.maximum(max_exp_avg_sqs[i].astype(calc), vc)
            denom = jnp.sqrt(mx) / bc2_sqrt.astype(calc) + jnp.asarray(eps, calc)
            maxes.append(mx)
        else:
            denom = jnp.sqrt(vc) / bc2_sqrt.astype(calc) + jnp.asarray(eps, calc)
        pc = pc - step_size * mc / denom
        params.append(pc.astype(dt))
        new_grads.append(new_g)
        m1s.append(mc.astype(m.dtype))
        m2s.append(vc.astype(v.dtype))
    maxes = [x.astype(o.dtype) for x, o in zip(maxes, max_exp_avg_sqs)] if amsgrad else list(max_exp_avg_sqs)
    outs = [params, new_grads, m1s, m2s, maxes]
    if found_inf is not None:  # an overflow: nothing changes (grads are still unscaled)
        skip = jnp.asarray(found_inf).reshape(()) != 0
        old = [list(self), None, list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs)]
        outs = [new if prev is None else [jnp.where(skip, a, b) for a, b in zip(prev, new)]
                for new, prev in zip(outs, old)]  # fmt: skip
    return [x for group in outs for x in group]
