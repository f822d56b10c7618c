"""``torch_xla.experimental.gru``: ``nn.GRU`` whose time loop is one XLA loop.

Each layer runs as one ``scan`` over the sequence (``jax.lax.scan`` in the program): the step is
traced once, so the program holds it once and compiles in the time of one step, whatever the
sequence length. Its backward is a reverse scan; the layer's weights, read by the step from
outside the loop, get their gradients summed over time steps. Parameters, ``state_dict`` and
the math are ``nn.GRU``'s, so the two load each other's weights and agree to rounding.

Bidirectional GRUs are not scanned: as in torch_xla, asking for one builds a plain ``nn.GRU``.
Inputs off the xla device (CPU tensors) run ``nn.GRU``'s own forward.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from xlatorch.experimental.scan import scan
from xlatorch.runtime.trace.tensor import XlaTensor

__all__ = ["GRU"]

_UPSTREAM = nn.GRU  # torch's own class, even after a patch rebinds ``nn.GRU`` to this one

_BIDIRECTIONAL_POS = 6  # nn.GRU(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional)


class GRU(nn.GRU):
    """A multi-layer GRU (``torch.nn.GRU``'s arguments and parameters) scanned over time.

    Differences from ``nn.GRU`` (as torch_xla's): unidirectional only (``bidirectional=True``
    returns a plain ``nn.GRU``), no ``PackedSequence`` input. ``GRU._orig`` is torch's
    ``nn.GRU`` (as after torch_xla's patch, which rebinds ``nn.GRU`` to this class).
    """

    _orig = _UPSTREAM

    def __new__(cls, *args, **kwargs):
        positional = args[_BIDIRECTIONAL_POS] if len(args) > _BIDIRECTIONAL_POS else False
        if kwargs.get("bidirectional", positional):
            logging.warning("xlatorch: the scan-based GRU is unidirectional; bidirectional=True builds a plain nn.GRU")
            return _UPSTREAM(*args, **kwargs)
        return super().__new__(cls)

    def forward(self, input, hx=None):
        """Run the GRU: ``(output, h_n)`` as ``nn.GRU`` returns them.

        On xla tensors, each layer is one ``scan`` over the sequence (one loop in the program,
        traced once, differentiable); nothing syncs.

        Args:
          input: ``(L, N, H_in)`` (``(N, L, H_in)`` with ``batch_first``) or unbatched ``(L, H_in)``.
          hx: the initial hidden state, ``(num_layers, N, H_out)`` (``(num_layers, H_out)``
            unbatched); zeros when None.
        """
        if isinstance(input, PackedSequence):
            raise TypeError("xlatorch: the scan-based GRU does not take a PackedSequence; pass a padded tensor")
        if type(input) is not XlaTensor:
            return super().forward(input, hx)
        if input.dim() not in (2, 3):
            raise ValueError(f"GRU: Expected input to be 2D or 3D, got {input.dim()}D instead")
        batched = input.dim() == 3
        if not batched:
            input = input.unsqueeze(0 if self.batch_first else 1)
            if hx is not None:
                if hx.dim() != 2:
                    raise RuntimeError(f"For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor")
                hx = hx.unsqueeze(1)
        elif hx is not None and hx.dim() != 3:
            raise RuntimeError(f"For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor")
        if hx is None:
            n = input.size(0 if self.batch_first else 1)
            hx = input.new_zeros(self.num_layers, n, self.hidden_size)
        self.check_forward_args(input, hx, None)
        out = input.transpose(0, 1) if self.batch_first else input
        finals = []
        for layer in range(self.num_layers):
            weights = [getattr(self, f"{w}_l{layer}") for w in ("weight_ih", "weight_hh")]
            if self.bias:
                weights += [getattr(self, f"{b}_l{layer}") for b in ("bias_ih", "bias_hh")]
            h, out = scan(functools.partial(_step, weights), hx[layer], out)
            finals.append(h)
            if layer < self.num_layers - 1 and self.dropout > 0:
                out = F.dropout(out, p=self.dropout, training=self.training)
        h_n = torch.stack(finals)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out, h_n = out.squeeze(0 if self.batch_first else 1), h_n.squeeze(1)
        return out, h_n


def _step(weights, h, x):
    """One time step of one layer: ``(h, x_t) -> (h_t, h_t)``, with ATen's gate order (r, z, n)
    and its rounding (``n + z * (h - n)``)."""
    w_ih, w_hh, b_ih, b_hh = (*weights, None, None)[:4]
    x_r, x_z, x_n = F.linear(x, w_ih, b_ih).chunk(3, dim=-1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    h = n + z * (h - n)
    return h, h
