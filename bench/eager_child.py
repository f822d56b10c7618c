"""PyTorch eager's step time, ``bench.bench``'s baseline: in its process on the CPU, and for
``--eager-device cuda`` in a process that never imports xlatorch: with the xla device (PyTorch's
PrivateUse1 backend) registered, torch 2.11's autograd engine fails a CUDA backward pass
("opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED", seen on an H100), so the CUDA
baseline runs apart.

Usage (bench.bench starts it): python -m bench.eager_child PROGRAM STEPS DEVICE [--small]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.models import programs  # noqa: E402


def run(p, steps: int, device: str) -> tuple[float, float]:
    """``(median step seconds, first step seconds)`` of PyTorch eager on ``device``."""
    torch.manual_seed(0)
    model = p.make_model().to(device)
    opt = p.make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in p.make_batch(gen)) for _ in range(4)]
    done = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        opt.zero_grad()
        loss = p.loss_fn(model(batches[i % 4][0]), batches[i % 4][1])
        loss.backward()
        opt.step()
        done()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]), times[0]


if __name__ == "__main__":
    name, steps, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    assert "xlatorch" not in sys.modules
    print(*run(programs(small="--small" in sys.argv)[name], steps, device))
