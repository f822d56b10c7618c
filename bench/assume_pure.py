"""Host time of one call of a function of N small ops, traced op by op and replayed by
``assume_pure``: the replay's cost does not grow with N. Not a test: it prints microseconds
per call and their ratio, measured in one run (the device work is not timed: nothing syncs
inside the timed calls, and a sync after each batch of calls keeps the graph small).

Usage: python -m bench.assume_pure [--ops 10,100,1000] [--calls 50]
"""

from __future__ import annotations

import argparse
import time

import torch

import xlatorch
from xlatorch.experimental.assume_pure import assume_pure


def _chain(n):
    def f(x):
        for i in range(n):
            x = x * 1.0001 + 0.5 if i % 2 else torch.tanh(x)
        return x

    return f


def _per_call_us(fn, x, calls: int) -> float:
    fn(x)  # the first call traces (assume_pure) / warms up
    xlatorch.sync(wait=True)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = fn(x)
        t = time.perf_counter() - t0
        best = min(best, t)
        del y
        xlatorch.sync(wait=True)
    return 1e6 * best / calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="10,100,1000")
    p.add_argument("--calls", type=int, default=50)
    a = p.parse_args()
    x = torch.randn(64, device=xlatorch.device())
    print(f"{'ops':>6} {'traced_us':>10} {'assume_pure_us':>15} {'ratio':>7}")
    for n in (int(s) for s in a.ops.split(",")):
        f = _chain(n)
        traced = _per_call_us(f, x, max(1, a.calls * 10 // n))
        pure = _per_call_us(assume_pure(f), x, max(1, a.calls * 10 // n))
        print(f"{n:>6} {traced:>10.1f} {pure:>15.1f} {pure / traced:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
