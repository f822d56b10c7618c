"""Helpers of FSDP: activation checkpointing of a module, and ``nn.Linear`` that saves its weight.

``checkpoint_module(m)`` makes ``m``'s forward run under ``xlatorch.utils.checkpoint``: its
activations are computed again in the backward instead of being kept.

``apply_xla_patch_to_nn_linear(m)``: PyTorch's linear saves ``weight.t()`` (a new view) for its
backward. FSDP recognises the gathered weights it hands to a module by identity when autograd
saves them (to drop them after the forward and gather them again in the backward), so every
``nn.Linear`` under an FSDP unit runs ``_LinearSavingWeight``, which saves the weight itself.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F

from xlatorch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_module", "apply_xla_patch_to_nn_linear", "XLAPatchedLinear"]


def checkpoint_module(module: nn.Module) -> nn.Module:
    """``module`` with its forward activation-checkpointed (returns the same module).

    Keyword arguments are passed through as positional ones (``checkpoint`` takes positional
    arguments only). When no tensor argument requires grad the forward runs as is: there is no
    backward through the inputs for ``checkpoint`` to hang the recomputation on.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_module takes an nn.Module, got {type(module).__name__}")
    original = module.forward

    def run(nargs, keys, *flat):
        return original(*flat[:nargs], **dict(zip(keys, flat[nargs:])))

    def forward(self, *args, **kwargs):
        flat = args + tuple(kwargs.values())
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return original(*args, **kwargs)
        return checkpoint(run, len(args), tuple(kwargs), *flat)

    module._xla_checkpointed_forward_original = original
    module.forward = MethodType(forward, module)
    return module


class XLAPatchedLinear(torch.autograd.Function):
    """``F.linear`` whose backward keeps ``weight`` itself (not a transposed view of it)."""

    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        gi = gw = gb = None
        if ctx.needs_input_grad[0]:
            gi = grad @ weight
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = g2.t() @ input.reshape(-1, input.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gi, gw, gb


def _patched_forward(self, input):
    if torch.is_autocast_enabled(input.device.type):  # autocast saves its own cast copy anyway
        return F.linear(input, self.weight, self.bias)
    return XLAPatchedLinear.apply(input, self.weight, self.bias)


def apply_xla_patch_to_nn_linear(module: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` in ``module`` (itself included) whose forward is ``nn.Linear``'s runs
    ``XLAPatchedLinear``. Returns ``module``."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and getattr(m.forward, "__func__", None) is nn.Linear.forward:
            m.forward = MethodType(_patched_forward, m)
    return module
