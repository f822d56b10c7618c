"""The compiled program of one decode step against the same step written in JAX.

``bench.generate`` times whole tokens, most of which is host work (Hugging Face's Python,
the stop check's sync). This isolates the device program: the tiny Llama of
``bench.generate`` with a static KV cache, its forward under ``torch.compile(backend=
"openxla")``, one prefill and one decode step; the executable xlatorch compiled for the
decode step's sync is then run alone in a loop, on zeros of its arguments. Beside it, the
decode step written directly in JAX (``decode_step``: the same weights in PyTorch's layout,
``x @ W.T``, the same static cache updated by ``dynamic_update_slice``, the same mask over
every cache position), whose logits are checked against PyTorch eager's on CPU before it is
timed. Printed: each program's time per run (the two take turns, round by round), its fusions
and dots after XLA's optimizations, and the ratio. Not a test: figures from one run.

Usage: python -m bench.decode_program [--prompt 12] [--runs 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import xlatorch.core.xla_model as xm
from bench.generate import LLAMA
from xlatorch.runtime.base import record


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()


def _steps(model, device, prompt: int, max_len: int, compiled: bool):
    """A prefill of ``prompt`` tokens and one decode step on ``device``: the decode step's
    logits (CPU), the cache after the prefill (CPU), and the executables compiled during the
    decode step's sync (xla only)."""
    from transformers import StaticCache

    model = model.to(device)
    fwd = torch.compile(model.forward, backend="openxla") if compiled else model.forward
    cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len, device=device,
                        dtype=torch.float32)  # fmt: skip
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pos = torch.arange(prompt)
        out = fwd(input_ids=ids.to(device), position_ids=pos[None].to(device), cache_position=pos.to(device),
                  past_key_values=cache, use_cache=True)  # fmt: skip
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        if device != "cpu":
            xm.mark_step()
        before = [(layer.keys.cpu().clone(), layer.values.cpu().clone()) for layer in cache.layers]
        made = []
        hook = lambda req, exe, ns: made.append(exe)  # noqa: E731
        record.COMPILE_HOOKS.append(hook)
        try:
            p = torch.tensor([prompt])
            out = fwd(input_ids=tok, position_ids=p[None].to(device), cache_position=p.to(device),
                      past_key_values=cache, use_cache=True)  # fmt: skip
            logits = out.logits[0, -1].cpu()
        finally:
            record.COMPILE_HOOKS.remove(hook)
    return tok.cpu(), logits, before, made


def decode_step(p: dict, kc, vc, tok, pos, cfg):
    """One Llama decode step in JAX over a static cache ``kc``/``vc`` ([layers, kv heads,
    max_len, head dim]): (new caches, logits of the token)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    nh, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // nh
    s = kc.shape[2]

    def rms(x, w):
        return w * (x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps))

    def rope(x):
        inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        f = pos.astype(jnp.float32) * inv
        e = jnp.concatenate([f, f])
        return x * jnp.cos(e) + jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * jnp.sin(e)

    x = p["model.embed_tokens.weight"][tok]  # [1, hidden]
    ks, vs = [], []
    for i in range(cfg.num_hidden_layers):
        w = lambda n, i=i: p[f"model.layers.{i}.{n}.weight"]  # noqa: E731
        h = rms(x, w("input_layernorm"))
        q = rope((h @ w("self_attn.q_proj").T).reshape(nh, 1, d))
        k = rope((h @ w("self_attn.k_proj").T).reshape(kv, 1, d))
        v = (h @ w("self_attn.v_proj").T).reshape(kv, 1, d)
        kc_i = lax.dynamic_update_slice(kc[i], k, (0, pos, 0))
        vc_i = lax.dynamic_update_slice(vc[i], v, (0, pos, 0))
        ks.append(kc_i)
        vs.append(vc_i)
        kr, vr = jnp.repeat(kc_i, nh // kv, 0), jnp.repeat(vc_i, nh // kv, 0)
        scores = (q @ kr.transpose(0, 2, 1)) * d**-0.5
        scores = jnp.where(jnp.arange(s) <= pos, scores, -jnp.inf)
        a = jax.nn.softmax(scores, -1) @ vr
        x = x + a.transpose(1, 0, 2).reshape(1, nh * d) @ w("self_attn.o_proj").T
        h = rms(x, w("post_attention_layernorm"))
        x = x + (jax.nn.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    logits = rms(x, p["model.norm.weight"]) @ p["lm_head.weight"].T
    return jnp.stack(ks), jnp.stack(vs), logits[0]


def _time(fns, runs: int, rounds: int = 9) -> list[float]:
    """Per function of ``fns`` (each returns what to wait for): the median over ``rounds`` of ms
    per run, the functions taking turns round by round (the machine's speed drifts), and last
    the median of the per-round ratios of the first to the second."""
    import jax

    for fn in fns:
        for _ in range(20):
            jax.block_until_ready(fn())
    times: list = [[] for _ in fns]
    for _ in range(rounds):
        for fn, acc in zip(fns, times):
            t = time.perf_counter()
            for _ in range(runs):
                r = fn()
            jax.block_until_ready(r)
            acc.append((time.perf_counter() - t) / runs * 1e3)
    return [statistics.median(acc) for acc in times] + [statistics.median(x / y for x, y in zip(*times))]


def _counts(compiled) -> tuple[int, int]:
    text = compiled.as_text()
    return text.count(" fusion("), text.count(" dot(")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--runs", type=int, default=300)
    a = ap.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.decode_program: transformers is not installed (pip install -e '.[bench]'); skipped")
        return
    import jax
    import jax.numpy as jnp

    max_len = a.prompt + 8
    model = _model()
    cfg = model.config
    tok, want, before, _ = _steps(model, "cpu", a.prompt, max_len, compiled=False)
    params = {k: jnp.asarray(v.numpy()) for k, v in model.state_dict().items()}
    xtok, got_xla, _, made = _steps(model, xm.xla_device(), a.prompt, max_len, compiled=True)
    assert torch.equal(xtok, tok), "xlatorch's prefill chose another token than CPU eager's"
    exes = [e for e in made if getattr(e, "xla", None) is not None]
    if not exes:
        raise SystemExit("bench.decode_program: the decode step compiled nothing (a warm cache?)")
    ours = max(exes, key=lambda e: _counts(e.xla)[0]).xla  # the step's program (not a small stage)

    kc = jnp.stack([jnp.asarray(k[0].numpy()) for k, _ in before])
    vc = jnp.stack([jnp.asarray(v[0].numpy()) for _, v in before])
    step = jax.jit(lambda p, kc, vc, tok, pos: decode_step(p, kc, vc, tok, pos, cfg), donate_argnums=(1, 2))
    pos = jnp.asarray(a.prompt)
    jtok = jnp.asarray(tok[0].numpy())
    _, _, logits = step(params, kc, vc, jtok, pos)
    scale = float(want.abs().max())
    for name, got in (("JAX's", np.asarray(logits)), ("xlatorch's", got_xla.numpy())):
        err = float(np.abs(got - want.numpy()).max())
        print(f"{name} decode logits vs CPU eager's: largest difference {err:.2e} (largest logit {scale:.2f})")
    theirs = step.lower(params, kc, vc, jtok, pos).compile()

    args, kwargs = jax.tree_util.tree_map(lambda x: jnp.zeros(x._aval.shape, x._aval.dtype), ours.args_info,
                                          is_leaf=lambda x: hasattr(x, "_aval"))  # fmt: skip
    state = [jnp.zeros_like(kc), jnp.zeros_like(vc)]

    def jax_run():
        state[0], state[1], out = theirs(params, state[0], state[1], jtok, pos)
        return out

    t_ours, t_jax, ratio = _time([lambda: ours(*args, **kwargs), jax_run], a.runs)
    (fo, do), (fj, dj) = _counts(ours), _counts(theirs)
    print(f"{'program':24} {'ms/run':>8} {'fusions':>8} {'dots':>5}")
    print(f"{'xlatorch (decode sync)':24} {t_ours:8.3f} {fo:8} {do:5}")
    print(f"{'JAX (decode_step)':24} {t_jax:8.3f} {fj:8} {dj:5}")
    print(f"xlatorch / JAX: {ratio:.2f}x (median of the rounds' ratios; the programs took turns)")


if __name__ == "__main__":
    main()
