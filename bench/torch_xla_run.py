"""The bench's training step under torch_xla itself: run by ``bench/vs_torch_xla.py`` with the
Python of a venv where torch_xla is installed (its own torch). Imports nothing of xlatorch.

Usage (normally through vs_torch_xla): PJRT_DEVICE=CPU TX_PYTHON bench/torch_xla_run.py PROGRAM STEPS [--small]
Prints one JSON line: step (waited, median), pipelined (per step), first (s), first_loss.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

from examples.models import programs  # noqa: E402


def _step(p, model, opt, batch):
    opt.zero_grad()
    loss = p.loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss


def main() -> None:
    name, steps, small = sys.argv[1], int(sys.argv[2]), "--small" in sys.argv
    p = programs(small=small)[name]
    dev = xm.xla_device()
    torch.manual_seed(0)
    model = p.make_model().to(dev)
    opt = p.make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(dev) for t in p.make_batch(gen)) for _ in range(4)]
    xm.mark_step()
    t = time.perf_counter()
    loss = _step(p, model, opt, batches[0])
    xm.mark_step(wait=True)
    first = time.perf_counter() - t
    first_loss = loss.item()
    _step(p, model, opt, batches[1])
    xm.mark_step(wait=True)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        _step(p, model, opt, batches[i % 4])
        xm.mark_step(wait=True)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(steps):
        _step(p, model, opt, batches[i % 4])
        xm.mark_step()
    xm.wait_device_ops()
    pipelined = (time.perf_counter() - t) / steps
    print(json.dumps(dict(step=statistics.median(times), pipelined=pipelined, first=first, first_loss=first_loss)))


if __name__ == "__main__":
    main()
