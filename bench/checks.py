"""What the on-device checks cost: the three programs' steady-state step with checks on and
off (``XLATORCH_CHECKS``, read at import, so each run is its own process; runs alternate
on, off, on, off ... to spread machine noise evenly). Not a test: it prints ratios.

Every program has checked ops (``nll_loss`` targets; GPT also ``embedding`` indices).

Usage: python -m bench.checks [--steps N] [--rounds R] [--small] [--programs mnist,mlp,gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(name: str, steps: int, small: bool) -> None:
    sys.path.insert(0, ROOT)
    from bench.bench import run_xla
    from examples.models import programs

    x = run_xla(programs(small=small)[name], steps)
    print(json.dumps(dict(step=x["step"], pipe=x["pipelined"], compiles=x["steady_compiles"],
                          transfers=x["steady_transfers"])))  # fmt: skip


def _run(name: str, steps: int, small: bool, on: bool) -> dict:
    env = dict(os.environ, XLATORCH_CHECKS="1" if on else "0")
    cmd = [sys.executable, "-m", "bench.checks", "--child", name, "--steps", str(steps)]
    cmd += ["--small"] if small else []
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--programs", default="mnist,mlp,gpt")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.steps, a.small)
        return
    print("per step, waited for (median) and back to back ('pipe': N steps, then one wait)")
    print(f"{'program':8} {'checks on ms':>12} {'checks off ms':>13} {'on/off':>7} "
          f"{'pipe on ms':>10} {'pipe off ms':>11} {'on/off':>7} {'steady compiles on/off':>22}")  # fmt: skip
    for name in a.programs.split(","):
        on, off = [], []
        for _ in range(a.rounds):
            on.append(_run(name, a.steps, a.small, True))
            off.append(_run(name, a.steps, a.small, False))
        t_on = statistics.median(r["step"] for r in on) * 1e3
        t_off = statistics.median(r["step"] for r in off) * 1e3
        p_on = statistics.median(r["pipe"] for r in on) * 1e3
        p_off = statistics.median(r["pipe"] for r in off) * 1e3
        c = f"{sum(r['compiles'] for r in on)}/{sum(r['compiles'] for r in off)}"
        print(f"{name:8} {t_on:12.2f} {t_off:13.2f} {t_on / t_off:7.3f} {p_on:10.2f} {p_off:11.2f} "
              f"{p_on / p_off:7.3f} {c:>22}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
