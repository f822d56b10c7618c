"""Eager mode's cost per op at steady state, against PyTorch eager on CPU, in one process.

Each op runs many times on fixed inputs after a warm-up that compiles its graph (eager mode
compiles each op once per signature, then hits the cache), with a wait for the device at the
end of each round, so the time counts the op's execution as well as its launch. Beside it:
the same op in PyTorch eager on CPU, and in xlatorch's lazy mode traced and run as one graph
per round (``mark_step``), whose cost per op is what eager mode's per-op sync adds to.

Usage: python -m bench.eager_ops [--n 500] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import xlatorch.core.xla_model as xm
from bench import trace_ops
from xlatorch.experimental import eager_mode

# The ops of bench.trace_ops (the same small ops, measured there for tracing alone), but ``t``.
OPS = {k: v for k, v in trace_ops.OPS.items() if k != "t"}


def _time(fn, args, n: int, end) -> float:
    """Median over 5 rounds of the mean µs per call (``end()`` closes each round)."""
    for _ in range(20):
        fn(*args)
    end()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        end()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def measure(n: int = 500, size: int = 64) -> dict:
    """``{op: (eager µs, CPU eager µs, lazy µs)}`` per call at steady state."""
    dev = xm.xla_device()
    cpu = [torch.randn(size, size), torch.randn(size, size), torch.randn(size, size)]
    xla = [t.to(dev) for t in cpu]
    xm.mark_step()
    res = {}
    for name, fn in OPS.items():
        lazy = _time(fn, xla, n, lambda: xm.mark_step(wait=True))
        eager_mode(True)
        try:
            eager = _time(fn, xla, n, xm.wait_device_ops)
        finally:
            eager_mode(False)
        res[name] = (eager, _time(fn, cpu, n, lambda: None), lazy)
    return res


def report(res: dict) -> None:
    print(f"{'op':12} {'eager us':>9} {'CPU us':>8} {'eager/CPU':>9} {'lazy us':>8}")
    for name, (eager, cpu, lazy) in res.items():
        print(f"{name:12} {eager:9.1f} {cpu:8.1f} {eager / cpu:9.1f} {lazy:8.1f}")
    e = statistics.mean(v[0] for v in res.values())
    c = statistics.mean(v[1] for v in res.values())
    la = statistics.mean(v[2] for v in res.values())
    print(f"{'mean':12} {e:9.1f} {c:8.1f} {e / c:9.1f} {la:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=500, help="calls per round")
    p.add_argument("--size", type=int, default=64, help="the inputs are size x size")
    a = p.parse_args()
    report(measure(a.n, a.size))


if __name__ == "__main__":
    main()
