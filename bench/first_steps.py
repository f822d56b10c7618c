"""Time to a trained first and second step: small Hugging Face models (random init, small
configs) under a standard training loop (AdamW, ``loss.backward()``, ``optimizer.step()``,
``xm.mark_step()``), on xlatorch and in PyTorch eager on CPU. Not a test: it prints figures
and their ratio to eager.

``first_step_s`` / ``second_step_s``: wall time from the start of the step to its loss being
on the host (``loss.item()`` after ``mark_step``). Step 0 creates AdamW's state, so it is
not the same program as step 1. Every program runs in a fresh process with the persistent
compile cache off (``XLATORCH_CACHE_DIR=``): what a user sees on a first run. Runs
alternate xlatorch, eager, xlatorch, eager ... to spread machine noise; figures are medians.

Needs ``transformers`` (``pip install -e .[bench]``); without it every model is skipped.

``--dropout P`` trains with dropout at ``P`` (HF's default is 0.1; resnet has none): the
losses then differ from eager's by the random masks, and the figures show what random ops
cost a first step.

``--variant NAME=VALUE`` also runs xlatorch with that environment variable, interleaved with
the others (e.g. ``XLATORCH_HOIST_BIRTHS=0``: without computing optimizer state apart), and
prints its row as ``program+``.

Usage: python -m bench.first_steps [--rounds R] [--programs bert,t5,vit,resnet] [--dropout P] [--variant NAME=VALUE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ("bert", "t5", "vit", "resnet")
BATCH = 8


def _model_and_batch(name: str, gen, dropout: float = 0.0):
    """A small randomly initialised model (dropout off by default, so losses compare with eager)
    and one batch of its inputs, as keyword arguments of its forward (labels included)."""
    import torch
    import transformers as T

    if name == "bert":
        cfg = T.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=256, max_position_embeddings=128, num_labels=2,
                           hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)  # fmt: skip
        model = T.BertForSequenceClassification(cfg)
        batch = dict(input_ids=torch.randint(0, 1000, (BATCH, 64), generator=gen),
                     attention_mask=torch.ones(BATCH, 64, dtype=torch.long),
                     labels=torch.randint(0, 2, (BATCH,), generator=gen))  # fmt: skip
    elif name == "t5":
        cfg = T.T5Config(vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
                         num_heads=4, dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
        model = T.T5ForConditionalGeneration(cfg)
        batch = dict(input_ids=torch.randint(1, 1000, (BATCH, 32), generator=gen),
                     labels=torch.randint(1, 1000, (BATCH, 16), generator=gen))  # fmt: skip
    elif name == "vit":
        cfg = T.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=128, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=256, num_labels=10,
                          hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)  # fmt: skip
        model = T.ViTForImageClassification(cfg)
        batch = dict(pixel_values=torch.randn(BATCH, 3, 32, 32, generator=gen),
                     labels=torch.randint(0, 10, (BATCH,), generator=gen))  # fmt: skip
    elif name == "resnet":
        cfg = T.ResNetConfig(num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                             layer_type="basic", num_labels=10)  # fmt: skip
        model = T.ResNetForImageClassification(cfg)
        batch = dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=gen),
                     labels=torch.randint(0, 10, (BATCH,), generator=gen))  # fmt: skip
    else:
        raise ValueError(f"unknown program {name!r} (known: {', '.join(PROGRAMS)})")
    return model, batch


def _child(name: str, device: str, steps: int, dropout: float = 0.0) -> dict:
    """One program's first ``steps`` steps in this (fresh) process."""
    import torch

    torch.manual_seed(0)
    model, batch = _model_and_batch(name, torch.Generator().manual_seed(1), dropout)
    model.train()
    xla = device == "xla"
    if xla:
        sys.path.insert(0, ROOT)
        import xlatorch.core.xla_model as xm
        import xlatorch.debug.metrics as met

        dev = xm.xla_device()
        t = time.perf_counter()
        model.to(dev)
        batch = {k: v.to(dev) for k, v in batch.items()}
        xm.mark_step(wait=True)
        setup = time.perf_counter() - t
    else:
        setup = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = dict(program=name, device=device, setup_s=setup, step_s=[], loss=[], compiles=[], compile_s=[], nodes=[])

    def counter(n):
        return (met.counter_value(n) or 0) if xla else 0

    def samples(n):
        return list((met.metric_data(n) or (0, 0, []))[2]) if xla else []

    for _ in range(steps):
        c0, ct0, gs0 = counter("UncachedCompile"), len(samples("CompileTime")), len(samples("TensorsGraphSize"))
        t = time.perf_counter()
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        if xla:
            xm.mark_step()
        value = loss.item()
        out["step_s"].append(time.perf_counter() - t)
        out["loss"].append(value)
        out["compiles"].append(counter("UncachedCompile") - c0)
        out["compile_s"].append(sum(s[1] for s in samples("CompileTime")[ct0:]) / 1e9)
        out["nodes"].append([int(s[1]) for s in samples("TensorsGraphSize")[gs0:]])
    if xla:
        out["fallbacks"] = met.executed_fallback_ops()
    return out


def _run(name: str, device: str, steps: int, variant: str = "", dropout: float = 0.0) -> dict:
    env = dict(os.environ, XLATORCH_CACHE_DIR="")
    if variant:
        k, _, v = variant.partition("=")
        env[k] = v
    cmd = [sys.executable, "-m", "bench.first_steps", "--child", name, "--device", device, "--steps", str(steps),
           "--dropout", str(dropout)]  # fmt: skip
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{name} on {device} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first two are reported)")
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--label", default="", help="a note stored with each row (e.g. before/after)")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout probability of the models (default 0)")
    ap.add_argument("--variant", default="", help="NAME=VALUE: also run xlatorch with this environment variable")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--child")
    ap.add_argument("--device", default="xla")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.device, a.steps, a.dropout)))
        return
    if importlib.util.find_spec("transformers") is None:
        print("bench.first_steps: transformers is not installed (pip install -e .[bench]); skipping every model")
        return
    print(f"{'program':8} {'1st s':>6} {'2nd s':>6} {'3rd s':>6} {'eager 1st':>9} {'eager 2nd':>9} "
          f"{'1st/eager':>9} {'2nd/eager':>9} {'compiles/step':>13} {'compile s/step':>15} "
          f"{'graph nodes/step':>20} {'loss xla/eager':>15}")  # fmt: skip
    for name in a.programs.split(","):
        xs, vs, es = [], [], []
        for _ in range(a.rounds):
            xs.append(_run(name, "xla", a.steps, dropout=a.dropout))
            if a.variant:
                vs.append(_run(name, "xla", a.steps, a.variant, a.dropout))
            es.append(_run(name, "cpu", a.steps, dropout=a.dropout))
        _report(name, xs, es, a, "")
        if vs:
            _report(name, vs, es, a, a.variant)


def _report(name: str, xs: list, es: list, a, variant: str) -> None:
    def med(runs, i, k="step_s"):
        return statistics.median(r[k][i] for r in runs)

    n = min(a.steps, 3)
    x = [med(xs, i) for i in range(n)]
    e = [med(es, i) for i in range(n)]
    cs = [med(xs, i, "compile_s") for i in range(n)]
    row = dict(program=name, label=a.label, variant=variant, dropout=a.dropout, rounds=a.rounds, first_step_s=x[0],
               second_step_s=x[1], third_step_s=x[2] if n > 2 else None, eager_first_step_s=e[0],
               eager_second_step_s=e[1],
               ratio_first=x[0] / e[0], ratio_second=x[1] / e[1], compiles=xs[0]["compiles"],
               compile_s=cs, graph_nodes=xs[0]["nodes"], setup_s=statistics.median(r["setup_s"] for r in xs),
               loss=xs[0]["loss"], eager_loss=es[0]["loss"], fallbacks=xs[0].get("fallbacks", []),
               all_xla_step_s=[r["step_s"] for r in xs], all_eager_step_s=[r["step_s"] for r in es],
               time=time.time())  # fmt: skip
    third = f"{x[2]:6.2f}" if n > 2 else f"{'-':>6}"
    label = name + ("+" if variant else "")
    print(f"{label:8} {x[0]:6.2f} {x[1]:6.2f} {third} {e[0]:9.3f} {e[1]:9.3f} {row['ratio_first']:9.1f} "
          f"{row['ratio_second']:9.1f} {'/'.join(map(str, row['compiles'])):>13} "
          f"{'/'.join(f'{c:.2f}' for c in cs):>15} "
          f"{'/'.join(','.join(map(str, g)) for g in row['graph_nodes']):>20} "
          f"{row['loss'][1]:7.4f}/{row['eager_loss'][1]:<7.4f}", flush=True)  # fmt: skip
    if row["fallbacks"]:
        print(f"         fallbacks: {row['fallbacks']}")
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
