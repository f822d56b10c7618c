"""Host cost of a sync of a cached graph: microseconds in ``xm.mark_step()`` at steady state.

A chain of N adds (``x = x + 1``, N nodes, one output) is traced outside the timed region,
then one ``mark_step`` runs its cached executable. Printed per N: the whole sync, the part
spent inside the executable's call (``ExecuteDispatchTime``: JAX's dispatch, and on CPU the
computation itself, which XLA runs in the caller) and the rest, which is xlatorch's host
cost. The medians of many syncs, over 3 rounds; beside them, JAX's own call of the same chain
under ``jax.jit`` (its dispatch: the floor for the executable's call).

Usage: python -m bench.sync_cost [N ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import xlatorch.core.xla_model as xm
from xlatorch.runtime.base import record


def measure(n_nodes: int, reps: int = 300) -> tuple[float, float]:
    """``(sync µs, executable-call µs)``: medians at steady state for a chain of ``n_nodes`` adds."""
    dev = xm.xla_device()
    a = torch.zeros(4, device=dev)
    xm.mark_step()
    total, inside = [], []
    for i in range(reps + 20):
        x = a
        for _ in range(n_nodes):
            x = x + 1
        before = len(record.METRICS.get("ExecuteDispatchTime", ()))
        t = time.perf_counter_ns()
        xm.mark_step()
        dt = time.perf_counter_ns() - t
        after = record.METRICS.get("ExecuteDispatchTime", ())
        if i >= 20:  # the first ones compile
            total.append(dt / 1e3)
            inside.append((after[-1] if len(after) > before else 0) / 1e3)
        del x
    return statistics.median(total), statistics.median(inside)


def jax_call(n_nodes: int, reps: int = 300) -> float:
    """JAX's own floor: µs to call the same chain ``jax.jit``-ed (median), on the same device."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def chain(x):
        for _ in range(n_nodes):
            x = x + 1
        return x

    x = jnp.zeros(4, jnp.float32)
    times = []
    for _ in range(reps + 20):
        t = time.perf_counter_ns()
        y = chain(x)
        times.append((time.perf_counter_ns() - t) / 1e3)
        y.block_until_ready()
    return statistics.median(times[20:])


def main() -> None:
    sizes = [int(s) for s in sys.argv[1:]] or [1, 10, 100, 1000]
    print(f"{'nodes':>6} {'sync us':>9} {'exe call us':>11} {'host us':>9} {'jax call us':>11}")
    for n in sizes:
        rounds = [measure(n, 300 if n < 1000 else 60) for _ in range(3)]
        tot = statistics.median(r[0] for r in rounds)
        ins = statistics.median(r[1] for r in rounds)
        print(f"{n:6d} {tot:9.1f} {ins:11.1f} {tot - ins:9.1f} {jax_call(n):11.1f}")


if __name__ == "__main__":
    main()
