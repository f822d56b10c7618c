"""Compile time of a long graph: N chained ``t = t + 1`` on an xla tensor of 8 floats, and
``jax.jit`` of the same Python loop. Not a test: it prints the times of one run.

xlatorch: ``first sync`` is the wall time of the first ``.cpu()`` of the chain (trace not
included: the chain is built before the clock starts); then the same graph is lowered and
compiled again outside the sync, split into ``lower`` (JAX tracing + StableHLO emission:
``runtime/execute/lowered.lower``) and ``compile`` (XLA: ``runtime/lower/compiler.compile``),
with the HLO's op count. jax: ``jax.jit(loop).lower(x)`` and ``.compile()`` the same way,
twice: ``jax const``, the loop as written (``1`` is a literal: XLA folds the 5,000 adds of a
constant into one add, so it compiles a one-op program), and ``jax args``, the same loop with
each ``1`` an element of a vector argument (``t = t + p[i]``), as xlatorch passes host scalars
(parameters, never constants: a changing learning rate must not recompile). ``jax args`` is
the program xlatorch's graph should match. The persistent compile cache is off
(``XLATORCH_CACHE_DIR=``).

Usage: python -m bench.long_graph [--n 1000,5000,20000]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLATORCH_CACHE_DIR", "")


def _ops(text: str) -> int:
    return sum(1 for line in text.splitlines() if " = " in line and "stablehlo." in line)


def _xlatorch(n: int) -> dict:
    import torch

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.execute.lowered import lower
    from xlatorch.runtime.lower import compiler

    dev = xm.xla_device()
    x = torch.zeros(8, device=dev)
    xm.mark_step()
    t0 = time.perf_counter()
    t = x
    for _ in range(n):
        t = t + 1
    trace = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = t.cpu()
    sync = time.perf_counter() - t0
    assert float(out[0]) == n, out
    t = x
    for _ in range(n):
        t = t + 1
    t0 = time.perf_counter()
    lowered = lower(t)[0]
    low = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(lowered)
    comp = time.perf_counter() - t0
    return dict(trace=trace, sync=sync, lower=low, compile=comp, ops=_ops(lowered.as_text()))


def _jax(n: int, args: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    def loop(t, p=None):
        for i in range(n):
            t = t + (p[i] if args else 1)
        return t

    x = (jnp.zeros(8, jnp.float32),) + ((np.ones(n, np.float32),) if args else ())
    t0 = time.perf_counter()
    lowered = jax.jit(loop).lower(*x)
    low = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered.compile()
    comp = time.perf_counter() - t0
    return dict(lower=low, compile=comp, ops=_ops(lowered.as_text()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="1000,5000,20000")
    a = ap.parse_args()
    print(f"{'N':>6} {'trace s':>8} {'1st sync s':>10} {'lower s':>8} {'compile s':>9} {'HLO ops':>8} | "
          f"{'jax const: lower s':>18} {'compile s':>9} {'ops':>6} | {'jax args: lower s':>17} {'compile s':>9} "
          f"{'ops':>6} | {'xlatorch/jax args':>17}")  # fmt: skip
    for n in map(int, a.n.split(",")):
        x = _xlatorch(n)
        c = _jax(n, False)
        j = _jax(n, True)
        ratio = (x["lower"] + x["compile"]) / (j["lower"] + j["compile"])
        print(f"{n:6d} {x['trace']:8.2f} {x['sync']:10.2f} {x['lower']:8.2f} {x['compile']:9.2f} {x['ops']:8d} | "
              f"{c['lower']:18.2f} {c['compile']:9.2f} {c['ops']:6d} | {j['lower']:17.2f} {j['compile']:9.2f} "
              f"{j['ops']:6d} | {ratio:17.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
