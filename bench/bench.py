"""Steady-state step time of the three programs: xlatorch vs PyTorch eager on CPU, and
tracing cost per op, measured in one process. Not a test: it prints ratios.

Usage: python -m bench.bench [--steps N] [--small] [--programs mnist,mlp,gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xlatorch.core.xla_model as xm  # noqa: E402
import xlatorch.debug.metrics as met  # noqa: E402
from examples.models import programs  # noqa: E402


def _setup(p, device):
    torch.manual_seed(0)
    model = p.make_model().to(device)
    opt = p.make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in p.make_batch(gen)) for _ in range(4)]
    if device != "cpu":
        xm.mark_step()
    return model, opt, batches


def _step(p, model, opt, batch):
    opt.zero_grad()
    loss = p.loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss


def run_eager(p, steps):
    model, opt, batches = _setup(p, "cpu")
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        _step(p, model, opt, batches[i % 4])
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]), times[0]


def run_xla(p, steps):
    model, opt, batches = _setup(p, xm.xla_device())
    met.clear_all()
    first = time.perf_counter()
    _step(p, model, opt, batches[0])
    xm.mark_step(wait=True)
    first = time.perf_counter() - first
    _step(p, model, opt, batches[1])
    xm.mark_step(wait=True)
    compiles_before = met.counter_value("UncachedCompile") or 0
    trace, step_times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        _step(p, model, opt, batches[i % 4])
        t1 = time.perf_counter()
        xm.mark_step(wait=True)
        step_times.append(time.perf_counter() - t0)
        trace.append(t1 - t0)
    nodes = met.metric_data("TensorsGraphSize")[2][-1][1]
    return dict(
        step=statistics.median(step_times),
        first=first,
        trace_us_per_op=statistics.median(trace) / nodes * 1e6,
        graph_nodes=int(nodes),
        steady_compiles=(met.counter_value("UncachedCompile") or 0) - compiles_before,
        fallbacks=met.executed_fallback_ops(),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--programs", default="mnist,mlp,gpt")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    a = ap.parse_args()
    progs = programs(small=a.small)
    print(f"{'program':8} {'eager ms':>9} {'xla ms':>8} {'xla/eager':>9} {'first s':>8} {'trace us/op':>11} "
          f"{'nodes':>6} {'compiles':>8} fallbacks")  # fmt: skip
    for name in a.programs.split(","):
        p = progs[name]
        eager, _ = run_eager(p, a.steps)
        x = run_xla(p, a.steps)
        row = dict(program=name, small=a.small, eager_ms=eager * 1e3, xla_ms=x["step"] * 1e3,
                   ratio=x["step"] / eager, first_s=x["first"], **{k: x[k] for k in
                   ("trace_us_per_op", "graph_nodes", "steady_compiles", "fallbacks")}, time=time.time())  # fmt: skip
        print(f"{name:8} {row['eager_ms']:9.2f} {row['xla_ms']:8.2f} {row['ratio']:9.2f} {row['first_s']:8.2f} "
              f"{row['trace_us_per_op']:11.1f} {row['graph_nodes']:6d} {row['steady_compiles']:8d} {row['fallbacks']}",
              flush=True)  # fmt: skip
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
