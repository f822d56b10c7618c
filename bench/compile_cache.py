"""The persistent compilation cache: a first step's compiles in a new process, cold (empty
cache) vs warm (every graph compiled before by another process), one run. Not a test: it
prints figures and their ratio.

The warm process reads the cache after it was moved to another directory (the key must not
depend on where the cache lives). ``compile_s``: the ``CompileTime`` metric (lowering to
StableHLO and XLA's compile, or the cache's loads instead); ``step_s``: wall time of the
first step to its loss on the host; ``process_s``: the child's whole life (imports too);
``hits``/``program_hits``: graphs whose XLA compile / lowered program came from the cache.
``--rounds R`` repeats the pair R times and prints medians (figures on a shared machine vary).

Usage: python -m bench.compile_cache [--program gpt] [--steps 1] [--small] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import torch
import xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
from examples.models import programs
name, steps, small = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
p = programs(small=small)[name]
torch.manual_seed(0)
model = p.make_model().to("xla")
opt = p.make_opt(model.parameters())
g = torch.Generator().manual_seed(1)
xm.mark_step()
met.clear_all()
t0 = time.perf_counter()
for _ in range(steps):
    x, y = (t.to("xla") for t in p.make_batch(g))
    opt.zero_grad()
    loss = p.loss_fn(model(x), y)
    loss.backward()
    opt.step()
    xm.mark_step()
    loss.item()
step_s = time.perf_counter() - t0
compile_data = met.metric_data("CompileTime")
print(json.dumps(dict(step_s=step_s, compile_s=compile_data[1] / 1e9 if compile_data else 0.0,
                      compiles=met.counter_value("UncachedCompile") or 0,
                      hits=met.counter_value("PersistentCacheHit") or 0,
                      misses=met.counter_value("PersistentCacheMiss") or 0,
                      program_hits=met.counter_value("ProgramCacheHit") or 0,
                      process_s=time.perf_counter() - t_start)))
"""


def run_child(cache_dir: str, program: str, steps: int, small: bool) -> dict:
    """One new process running ``steps`` steps of ``program`` with the cache in ``cache_dir``."""
    env = dict(os.environ, XLATORCH_CACHE_DIR=cache_dir, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, program, str(steps), "1" if small else "0"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)  # fmt: skip
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["wall_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", default="gpt", choices=("gpt", "mlp", "mnist"))
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
            rows["cold"].append(run_child(a, args.program, args.steps, args.small))
            shutil.move(a, b)  # the warm process finds the cache somewhere else
            rows["warm"].append(run_child(b, args.program, args.steps, args.small))
    cold, warm = ({k: statistics.median(r[k] for r in rows[name]) for k in rows[name][0]} for name in ("cold", "warm"))
    for name, row in (("cold", cold), ("warm", warm)):
        print(f"{name}: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"warm/cold compile_s: {warm['compile_s'] / cold['compile_s']:.3f}  "
          f"step_s: {warm['step_s'] / cold['step_s']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
