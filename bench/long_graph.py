"""Compile time of a long graph: N chained ``t = t + 1`` on an xla tensor of 8 floats, and
``jax.jit`` of the same Python loop. Not a test: it prints the times of one run.

xlatorch: ``first sync`` is the wall time of the first ``.cpu()`` of the chain (trace not
included: the chain is built before the clock starts); then the same graph is lowered and
compiled again outside the sync, split into ``lower`` (JAX tracing + StableHLO emission:
``runtime/execute/lowered.lower``) and ``compile`` (XLA: ``runtime/lower/compiler.compile``),
with the HLO's op count. jax: ``jax.jit(loop).lower(x)`` and ``.compile()`` the same way.

Read the jax column knowing what XLA compiles: ``1`` is a literal there, and XLA folds the
chain of adds of a constant into one add (its optimized HLO is one fusion of one op), while
xlatorch passes every host scalar as a parameter (never a constant: a learning rate that
changes must not recompile), so XLA compiles all N adds. The same JAX loop with its scalars
as elements of a vector argument (``t = t + p[i]``) is no fair yardstick either: at N=600,
XLA's compile of it outgrew 6 GB on the machine this was written on (2 cores, jaxlib 0.10.2).
The persistent compile cache is off (``XLATORCH_CACHE_DIR=``).

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
    import jax
    import torch

    import xlatorch.core.xla_model as xm
    from xlatorch.runtime.base.dtypes import to_jax
    from xlatorch.runtime.execute.lowered import graph_of
    from xlatorch.runtime.ir.values import Data
    from xlatorch.runtime.lower import compiler
    from xlatorch.runtime.lower.function import lower_fn, plan, shared
    from xlatorch.runtime.plan.collect import pack

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
    nodes, leaves, refs = graph_of(t)  # as a sync lowers it (runtime/lower/executable.py), equal scalars shared
    packed, kinds = pack(leaves)
    fn = lower_fn(plan(nodes, leaves), kinds, refs, share=shared(packed))
    data = [jax.ShapeDtypeStruct(v.aval[0], to_jax(v.aval[1])) for v in leaves if type(v) is Data]
    lowered = jax.jit(fn).lower(data, [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in packed])
    low = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(lowered)
    comp = time.perf_counter() - t0
    return dict(trace=trace, sync=sync, lower=low, compile=comp, ops=_ops(lowered.as_text()))


def _jax(n: int) -> dict:
    import jax
    import jax.numpy as jnp

    def loop(t):
        for _ in range(n):
            t = t + 1
        return t

    x = jnp.zeros(8, jnp.float32)
    t0 = time.perf_counter()
    lowered = jax.jit(loop).lower(x)
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
          f"{'jax lower s':>11} {'compile s':>9} {'ops':>6}")  # fmt: skip
    for n in map(int, a.n.split(",")):
        x = _xlatorch(n)
        j = _jax(n)
        print(f"{n:6d} {x['trace']:8.2f} {x['sync']:10.2f} {x['lower']:8.2f} {x['compile']:9.2f} {x['ops']:8d} | "
              f"{j['lower']:11.2f} {j['compile']:9.2f} {j['ops']:6d}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
