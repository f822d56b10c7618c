"""Why a lazy generation compiles after its first call: the tiny Llama of ``bench.generate``,
lazy path, N calls; every compile after the first call printed with its reason (the compile
explainer's account) and the call it came in, and the births computed apart so far. Run 6 saw
one compile in the static cache's third call on the GPU machine: transformers 5's cache, made
anew in each call (``docs/text-generation.md``); the CPU machine's transformers 4 reuses it.

Usage: python bench/accelerator/why_compiles.py [static|dynamic] [calls]
"""

from __future__ import annotations

import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch.debug import explain


def main() -> None:
    cache = sys.argv[1] if len(sys.argv) > 1 else "static"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    dev = xm.xla_device()
    model = LlamaForCausalLM(cfg).eval().to(dev)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    if cache != "dynamic":
        kw["cache_implementation"] = cache
    seen = 0
    for c in range(calls):
        ids = torch.randint(1, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(c + 1)).to(dev)
        before = met.counter_value("UncachedCompile") or 0
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw).cpu()
        dt = time.perf_counter() - t
        n = (met.counter_value("UncachedCompile") or 0) - before
        hoisted = met.counter_value("BirthsHoisted") or 0
        print(f"call {c + 1}: {dt:.3f} s, {n} compiles, BirthsHoisted {hoisted} so far", flush=True)
        recs = explain.compile_reasons()
        if c > 0:
            for r in recs[seen:]:
                print(f"  compile in call {c + 1}: {r}", flush=True)
        seen = len(recs)
    print({k: met.counter_value(k) for k in ("UncachedCompile", "CachedCompile", "StagedSync", "StageOnHost")})


if __name__ == "__main__":
    main()
