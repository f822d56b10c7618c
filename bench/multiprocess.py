"""Data-parallel step time: the MLP program in 1 process vs N processes (xmp.spawn), one run.

Each replica trains on its own batch of the program's batch size and averages
gradients with ``xm.optimizer_step``; the step time is the median over the
steady-state steps of replica 0. Not a test: it prints the ratio.

Usage: python -m bench.multiprocess [--steps N] [--nprocs 2] [--program mlp] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xlatorch.core.xla_model as xm  # noqa: E402
import xlatorch.debug.metrics as met  # noqa: E402
import xlatorch.distributed.xla_multiprocessing as xmp  # noqa: E402
import xlatorch.runtime as xr  # noqa: E402
from examples.models import programs  # noqa: E402


def _replica(index, name, small, steps, out):
    p = programs(small=small)[name]
    dev = xm.xla_device()
    torch.manual_seed(0)
    model = p.make_model().to(dev)
    opt = p.make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1 + xr.global_ordinal())
    batches = [tuple(t.to(dev) for t in p.make_batch(gen)) for _ in range(4)]
    xm.mark_step()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        p.loss_fn(model(batches[i % 4][0]), batches[i % 4][1]).backward()
        xm.optimizer_step(opt)
        xm.mark_step(wait=True)
        times.append(time.perf_counter() - t0)
    if xr.global_ordinal() == 0:
        with open(out, "w") as f:
            json.dump(dict(step=statistics.median(times[2:]), compiles=met.counter_value("UncachedCompile"),
                           all_reduce=met.counter_value("xla::all_reduce")), f)  # fmt: skip


def measure(name, small, steps, nprocs) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        xmp.spawn(_replica, args=(name, small, steps, out), nprocs=nprocs)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--program", default="mlp")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    a = ap.parse_args()
    one = measure(a.program, a.small, a.steps, 1)
    many = measure(a.program, a.small, a.steps, a.nprocs)
    row = dict(bench="multiprocess", program=a.program, small=a.small, nprocs=a.nprocs,
               one_ms=one["step"] * 1e3, many_ms=many["step"] * 1e3, ratio=many["step"] / one["step"],
               compiles=many["compiles"], all_reduce=many["all_reduce"], time=time.time())  # fmt: skip
    print(f"{a.program}: 1 process {row['one_ms']:.2f} ms/step, {a.nprocs} processes {row['many_ms']:.2f} ms/step "
          f"(ratio {row['ratio']:.2f}; {a.nprocs}x the samples per step; compiles {row['compiles']}, "
          f"all-reduces {row['all_reduce']})")  # fmt: skip
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
