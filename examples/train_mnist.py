"""The guides' MNIST CNN trained on the xla device (synthetic data: no downloads).

Prints the loss as it trains and the metrics report at the end.
Usage: python examples/train_mnist.py [--steps N] [--batch-size B]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.optim as optim

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xlatorch  # noqa: E402
import xlatorch.core.xla_model as xm  # noqa: E402
import xlatorch.debug.metrics as met  # noqa: E402
from examples.models import MNISTNet  # noqa: E402


def synthetic_mnist(n: int, seed: int = 0):
    """Images whose class is written into their pixels, so the loss can fall."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 10, (n,), generator=g)
    data = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for c in range(10):
        data[target == c, 0, 2 * c : 2 * c + 4, 4:24] += 1.0
    return torch.utils.data.TensorDataset((data - 0.1307) / 0.3081, target)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.5)
    args = ap.parse_args()

    torch.manual_seed(42)
    train_loader = torch.utils.data.DataLoader(
        synthetic_mnist(args.steps * args.batch_size), batch_size=args.batch_size, shuffle=True
    )
    device = xm.xla_device()
    model = MNISTNet().train().to(device)
    loss_fn = nn.NLLLoss()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    t0 = time.time()
    for step, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        data, target = data.to(device), target.to(device)
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
        xlatorch.sync()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.1f}s)", flush=True)
    print()
    print(met.metrics_report())


if __name__ == "__main__":
    main()
