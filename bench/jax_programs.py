"""The bench's three programs written directly in JAX: the limit xlatorch is measured against.

Same models, losses and optimizers (PyTorch's update rules) as ``examples/models.py``,
one ``jax.jit``-ed step each, started from the PyTorch model's initial weights, so the
first losses agree with PyTorch's (``bench.bench`` prints both).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PROGRAMS", "params_of"]


def params_of(model) -> dict:
    """A PyTorch module's parameters and buffers as a dict of JAX arrays, by state-dict name."""
    return {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in model.state_dict().items()}


def _linear(p, name, x):
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def _log_softmax_nll(logits, y):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


def _conv(x, w, b):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + b[None, :, None, None]


def _max_pool2(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def mnist_loss(p, x, y):
    x = jax.nn.relu(_max_pool2(_conv(x, p["conv1.weight"], p["conv1.bias"])))
    x = jax.nn.relu(_max_pool2(_conv(x, p["conv2.weight"], p["conv2.bias"])))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(_linear(p, "fc1", x))
    return _log_softmax_nll(_linear(p, "fc2", x), y)


def mlp_loss(p, x, y):
    h = jax.nn.relu(_linear(p, "l1", x))
    h = jax.nn.relu(_linear(p, "l2", h))
    return _log_softmax_nll(_linear(p, "l3", h), y)


def _layer_norm(p, name, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]


def _block(p, i, x, mask, heads):
    pre = f"blocks.{i}."
    b, t, d = x.shape
    qkv = _linear(p, pre + "qkv", _layer_norm(p, pre + "ln1", x))
    q, k, v = (a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, axis=2))
    att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(d // heads)
    att = jnp.where(mask[:t, :t] == 0, -jnp.inf, att)
    y = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + _linear(p, pre + "proj", y)
    h = jax.nn.gelu(_linear(p, pre + "fc", _layer_norm(p, pre + "ln2", x)), approximate=False)
    return x + _linear(p, pre + "out", h)


def gpt_loss(p, idx, y, heads=4):
    t = idx.shape[1]
    x = p["tok.weight"][idx] + p["pos.weight"][p["positions"][:t]]
    i = 0
    while f"blocks.{i}.qkv.weight" in p:
        x = _block(p, i, x, p["mask"], heads)
        i += 1
    logits = _linear(p, "head", _layer_norm(p, "ln", x))
    return _log_softmax_nll(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --- optimizers with PyTorch's update rules ------------------------------------------------


def sgd_momentum(lr, momentum):
    def init(params):
        return {"buf": jax.tree.map(jnp.zeros_like, params), "step": jnp.zeros((), jnp.int32)}

    def update(params, grads, state):
        first = state["step"] == 0  # PyTorch's first buffer is the gradient itself
        buf = jax.tree.map(lambda b, g: jnp.where(first, g, momentum * b + g), state["buf"], grads)
        params = jax.tree.map(lambda p, b: p - lr * b, params, buf)
        return params, {"buf": buf, "step": state["step"] + 1}

    return init, update


def adam(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    b1, b2 = betas

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731 (two sets: both are donated)
        return {"m": zeros(), "v": zeros(), "step": jnp.zeros((), jnp.float32)}

    def update(params, grads, state):
        step = state["step"] + 1
        if decoupled:  # AdamW
            params = jax.tree.map(lambda p: p * (1 - lr * weight_decay), params)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        c1, c2 = 1 - b1**step, 1 - b2**step
        params = jax.tree.map(lambda p, m, v: p - lr / c1 * m / (jnp.sqrt(v) / jnp.sqrt(c2) + eps), params, m, v)
        return params, {"m": m, "v": v, "step": step}

    return init, update


# Buffers (not trained) per program.
_BUFFERS = {"gpt": ("mask", "positions")}

PROGRAMS = {
    "mnist": (mnist_loss, sgd_momentum(0.01, 0.5)),
    "mlp": (mlp_loss, adam(1e-3)),
    "gpt": (gpt_loss, adam(1e-3, weight_decay=0.01, decoupled=True)),
}


def make_step(name):
    """(init_state, jitted step(params, buffers, state, x, y) -> (params, state, loss))."""
    loss_fn, (init, update) = PROGRAMS[name]

    def step(params, buffers, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn({**p, **buffers}, x, y))(params)
        params, state = update(params, grads, state)
        return params, state, loss

    return init, jax.jit(step, donate_argnums=(0, 2))


def split_buffers(name, p: dict):
    names = _BUFFERS.get(name, ())
    return {k: v for k, v in p.items() if k not in names}, {k: v for k, v in p.items() if k in names}


def to_jax_batch(batch):
    return tuple(jnp.asarray(np.asarray(t.numpy())) for t in batch)
