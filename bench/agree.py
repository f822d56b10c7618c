"""Do the bench's programs train on the xla device as PyTorch eager trains them on the CPU?

For each program (``examples/models.py``) and each float32 matmul precision, a few training
steps from the same initial parameters and batches on both; printed: the losses' largest
relative difference and the parameters' largest difference relative to their size, with a
float64 CPU run beside them for scale (how far float32 itself is from the exact result). On an
accelerator the 'default' precision lets XLA use reduced-precision matmul passes (TF32 on
NVIDIA GPUs), as torch_xla's default does; 'highest' computes float32 matmuls in float32.

Not a test (tests compare against CPU on every op); a check for a machine the suite does not
run on. Usage: python -m bench.agree [--steps N] [--small]
"""

from __future__ import annotations

import argparse
import copy

import torch

import xlatorch.core.xla_model as xm
from examples.models import programs
from xlatorch.runtime.lower import precision


def _train(p, model, batches, device, steps):
    model = copy.deepcopy(model).to(device)
    opt = p.make_opt(model.parameters())
    losses = []
    for i in range(steps):
        x, y = (t.to(device) for t in batches[i % len(batches)])
        opt.zero_grad()
        loss = p.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if str(device).startswith("xla"):
            xm.mark_step()
        losses.append(loss.item())
    return losses, [q.detach().to("cpu", torch.float64) for q in model.parameters()]


def _diff(a, b):
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    dev = xm.xla_device()
    print(f"xla device: {xm.xla_device_hw(dev)}; {a.steps} steps; differences relative to the largest value")
    print(f"{'program':8} {'precision':>9} {'loss xla-cpu':>12} {'param xla-cpu':>13} {'loss f32-f64':>12} "
          f"{'param f32-f64':>13}")  # fmt: skip
    for name, p in programs(small=a.small).items():
        torch.manual_seed(0)
        model = p.make_model()
        gen = torch.Generator().manual_seed(1)
        batches = [p.make_batch(gen) for _ in range(2)]
        cpu_loss, cpu_params = _train(p, model, batches, "cpu", a.steps)
        ref_model = copy.deepcopy(model).double()
        ref_loss, ref_params = _train(p, ref_model, [(x.double() if x.is_floating_point() else x, y)
                                                     for x, y in batches], "cpu", a.steps)  # fmt: skip
        f32 = (max(abs(c - r) / abs(r) for c, r in zip(cpu_loss, ref_loss)), _diff(cpu_params, ref_params))
        for level in ("default", "highest"):
            before = precision.get_precision()
            precision.set_precision(level)
            try:
                loss, params = _train(p, model, batches, dev, a.steps)
            finally:
                precision.set_precision(before)
            dl = max(abs(x - c) / abs(c) for x, c in zip(loss, cpu_loss))
            print(f"{name:8} {level:>9} {dl:12.2e} {_diff(params, cpu_params):13.2e} {f32[0]:12.2e} {f32[1]:13.2e}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
