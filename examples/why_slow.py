"""A training loop with two classic slowdowns, and what ``xlatorch.debug`` says about them.

1. The last batch of each epoch is smaller (200 samples, batch 64: 64, 64, 64, 8), so
   its step is a new graph: one recompile.
2. ``loss.item()`` at every step waits for the device in the middle of the step.

Usage: XLATORCH_DEBUG=1 python examples/why_slow.py [--fixed]
(``--fixed``: ``drop_last=True`` and the loss read once per epoch.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xlatorch  # noqa: E402,F401
import xlatorch.core.xla_model as xm  # noqa: E402
import xlatorch.debug as xd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixed", action="store_true")
    fixed = ap.parse_args().fixed
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(200, 784), torch.randint(0, 10, (200,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64, drop_last=fixed)
    device = xm.xla_device()
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        losses = []
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            if fixed:
                losses.append(loss.detach())  # read later: no wait for the device here
            else:
                print(f"epoch {epoch} loss {loss.item():.4f}")
            xm.mark_step()
        if fixed:
            print(f"epoch {epoch} mean loss {torch.stack(losses).mean().item():.4f}")

    print("\n--- xlatorch.debug.compile_reasons()")
    for rec in xd.compile_reasons():
        print(rec)
    print("\n--- xlatorch.debug.sync_report()")
    print(xd.sync_report())


if __name__ == "__main__":
    main()
