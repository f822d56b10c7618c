"""``scan_layers``: a stack of same-structured layers as one XLA loop over their stacked weights.

The program holds one layer, whatever the number of layers: its size and compile time do not
grow with depth (``bench/scan_layers.py``), and each layer's parameters get their gradients
through the stacking.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from xlatorch.experimental.scan import scan

__all__ = ["scan_layers"]


def scan_layers(layers: Iterable[torch.nn.Module], input_data, partition_fn=None, is_layer_pure: bool = False):
    """Run ``layers`` one after the other on ``input_data``, as ``nn.Sequential(*layers)`` does,
    with one layer's computation compiled once and looped over the stacked parameters.

    Args:
      layers: modules of the same structure (parameter and buffer names, shapes and dtypes)
        and the same computation given their parameters.
      input_data: the first layer's input (a tensor or a pytree passed as one argument).
      partition_fn: torch_xla's choice of what the backward recomputes (see ``scan``).
      is_layer_pure: accepted for torch_xla's signature.

    Returns:
      The last layer's output.
    """
    layers = list(layers)
    if not layers:
        return input_data
    first = layers[0]
    states = [_state(m) for m in layers]
    names = list(states[0])
    for i, s in enumerate(states[1:], 1):
        if sorted(s) != sorted(names):
            raise ValueError(f"xlatorch: scan_layers needs layers of the same structure: mismatched keys between "
                             f"layer 0 ({sorted(names)}) and layer {i} ({sorted(s)})")  # fmt: skip
        for k in names:
            a, b = states[0][k], s[k]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise ValueError(f"xlatorch: scan_layers needs layers of the same structure: Shape mismatch of {k!r} "
                                 f"between layer 0 ({tuple(a.shape)} {a.dtype}) and layer {i} "
                                 f"({tuple(b.shape)} {b.dtype})")  # fmt: skip
    stacked = {k: torch.stack([s[k] for s in states]) for k in names}

    def one_layer(carry, weights):
        # A tuple is the layer's positional arguments, as nn.Sequential would not do but
        # torch_xla's scan_layers does (each layer returns the next one's tuple).
        args = carry if isinstance(carry, tuple) else (carry,)
        return torch.func.functional_call(first, weights, args, strict=True), None

    out, _ = scan(one_layer, input_data, stacked, partition_fn=partition_fn, is_fn_pure=is_layer_pure)
    return out


def _state(module: torch.nn.Module) -> dict:
    out = dict(module.named_parameters())
    out.update(module.named_buffers())
    return out
