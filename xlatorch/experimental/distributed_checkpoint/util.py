"""``prime_optimizer``: give an optimizer its state before a checkpoint is loaded into it."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

import xlatorch.core.xla_model as xm
from xlatorch.runtime.multi import sharding as _sh
from xlatorch.runtime.trace.tensor import XlaTensor

__all__ = ["prime_optimizer"]


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Run one optimizer step with zero gradients so that its state exists.

    Distributed checkpoints load in place, and an optimizer creates its state (momentum,
    Adam's moments) on its first step: call this just before ``restore`` / ``dist_cp.load``.
    It changes the parameters (weight decay) and the state, which the load then replaces.
    A sharded parameter's zero gradient is sharded like it, so the state comes out sharded
    like the parameter. Syncs twice.
    """
    xm.mark_step()
    xm.wait_device_ops()

    def zero_grad(p):
        if isinstance(p, torch.Tensor) and p.requires_grad:
            p.grad = torch.zeros_like(p, requires_grad=False)
            if type(p) is XlaTensor and _sh.is_spmd():
                s = _sh.sharding_of(p)
                if s is not None and not s.is_fully_replicated:
                    _sh.annotate(p.grad, s)
        return p

    tree_map(zero_grad, optimizer.param_groups)
    optimizer.step()
    xm.mark_step()
    xm.wait_device_ops()
    return optimizer
