"""A GPT-style model's training step with its blocks in a Python loop and under ``scan_layers``:
first-step time, program size and steady step time at several depths. Not a test: it prints
figures and the ratio of the two ways, measured in one run.

Each (depth, way) runs in a fresh process with the persistent compile cache off
(``XLATORCH_CACHE_DIR=``), as a user's first run. ``first_step_s``: from the start of the first
step to its loss on the host (trace, compile, run); ``step_ms``: median of the steps after
the first two; ``program_lines``: lines of the step's StableHLO (``xlatorch.debug.dump.hlo_text``
of the updated parameters, before XLA's optimisations).

Usage: python -m bench.scan_layers [--depths 4,8,16,32] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.gpt import BATCH, N_EMBD, N_HEAD, SEQ

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(depth: int, way: str, steps: int) -> dict:
    import statistics
    import time

    import torch

    import xlatorch
    from bench.gpt import GPT, batch, loss_of
    from xlatorch.debug.dump import hlo_text
    from xlatorch.experimental.scan_layers import scan_layers

    torch.manual_seed(0)
    dev = xlatorch.device()
    model = GPT(depth).to(dev)
    if way == "scan_layers":
        model.run_blocks = scan_layers
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx, tgt = batch(dev)
    xlatorch.sync(wait=True)
    times, lines = [], None
    for i in range(steps):
        t0 = time.perf_counter()
        loss = loss_of(model, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            t_lines = time.perf_counter()
            lines = len(hlo_text(list(model.parameters()) + [loss]).splitlines())
            t0 += time.perf_counter() - t_lines  # lowering it for the count is not the step's time
        xlatorch.sync()
        loss.item()
        times.append(time.perf_counter() - t0)
    return {"first_step_s": times[0], "step_ms": 1e3 * statistics.median(times[2:]), "program_lines": lines,
            "loss": loss.item()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--depths", default="4,8,16,32")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--child", nargs=2)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(int(a.child[0]), a.child[1], a.steps)))
        return
    env = dict(os.environ, XLATORCH_CACHE_DIR="", JAX_ENABLE_COMPILATION_CACHE="false")
    print(f"GPT-style model: n_embd {N_EMBD}, {N_HEAD} heads, seq {SEQ}, batch {BATCH}, SGD; one process per row")
    print(f"{'layers':>6} {'way':>12} {'first_step_s':>13} {'step_ms':>9} {'program_lines':>14} {'loss':>9}")
    for d in [int(x) for x in a.depths.split(",")]:
        rows = {}
        for way in ("loop", "scan_layers"):
            out = subprocess.run([sys.executable, "-m", "bench.scan_layers", "--steps", str(a.steps), "--child",
                                  str(d), way], cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
            if out.returncode:
                print(f"{d:>6} {way:>12} failed: {out.stderr[-500:]}")
                continue
            r = rows[way] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{d:>6} {way:>12} {r['first_step_s']:>13.2f} {r['step_ms']:>9.1f} {r['program_lines']:>14} "
                  f"{r['loss']:>9.4f}", flush=True)  # fmt: skip
        if len(rows) == 2:
            lo, sc = rows["loop"], rows["scan_layers"]
            ratio = {k: sc[k] / lo[k] for k in ("first_step_s", "step_ms", "program_lines")}
            print(f"{d:>6} {'scan/loop':>12} {ratio['first_step_s']:>13.2f} {ratio['step_ms']:>9.2f} "
                  f"{ratio['program_lines']:>14.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
