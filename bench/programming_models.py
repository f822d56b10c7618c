"""One training step of the GPT-style model (``bench/gpt.py``, SGD) written each way a
torch_xla user can write it, against PyTorch eager on CPU: lazy tracing, ``torch.compile``,
``torch_xla.compile``, eager mode, ``assume_pure`` blocks and ``scan_layers``. Not a test: it
prints figures and ratios measured in one run (docs/programming-models.md quotes them).

Each way runs in a fresh process with the persistent compile cache off. ``first_step_s``: the
first step, trace and compile included, to its loss on the host; ``step_ms``: median of the
steps after the first two; ``compiles``: XLA compiles over the run (eager mode's per-op
compiles included).

Usage: python -m bench.programming_models [--depth 4] [--steps 8] [--ways lazy,compile,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("cpu_eager", "lazy", "torch_compile", "xla_compile", "eager_mode", "assume_pure", "scan_layers")


def _child(way: str, depth: int, steps: int) -> dict:
    import statistics
    import time

    import torch

    import xlatorch
    import xlatorch.debug.metrics as met
    from bench.gpt import GPT, batch, loss_of
    from xlatorch.experimental import eager_mode
    from xlatorch.experimental.assume_pure import assume_pure
    from xlatorch.experimental.scan_layers import scan_layers

    torch.manual_seed(0)
    dev = torch.device("cpu") if way == "cpu_eager" else xlatorch.device()
    model = GPT(depth).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx, tgt = batch(dev)
    forward = model
    if way == "torch_compile":
        forward = torch.compile(model, backend="openxla")
    elif way == "scan_layers":
        model.run_blocks = scan_layers
    elif way == "assume_pure":
        call = assume_pure(torch.func.functional_call)

        def run_blocks(blocks, x):
            for b in blocks:
                x = call(b, dict(b.named_parameters()), (x,))
            return x

        model.run_blocks = run_blocks

    def step():
        loss = loss_of(forward, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if way == "xla_compile":
        step = xlatorch.compile(step)
    if way == "eager_mode":
        eager_mode(True)
    if way != "cpu_eager":
        xlatorch.sync(wait=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        if way not in ("cpu_eager", "xla_compile", "eager_mode"):
            xlatorch.sync()
        value = loss.item()
        times.append(time.perf_counter() - t0)
    compiles = sum((met.metric_data(m) or (0,))[0] for m in ("CompileTime", "EagerOpCompileTime"))
    return {"first_step_s": times[0], "step_ms": 1e3 * statistics.median(times[2:]),
            "compiles": 0 if way == "cpu_eager" else compiles, "loss": value}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.depth, a.steps)))
        return
    env = dict(os.environ, XLATORCH_CACHE_DIR="", JAX_ENABLE_COMPILATION_CACHE="false")
    print(f"GPT-style model, {a.depth} blocks (bench/gpt.py), SGD, {a.steps} steps; one process per row")
    print(f"{'way':>14} {'first_step_s':>13} {'step_ms':>9} {'x_cpu_step':>11} {'compiles':>9} {'loss':>9}")
    base = None
    for way in a.ways.split(","):
        cmd = [sys.executable, "-m", "bench.programming_models", "--depth", str(a.depth), "--steps", str(a.steps),
               "--child", way]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{way:>14} failed: {out.stderr[-800:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = r["step_ms"] if way == "cpu_eager" else base
        ratio = f"{r['step_ms'] / base:>11.2f}" if base else f"{'-':>11}"
        print(f"{way:>14} {r['first_step_s']:>13.2f} {r['step_ms']:>9.1f} {ratio} {r['compiles']:>9} "
              f"{r['loss']:>9.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
