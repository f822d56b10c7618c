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

With ``--torch-xla-python`` (or ``TORCH_XLA_PYTHON``: the Python of a venv with torch_xla and
transformers, see ``bench/vs_torch_xla.py``) torch_xla itself runs the same calls, lazily
(``tx-xla``) and with the compiled forward (``tx-compile``), each beside xlatorch's row.

Usage: python -m bench.generate [--tokens 32] [--prompt 12] [--caches static,dynamic] [--later 12] [--cuda]
       [--torch-xla-python PY]
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
# The bench's tiny Llama (also bench/decode_program.py's)
LLAMA = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def _child(cache: str, device: str, tokens: int, prompt: int, later: int) -> dict:
    import importlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    lib = "torch_xla" if device.startswith("tx-") else "xlatorch"  # tx-*: torch_xla's own rows
    xm = importlib.import_module(f"{lib}.core.xla_model")
    met = importlib.import_module(f"{lib}.debug.metrics")

    torch.manual_seed(0)
    cfg = LlamaConfig(**LLAMA)
    dev = torch.device(device) if device in EAGER else xm.xla_device()
    model = LlamaForCausalLM(cfg).eval().to(dev)
    if device in ("compile", "tx-compile"):  # Hugging Face's fast path: the forward under torch.compile
        model.forward = torch.compile(model.forward, backend="openxla")
    phases = _timed_phases(model)
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
        dyn = met.counter_value("DynamoCompile") or 0
        s, c, toks = call(seed)
        res[f"{name}_s"], res[f"{name}_compiles"], res[f"{name}_tokens"] = s, c, toks
        res[f"{name}_dynamo"] = (met.counter_value("DynamoCompile") or 0) - dyn  # graphs Dynamo made
    res["per_token_ms"] = res["third_s"] / tokens * 1e3
    before = met.counter_value("OptimizedRecompile") or 0
    phases.clear()
    runs = [call(4 + i) for i in range(later)]
    n = max(later, 1) * tokens
    res["phase_ms"] = {k: phases.get(k, 0.0) / n * 1e3 for k in _PHASES.values()}
    res["phase_ms"]["rest"] = sum(s for s, _, _ in runs) / n * 1e3 - sum(res["phase_ms"].values())
    res["slowest_later_s"] = max((s for s, _, _ in runs), default=0.0)
    times = sorted(s for s, _, _ in runs) or [res["third_s"]]
    res["later_token_ms"] = times[len(times) // 2] / tokens * 1e3  # steady state: the median later call
    res["later_compiles"] = sum(c for _, c, _ in runs) + (met.counter_value("OptimizedRecompile") or 0) - before
    if device not in EAGER:
        res["staged_syncs"] = met.counter_value("StagedSync") or 0
        res["stages_on_host"] = met.counter_value("StageOnHost") or 0
    return res


# Where a token's time goes (the later calls, per token): Hugging Face's input preparation (the
# attention mask, built eagerly outside the model at each token; cache bookkeeping), the model's
# forward (traced op by op on the lazy path; one call of the compiled graph under torch.compile),
# the stop check (the token's sync on the xla device: the step's graph runs there), and the rest
# (logits processing, the next token's concatenation).
_PHASES = {"prepare_inputs_for_generation": "inputs", "forward": "forward", "_has_unfinished_sequences": "stop"}


def _timed_phases(model) -> dict:
    """Wrap ``model``'s methods named in ``_PHASES`` to add their time (s) to the returned dict
    (``functools.wraps``: ``generate`` inspects their signatures)."""
    import functools

    phases: dict = {}
    for name, label in _PHASES.items():
        fn = getattr(model, name)

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _label=label, **kwargs):
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                phases[_label] = phases.get(_label, 0.0) + time.perf_counter() - t

        setattr(model, name, timed)
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--caches", default="static,dynamic")
    ap.add_argument("--later", type=int, default=12, help="calls after the third: the slowest is printed")
    ap.add_argument("--child", nargs=2, metavar=("CACHE", "DEVICE"))
    ap.add_argument("--cuda", action="store_true", help="also PyTorch eager on CUDA (a GPU machine; no backward)")
    ap.add_argument("--torch-xla-python", default=os.environ.get("TORCH_XLA_PYTHON"), help="also torch_xla's rows")
    ap.add_argument("--devices", help="only these rows, e.g. cpu,tx-compile (CPU eager always runs: the baseline)")
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
        devices = ("cpu", "xla") + (("compile",) if cache == "static" else ()) + (("cuda",) if a.cuda else ())
        if a.torch_xla_python:
            devices += ("tx-xla",) + (("tx-compile",) if cache == "static" else ())
        if a.devices:
            devices = tuple(d for d in devices if d == "cpu" or d in a.devices.split(","))
        for device in devices:
            # The child imports this module rather than running it as ``__main__`` (``-m``): so
            # run, CPU eager's token took 5.9-6.4 ms against 4.2-4.5 (and the compiled path's
            # 7.1-7.6 against 6.8-6.9): PyTorch's OpenMP threads cost more so, with or without
            # xlatorch imported (docs/text-generation.md).
            child = (f"import json; from bench.generate import _child; print(json.dumps(_child("
                     f"{cache!r}, {device!r}, {a.tokens}, {a.prompt}, {a.later})))")  # fmt: skip
            tx = device.startswith("tx-")
            cmd = [a.torch_xla_python if tx else sys.executable, "-c", child]
            run_env = dict(env, PJRT_DEVICE=env.get("PJRT_DEVICE", "CPU")) if tx else env
            out = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=run_env, capture_output=True, text=True)
            if out.returncode and tx:  # torch_xla's failure is a figure too: said, and the rest goes on
                last = [ln for ln in out.stderr.splitlines() if ln.strip()][-3:]
                print(f"bench.generate: {cache}/{device} (torch_xla) failed, exit {out.returncode}: {' | '.join(last)}")
                continue
            if out.returncode:
                print(out.stderr[-2000:])
                raise SystemExit(f"bench.generate: {cache}/{device} failed")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'cache':8} {'device':10} {'first s':>8} {'comp':>5} {'second s':>9} {'comp':>5} {'third s':>8} "
          f"{'comp':>5} {'ms/token':>9} {'later ms/token':>14} {'slowest later s':>15} {'comp':>5}  "
          f"same tokens as CPU")  # fmt: skip
    by = {(r["cache"], r["device"]): r for r in rows}
    for r in rows:
        cpu = by[(r["cache"], "cpu")]
        same = all(r[f"{n}_tokens"] == cpu[f"{n}_tokens"] for n in ("first", "second", "third"))
        calls = "".join(f" {r[n + '_s']:8.2f} {r[n + '_compiles']:5}" for n in ("first", "second", "third"))
        print(
            f"{r['cache']:8} {r['device']:10}{calls} {r['per_token_ms']:9.2f} {r['later_token_ms']:14.2f} "
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
    for r in rows:
        if r["device"] == "compile":  # xlatorch's counter (torch_xla has none)
            dyn = ", ".join(str(r[f"{n}_dynamo"]) for n in ("first", "second", "third"))
            print(f"{r['cache']}/{r['device']}: forward graphs Dynamo made in the first three calls: {dyn}")
    print("ms per token over the later calls, by phase (" + ", ".join(_PHASES.values()) + ", rest):")
    for r in rows:
        print(f"  {r['cache']:8} {r['device']:10} " + "  ".join(f"{k} {v:.2f}" for k, v in r["phase_ms"].items()))
    for (cache, device), x in by.items():
        t = by.get((cache, "tx-" + device))
        if t is not None:
            third, later = x["per_token_ms"] / t["per_token_ms"], x["later_token_ms"] / t["later_token_ms"]
            print(f"{cache}/{device} vs torch_xla's: per token {third:.2f}x (third call), {later:.2f}x (median later)")
    with open(os.path.join(HERE, "results.jsonl"), "a") as f:
        for r in rows:
            r = {k: v for k, v in r.items() if not k.endswith("_tokens")}
            f.write(json.dumps({"bench": "generate", "tokens": a.tokens, "prompt": a.prompt, **r}) + "\n")


if __name__ == "__main__":
    main()
