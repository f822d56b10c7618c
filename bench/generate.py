"""Text generation with Hugging Face ``generate()``: a small Llama (random init) on the xla
device against PyTorch eager on CPU, with the static KV cache (``cache_implementation=
"static"``, fixed shapes) and the default dynamic one. Each configuration runs in a fresh
process with the persistent compile cache off, so the first call pays every compile.

Prints, per cache: the first call (compiles included), the second and third calls (new
prompts of the same length), time per generated token in the third call and in the median of
``--later`` more calls (steady state: CPU eager too runs faster after its first calls), and
the compiles of each call; then the slowest of the later calls, with what they compiled (a graph
compiled again to run fast counts): a call that stalls where the others do not. Not a
test: figures from one run. Needs ``transformers`` (``pip install -e '.[bench]'``).

With ``--cuda`` (a GPU machine) PyTorch eager on CUDA runs too, as one more device row: the
xla rows then run on the GPU (``PJRT_DEVICE=GPU``) and are compared with it as with CPU.

Usage: python -m bench.generate [--tokens 32] [--prompt 12] [--caches static,dynamic] [--later 12] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EAGER = ("cpu", "cuda")  # PyTorch eager's rows: the baselines


def _child(cache: str, device: str, tokens: int, prompt: int, later: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    dev = torch.device(device) if device in EAGER else xm.xla_device()
    model = LlamaForCausalLM(cfg).eval().to(dev)
    if device == "compile":  # Hugging Face's fast path: the forward under torch.compile
        model.forward = torch.compile(model.forward, backend="openxla")
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if cache != "dynamic":
        kw["cache_implementation"] = cache

    def call(seed):
        ids = torch.randint(1, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
        ids = ids.to(dev)
        before = met.counter_value("UncachedCompile") or 0
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw).cpu()
        return time.perf_counter() - t, (met.counter_value("UncachedCompile") or 0) - before, out[0, prompt:].tolist()

    res = {"cache": cache, "device": device}
    for name, seed in (("first", 1), ("second", 2), ("third", 3)):
        s, c, toks = call(seed)
        res[f"{name}_s"], res[f"{name}_compiles"], res[f"{name}_tokens"] = s, c, toks
    res["per_token_ms"] = res["third_s"] / tokens * 1e3
    before = met.counter_value("OptimizedRecompile") or 0
    runs = [call(4 + i) for i in range(later)]
    res["slowest_later_s"] = max((s for s, _, _ in runs), default=0.0)
    times = sorted(s for s, _, _ in runs) or [res["third_s"]]
    res["later_token_ms"] = times[len(times) // 2] / tokens * 1e3  # steady state: the median later call
    res["later_compiles"] = sum(c for _, c, _ in runs) + (met.counter_value("OptimizedRecompile") or 0) - before
    if device not in EAGER:
        res["staged_syncs"] = met.counter_value("StagedSync") or 0
        res["stages_on_host"] = met.counter_value("StageOnHost") or 0
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--caches", default="static,dynamic")
    ap.add_argument("--later", type=int, default=12, help="calls after the third: the slowest is printed")
    ap.add_argument("--child", nargs=2, metavar=("CACHE", "DEVICE"))
    ap.add_argument("--cuda", action="store_true", help="also PyTorch eager on CUDA (a GPU machine; no backward)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.tokens, a.prompt, a.later)))
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.generate: transformers is not installed (pip install -e '.[bench]'); skipped")
        return
    env = dict(os.environ, XLATORCH_CACHE_DIR="")
    rows = []
    for cache in a.caches.split(","):
        for device in ("cpu", "xla") + (("compile",) if cache == "static" else ()) + (("cuda",) if a.cuda else ()):
            # The child imports this module rather than running it as ``__main__`` (``-m``): so
            # run, CPU eager's token took 5.9-6.4 ms against 4.2-4.5 (and the compiled path's
            # 7.1-7.6 against 6.8-6.9): PyTorch's OpenMP threads cost more so, with or without
            # xlatorch imported (docs/text-generation.md).
            child = (f"import json; from bench.generate import _child; print(json.dumps(_child("
                     f"{cache!r}, {device!r}, {a.tokens}, {a.prompt}, {a.later})))")  # fmt: skip
            cmd = [sys.executable, "-c", child]
            out = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:])
                raise SystemExit(f"bench.generate: {cache}/{device} failed")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'cache':8} {'device':6} {'first s':>8} {'comp':>5} {'second s':>9} {'comp':>5} {'third s':>8} "
          f"{'comp':>5} {'ms/token':>9} {'later ms/token':>14} {'slowest later s':>15} {'comp':>5}  "
          f"same tokens as CPU")  # fmt: skip
    by = {(r["cache"], r["device"]): r for r in rows}
    for r in rows:
        cpu = by[(r["cache"], "cpu")]
        same = all(r[f"{n}_tokens"] == cpu[f"{n}_tokens"] for n in ("first", "second", "third"))
        calls = "".join(f" {r[n + '_s']:8.2f} {r[n + '_compiles']:5}" for n in ("first", "second", "third"))
        print(
            f"{r['cache']:8} {r['device']:6}{calls} {r['per_token_ms']:9.2f} {r['later_token_ms']:14.2f} "
            f"{r['slowest_later_s']:15.2f} "
            f"{r['later_compiles']:5}  {same}"
        )
    for (cache, device), x in by.items():
        if device in EAGER:
            continue
        for base in sorted({k for k in by if k[1] in EAGER}):
            c = by[base]
            second, token = x["second_s"] / c["second_s"], x["per_token_ms"] / c["per_token_ms"]
            later = x["later_token_ms"] / c["later_token_ms"]
            print(
                f"{cache}/{device} vs {base[0]}/{base[1]}: second call {second:.2f}x, per token {token:.2f}x "
                f"(third call), {later:.2f}x (median later call)"
            )
    with open(os.path.join(HERE, "results.jsonl"), "a") as f:
        for r in rows:
            r = {k: v for k, v in r.items() if not k.endswith("_tokens")}
            f.write(json.dumps({"bench": "generate", "tokens": a.tokens, "prompt": a.prompt, **r}) + "\n")


if __name__ == "__main__":
    main()
