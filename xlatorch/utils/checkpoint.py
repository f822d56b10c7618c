"""Activation checkpointing on the xla device (``torch_xla.utils.checkpoint``).

``checkpoint(fn, *args)`` runs ``fn`` without keeping its activations and runs it again in
the backward. On a lazy device the forward and the backward land in one graph, where XLA's
common subexpression elimination would fold the recomputation back into the forward (and
keep every activation alive after all): the recomputation's inputs pass through an
optimization barrier first, so XLA must really compute it again.
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.utils.checkpoint as _torch_checkpoint

from xlatorch.core import xla_model as xm

__all__ = ["checkpoint", "CheckpointFunction", "CheckpointStatus", "chkpt_status", "get_device_states",
           "set_device_states", "checkpoint_sequential"]  # fmt: skip

checkpoint_sequential = _torch_checkpoint.checkpoint_sequential


class CheckpointStatus(enum.Enum):
    """Where a checkpointed region is: ``NONE`` outside any, ``IN_FORWARD`` in its forward,
    ``IN_BACKWARD`` in its recomputation."""

    NONE = 0
    IN_FORWARD = 1
    IN_BACKWARD = 2


chkpt_status = CheckpointStatus.NONE


def get_device_states(*args) -> tuple[list, list]:
    """(devices, RNG states) of the xla tensors among ``args``: the state each device's RNG
    must be back in for a recomputation to draw the same numbers."""
    devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor) and a.device.type == "xla"})
    return devices, [xm.get_rng_state(d) for d in devices]


def set_device_states(devices, states) -> None:
    """Put each device's RNG back in the state ``get_device_states`` gave."""
    for d, s in zip(devices, states):
        xm.set_rng_state(s, d)


@contextlib.contextmanager
def _status(s: CheckpointStatus):
    global chkpt_status
    before, chkpt_status = chkpt_status, s
    try:
        yield
    finally:
        chkpt_status = before


class CheckpointFunction(torch.autograd.Function):
    """The autograd function behind ``checkpoint``: keeps the inputs, not the activations."""

    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        if preserve_rng_state:
            ctx.cpu_state = torch.get_rng_state()
            ctx.devices, ctx.device_states = get_device_states(*args)
            if not ctx.devices:  # no tensor argument on the device: the default device's RNG
                ctx.devices, ctx.device_states = ["xla:0"], [xm.get_rng_state()]
        tensors, ctx.inputs, ctx.tensor_indices = [], [], []
        for i, a in enumerate(args):
            if torch.is_tensor(a):
                tensors.append(a)
                ctx.tensor_indices.append(i)
                ctx.inputs.append(None)
            else:
                ctx.inputs.append(a)
        ctx.save_for_backward(*tensors)
        with torch.no_grad(), _status(CheckpointStatus.IN_FORWARD):
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = list(ctx.inputs)
        saved = ctx.saved_tensors
        detached = [t.detach() for t in saved]
        # The barrier: without it XLA merges this recomputation with the forward's.
        xm.optimization_barrier_([t for t in detached if t.device.type == "xla"])
        for i, t, orig in zip(ctx.tensor_indices, detached, saved):
            inputs[i] = t.requires_grad_(orig.requires_grad)
        rng = torch.random.fork_rng(devices=[]) if ctx.preserve_rng_state else contextlib.nullcontext()
        with rng, xm.fork_rng(enabled=ctx.preserve_rng_state):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_state)
                set_device_states(ctx.devices, ctx.device_states)
            with torch.enable_grad(), _status(CheckpointStatus.IN_BACKWARD):
                outputs = ctx.run_function(*inputs)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("none of the checkpointed function's outputs requires grad")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(t.grad if torch.is_tensor(t) else None for t in inputs)


def checkpoint(
    function,
    *args,
    use_reentrant: bool | None = None,
    context_fn=None,
    determinism_check=None,
    debug=None,
    preserve_rng_state: bool = True,
    **kwargs,
):
    """``function(*args)``, without keeping its activations: the backward computes them again,
    on the device, from ``args`` (behind an optimization barrier, so XLA cannot reuse the
    forward's). ``preserve_rng_state``: the recomputation draws the same random numbers
    (dropout) as the forward. ``use_reentrant=False`` uses PyTorch's non-reentrant
    checkpoint (saved-tensor hooks), which has no barrier.
    """
    if use_reentrant is False:
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False,
                                            preserve_rng_state=preserve_rng_state, **extra, **kwargs)  # fmt: skip
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    return CheckpointFunction.apply(function, preserve_rng_state, *args)
