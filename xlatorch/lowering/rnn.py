"""Recurrent cells: the fused LSTM and GRU cells ATen's ``lstm``/``gru`` call on accelerator
devices (the xla device is one), and their backward ops.

Each forward returns a ``workspace`` that only its own backward reads: the activated gates
(LSTM: ``i, f, g, o``; GRU: ``r, z, n`` with ``hx`` and the hidden state's new-gate part).
The backward ops are the derivatives of the forwards written out (derivatives.yaml pairs
them), checked against CPU's unfused cells by tests/test_ops_nn.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import nn as jnn


def _plus(x, *bs):
    for b in bs:
        if b is not None:
            x = x + b
    return x


def thnn_fused_lstm_cell(out, input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    i, f, g, o = jnp.split(_plus(input_gates + hidden_gates, input_bias, hidden_bias), 4, axis=1)
    i, f, g, o = jnn.sigmoid(i), jnn.sigmoid(f), jnp.tanh(g), jnn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


def thnn_fused_lstm_cell_backward_impl(out, grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    t = jnp.tanh(cy)
    ghy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    gc = ghy * o * (1 - t * t) + (0 if grad_cy is None else grad_cy)
    grad_gates = jnp.concatenate([gc * g * i * (1 - i), gc * cx * f * (1 - f), gc * i * (1 - g * g),
                                  ghy * t * o * (1 - o)], axis=1)  # fmt: skip
    grad_bias = grad_gates.sum(0) if has_bias else None if out[2] is None else jnp.zeros(out[2].shape, grad_gates.dtype)
    return grad_gates, gc * f, grad_bias


def thnn_fused_gru_cell(out, input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ir, ii, inn = jnp.split(_plus(input_gates, input_bias), 3, axis=1)
    hr, hi, hn = jnp.split(_plus(hidden_gates, hidden_bias), 3, axis=1)
    r = jnn.sigmoid(ir + hr)
    z = jnn.sigmoid(ii + hi)
    n = jnp.tanh(inn + r * hn)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=1)


def thnn_fused_gru_cell_backward(out, grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    gz = grad_hy * (hx - n) * z * (1 - z)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gr = gn * hn * r * (1 - r)
    grad_input = jnp.concatenate([gr, gz, gn], axis=1)
    grad_hidden = jnp.concatenate([gr, gz, gn * r], axis=1)
    if has_bias:
        return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)
    return (grad_input, grad_hidden, grad_hy * z, jnp.zeros(out[3].shape, grad_input.dtype),
            jnp.zeros(out[4].shape, grad_input.dtype))  # fmt: skip


# PyTorch has no meta kernels for the GRU cell, and its LSTM cell's fails on a cell without
# biases (it reads ``input_bias.device``): their output shapes, for tracing.
def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    return cx.new_empty(cx.shape), cx.new_empty(cx.shape), cx.new_empty((cx.shape[0], 4 * cx.shape[1]))


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    return hx.new_empty(hx.shape), hx.new_empty((hx.shape[0], 5 * hx.shape[1]))


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    b, h = grad_hy.shape
    gates = grad_hy.new_empty((b, 3 * h))
    bias = grad_hy.new_empty((3 * h,) if has_bias else (0,))
    return gates, gates.new_empty(gates.shape), grad_hy.new_empty(grad_hy.shape), bias, bias.new_empty(bias.shape)


_LIB = torch.library.Library("aten", "IMPL")
for _name, _meta in (("_thnn_fused_lstm_cell", _lstm_cell_meta), ("_thnn_fused_gru_cell", _gru_cell_meta),
                     ("_thnn_fused_gru_cell_backward", _gru_cell_backward_meta)):  # fmt: skip
    try:
        _LIB.impl(_name, _meta, "Meta")
    except RuntimeError:  # another torch (2.11) registers its own Python meta kernel for it
        pass
