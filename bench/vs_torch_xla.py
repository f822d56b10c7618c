"""xlatorch against torch_xla itself on the bench's three programs: the same training step
(``examples/models.py``), each side in its own process, run alternately (xlatorch, torch_xla,
xlatorch, ...) so machine noise falls on both. Not a test: it prints ratios of one run.

torch_xla needs its own torch, so it lives in a venv of its own, e.g.
``python3.11 -m venv ~/txvenv && ~/txvenv/bin/pip install torch==2.9.0 torch_xla==2.9.0``
(a CUDA build of torch, several GB; it runs on the CPU with ``PJRT_DEVICE=CPU``).

Usage: python -m bench.vs_torch_xla --torch-xla-python ~/txvenv/bin/python [--steps N] [--rounds R]
       [--small] [--programs mnist,mlp,gpt]   (or set TORCH_XLA_PYTHON)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _xlatorch(name: str, steps: int, small: bool) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); from bench.bench import run_xla; "
            f"from examples.models import programs; x = run_xla(programs(small={small!r})[{name!r}], {steps}); "
            "print(json.dumps({k: x[k] for k in ('step', 'pipelined', 'first', 'first_loss')}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torch_xla(python: str, name: str, steps: int, small: bool) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    cmd = [python, os.path.join(ROOT, "bench", "torch_xla_run.py"), name, str(steps)] + (["--small"] if small else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-xla-python", default=os.environ.get("TORCH_XLA_PYTHON"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--programs", default="mnist,mlp,gpt")
    a = ap.parse_args()
    if not a.torch_xla_python:
        ap.error("give --torch-xla-python (the python of a venv with torch_xla installed) or set TORCH_XLA_PYTHON")
    print(
        "ms: median step waited for / per step back to back ('pipe'); ratios xlatorch / torch_xla; "
        f"{a.rounds} alternating rounds, medians"
    )
    print(f"{'program':8} {'xlatorch':>9} {'torch_xla':>9} {'ratio':>6} {'x pipe':>7} {'tx pipe':>7} {'ratio':>6} "
          f"{'x 1st s':>7} {'tx 1st s':>8} {'loss x/tx':>15}")  # fmt: skip
    for name in a.programs.split(","):
        xs, ts = [], []
        for _ in range(a.rounds):
            xs.append(_xlatorch(name, a.steps, a.small))
            ts.append(_torch_xla(a.torch_xla_python, name, a.steps, a.small))

        def med(rows, k):
            return statistics.median(r[k] for r in rows)

        x, t = {k: med(xs, k) for k in xs[0]}, {k: med(ts, k) for k in ts[0]}
        print(f"{name:8} {x['step'] * 1e3:9.2f} {t['step'] * 1e3:9.2f} {x['step'] / t['step']:6.2f} "
              f"{x['pipelined'] * 1e3:7.2f} {t['pipelined'] * 1e3:7.2f} {x['pipelined'] / t['pipelined']:6.2f} "
              f"{x['first']:7.2f} {t['first']:8.2f} {x['first_loss']:7.4f}/{t['first_loss']:<7.4f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
