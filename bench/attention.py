"""``F.scaled_dot_product_attention`` on the device (its math path, composed op by op) against
JAX's fused attention (``custom_kernel.flash_attention``: ``jax.nn.dot_product_attention``),
forward and backward, causal, one process. Not a test: it prints milliseconds per step and
their ratio, measured in one run (the median of the timed steps; each step syncs and waits).

Usage: python -m bench.attention [--batch 4] [--heads 8] [--seq 512] [--dim 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import xlatorch
from xlatorch.experimental.custom_kernel import flash_attention


def _time(step, steps: int) -> float:
    for _ in range(3):
        step()
    xlatorch.sync(wait=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        xlatorch.sync(wait=True)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    dev = xlatorch.device()
    q, k, v = (torch.randn(a.batch, a.heads, a.seq, a.dim, device=dev, requires_grad=True) for _ in range(3))
    scale = a.dim**-0.5

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).sum().backward()

    def fused():
        flash_attention(q, k, v, causal=True, sm_scale=scale).sum().backward()

    t_sdpa, t_fused = _time(sdpa, a.steps), _time(fused, a.steps)
    print(f"{xlatorch.real_devices()[0]}: batch {a.batch}, heads {a.heads}, seq {a.seq}, dim {a.dim}, causal, fwd+bwd")
    print(f"{'sdpa (math path) ms':>22} {'jax attention ms':>17} {'ratio':>7}")
    print(f"{t_sdpa:>22.2f} {t_fused:>17.2f} {t_fused / t_sdpa:>7.2f}")


if __name__ == "__main__":
    main()
