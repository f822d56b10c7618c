"""Connectionist temporal classification: ``_ctc_loss`` and ``_ctc_loss_backward`` as CPU's
kernel computes them. The lengths are int lists there (compile-time constants: each new set of
lengths compiles anew); the helpers take them traced as well (only the number of states, from
``log_alpha``'s shape, is static), for lengths held on the device.

``log_probs`` is (T, B, C). A sample's extended target l' has 2 L + 1 states (blanks between
and around its L labels). The forward is CPU's log-space alpha recursion, a ``lax.scan`` over
time vectorised over samples and states; the backward the beta recursion the other way and
the per-character collection of alpha + beta. CPU's three-term log-sum-exp is reproduced term
by term (the maximum of the terms taken out, 0 when every term is -inf). States past a
sample's 2 L + 1, and times past its input length, are computed and then masked: the
recursions only read lower (alpha) or higher, in-range (beta) states, so they never reach the
results. Where CPU leaves ``log_alpha`` uninitialised (those same places) it is -inf here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

_NEG_INF = -jnp.inf


def _lengths(lengths):
    """Lengths as an int32 vector: an int list (compile-time constants, ``_ctc_loss``) or a
    traced tensor alike (only the number of states, from the result's shape, is static)."""
    return jnp.asarray(lengths, dtype=jnp.int32).reshape(-1)


def _target_primes(targets, input_lengths, target_lengths, blank, states):
    """l'(b, s) for every sample and state (blank at even states and past a sample's target),
    whether state s may skip from s - 2 (its label differs from l'(s - 2)), and the static
    (B, states) mask of the states CPU computes (s < 2 L + 1)."""
    tl = _lengths(target_lengths)
    b, s_max = tl.shape[0], (states - 1) // 2
    j = np.arange(s_max)
    valid = j[None, :] < tl[:, None]
    if s_max == 0:
        labels = jnp.zeros((b, 0), jnp.int32)
    elif targets.ndim == 1:  # concatenated: sample b's labels start at the sum of the lengths before it
        offsets = jnp.concatenate([jnp.zeros((1,), tl.dtype), jnp.cumsum(tl)[:-1]])
        idx = jnp.where(valid, offsets[:, None] + j[None, :], 0)
        labels = targets[idx].astype(jnp.int32)
    else:
        labels = targets[:, :s_max].astype(jnp.int32)
    labels = jnp.where(valid, labels, blank)
    prime = jnp.full((b, states), blank, jnp.int32)
    if s_max:
        prime = prime.at[:, 1::2].set(labels)
    skip = jnp.zeros((b, states), jnp.bool_)
    if states > 2:
        skip = skip.at[:, 2:].set(prime[:, 2:] != prime[:, :-2])
    in_target = np.arange(states)[None, :] < (2 * tl + 1)[:, None]
    return prime, skip, in_target


def _lse3(a1, a2, a3):
    """CPU's ``log(exp(a1 - m) + exp(a2 - m) + exp(a3 - m)) + m``, m the maximum (0 if -inf)."""
    m = jnp.maximum(jnp.maximum(a1, a2), a3)
    m = jnp.where(m == _NEG_INF, 0, m)
    return jnp.log(jnp.exp(a1 - m) + jnp.exp(a2 - m) + jnp.exp(a3 - m)) + m


def _shift(x, k, fill=_NEG_INF):
    """``x[..., s - k]`` for k > 0 (``x[..., s + |k|]`` for k < 0), ``fill`` where out of range."""
    n = x.shape[-1]
    m = min(abs(k), n)
    pad = jnp.full(x.shape[:-1] + (m,), fill, x.dtype)
    if k > 0:
        return jnp.concatenate([pad, x[..., : n - m]], axis=-1)
    return jnp.concatenate([x[..., m:], pad], axis=-1)


def _gathered(log_probs, prime):
    """lp(t, b, l'(b, s)): (T, B, states)."""
    return jnp.take_along_axis(log_probs, jnp.broadcast_to(prime[None], (log_probs.shape[0],) + prime.shape), axis=2)


def ctc_loss(out, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    """``aten::_ctc_loss``: (neg_log_likelihood (B,), log_alpha (B, T, 2 max(L) + 1)).

    ``zero_infinity`` only matters to the backward (the composite ``ctc_loss`` zeroes infinite
    losses itself)."""
    n_t, n_b, _ = log_probs.shape
    states = out[1].shape[2]
    il, tl = _lengths(input_lengths), _lengths(target_lengths)
    prime, skip, in_target = _target_primes(targets, input_lengths, target_lengths, blank, states)
    lp = _gathered(log_probs, prime)  # (T, B, S')
    s_idx = np.arange(states)
    first = (s_idx[None, :] == 0) | ((s_idx[None, :] == 1) & (tl[:, None] > 0))
    alpha0 = jnp.where(first & (il[:, None] > 0), lp[0], _NEG_INF)

    def step(prev, lp_t):
        a2 = _shift(prev, 1)
        a3 = jnp.where(skip, _shift(prev, 2), _NEG_INF)
        cur = _lse3(prev, a2, a3) + lp_t
        return cur, cur

    if n_t > 1:
        _, rest = lax.scan(step, alpha0, lp[1:])
        alpha = jnp.concatenate([alpha0[None], rest], axis=0)
    else:
        alpha = alpha0[None]
    computed = (np.arange(n_t)[:, None, None] < il[None, :, None]) & in_target[None]
    alpha = jnp.where(computed, alpha, _NEG_INF)  # (T, B, S')
    last = jnp.maximum(il - 1, 0)
    end = alpha[last, np.arange(n_b)]  # (B, S'): each sample's row at its last input
    l1 = jnp.take_along_axis(end, jnp.minimum(2 * tl, states - 1)[:, None], axis=1)[:, 0]
    l2 = jnp.take_along_axis(end, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0]
    m = jnp.maximum(l1, l2)
    m = jnp.where(m == _NEG_INF, 0, m)
    ll = jnp.where(tl > 0, jnp.log(jnp.exp(l1 - m) + jnp.exp(l2 - m)) + m, l1)
    ll = jnp.where(il > 0, ll, jnp.where(tl == 0, 0.0, _NEG_INF).astype(ll.dtype))
    return -ll, jnp.transpose(alpha, (1, 0, 2))


def ctc_loss_backward(out, grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity):  # fmt: skip
    """``aten::_ctc_loss_backward``: the gradient of each sample's loss times ``grad``, (T, B, C).

    As CPU: beta from each sample's last input backwards, ``lcab(t, c)`` the log-sum of
    alpha + beta over the states labelled c, then ``(exp(lp) - exp(lcab + nll - lp)) grad`` for
    t below the input length and 0 from there on; a sample with an infinite loss gets a zero
    gradient under ``zero_infinity``."""
    n_t, n_b, n_c = log_probs.shape
    states = log_alpha.shape[2]
    il, tl = _lengths(input_lengths), _lengths(target_lengths)
    prime, skip, in_target = _target_primes(targets, input_lengths, target_lengths, blank, states)
    lp = _gathered(log_probs, prime)  # (T, B, S')
    s_idx = np.arange(states)[None, :]
    has2 = s_idx < 2 * tl[:, None]
    has3 = (s_idx < 2 * tl[:, None] - 1) & _shift(skip, -2, False)
    ends = (s_idx == 2 * tl[:, None]) | ((s_idx == 2 * tl[:, None] - 1) & (tl[:, None] > 0))
    t_idx = np.arange(n_t)
    start = t_idx[:, None] == il[None, :] - 1  # (T, B): each sample's last input
    inside = t_idx[:, None] < il[None, :] - 1

    def step(nxt, xs):
        lp_t, start_t, inside_t = xs
        b2 = jnp.where(has2, _shift(nxt, -1), _NEG_INF)
        b3 = jnp.where(has3, _shift(nxt, -2), _NEG_INF)
        rec = _lse3(nxt, b2, b3) + lp_t
        init = jnp.where(ends, lp_t, _NEG_INF)
        cur = jnp.where(start_t[:, None], init, jnp.where(inside_t[:, None], rec, _NEG_INF))
        return cur, cur

    beta0 = jnp.full((n_b, states), _NEG_INF, log_probs.dtype)
    _, beta = lax.scan(step, beta0, (lp, start, inside), reverse=True)  # (T, B, S')
    computed = (t_idx[:, None, None] < il[None, :, None]) & in_target[None]
    # At the last input CPU assigns the two end states' terms rather than adding them: where the
    # last label is the blank itself, the second (state 2 L - 1) replaces the first.
    dup = (jnp.take_along_axis(prime, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0] == blank) & (tl > 0)
    replaced = start[:, :, None] & (s_idx == 2 * tl[:, None])[None] & dup[None, :, None]
    computed = computed & ~replaced
    ab = jnp.where(computed, jnp.transpose(log_alpha, (1, 0, 2)) + beta, _NEG_INF)
    # log-sum over the states of each character: the maximum taken out (CPU adds the states one
    # by one, each pair as a log-sum-exp: equal within rounding)
    bi = np.arange(n_b)[:, None]
    m = jnp.full((n_t, n_b, n_c), _NEG_INF, ab.dtype).at[:, bi, prime].max(ab)
    m_s = jnp.take_along_axis(m, jnp.broadcast_to(prime[None], ab.shape), axis=2)
    e = jnp.where(m_s == _NEG_INF, 0, jnp.exp(ab - jnp.where(m_s == _NEG_INF, 0, m_s)))
    total = jnp.zeros((n_t, n_b, n_c), ab.dtype).at[:, bi, prime].add(e)
    lcab = jnp.where(m == _NEG_INF, _NEG_INF, jnp.log(total) + m)
    nll = neg_log_likelihood[None, :, None]
    res = (jnp.exp(log_probs) - jnp.exp(lcab + nll - log_probs)) * grad[None, :, None]
    live = t_idx[:, None, None] < il[None, :, None]
    if zero_infinity:
        live = live & (nll != jnp.inf)
    return jnp.where(live, res, 0).astype(out.dtype)


# PyTorch has no meta kernels for the backwards: the result is shaped as ``log_probs``.
def _ctc_loss_backward_meta(grad, log_probs, *args, **kwargs):
    return log_probs.new_empty(log_probs.shape)


def _ctc_loss_tensor_meta(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``_ctc_loss.Tensor``: log_alpha for the most labels the targets can hold (ops.yaml says why)."""
    most = targets.shape[1] if targets.dim() == 2 else targets.numel()
    n_t, n_b = log_probs.shape[0], log_probs.shape[1]
    return log_probs.new_empty((n_b,)), log_probs.new_empty((n_b, n_t, 2 * most + 1))


_LIB = torch.library.Library("aten", "IMPL")
try:
    _LIB.impl("_ctc_loss.Tensor", _ctc_loss_tensor_meta, "Meta")
except RuntimeError:  # a torch that registers its own
    pass
for _name in ("_ctc_loss_backward", "_ctc_loss_backward.Tensor"):
    try:
        _LIB.impl(_name, _ctc_loss_backward_meta, "Meta")
    except RuntimeError:  # a torch that registers its own
        pass
