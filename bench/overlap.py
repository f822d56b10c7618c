"""Does the host trace step N+1 while the device executes step N?

A step of two parts: ``depth`` matrix products of ``size`` x ``size`` (device time) and a chain
of ``ops`` small elementwise ops (host time: each is traced in Python), its outputs fed into the
next step as a training loop feeds its parameters. Measured at steady state, medians of rounds:
- ``host``: tracing the step plus ``mark_step``'s host time, with the device idle;
- ``device``: the wait after ``mark_step``, with the host idle;
- ``pipe``: steps back to back, then one wait, per step (and its medians: tracing, ``mark_step``:
  where a step that waits for the last one waits).
Run serially, a step costs ``host + device``; overlapped, ``max(host, device)``. ``hidden`` is the
part of the shorter one that the overlap hid: ``(host + device - pipe) / min(host, device)``,
1.0 fully overlapped, 0.0 not at all. ``depth`` is first chosen so the device's time is near the
host's (where one part dwarfs the other, there is nothing to hide).

On a CPU the device is the same cores the host traces on (XLA's step keeps them busy), so
``hidden`` is small there by construction; on an accelerator it should be near 1.

Usage: python -m bench.overlap [--size N] [--ops N] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import xlatorch.core.xla_model as xm


def _step(x, small, ws, ops):
    for w in ws:
        x = torch.tanh(x @ w)
    for _ in range(ops):
        small = small * 0.999 + 0.001
    return x, small


def measure(size: int, depth: int, ops: int, steps: int) -> dict:
    """Host, device and pipelined time of one step (seconds, medians), and ``hidden``."""
    dev = xm.xla_device()
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(size, size, generator=gen) / size**0.5).to(dev) for _ in range(depth)]
    x = torch.randn(size, size, generator=gen).to(dev)
    small = torch.zeros(8, device=dev)
    xm.mark_step(wait=True)
    for _ in range(3):  # compile, then warm
        x, small = _step(x, small, ws, ops)
        xm.mark_step(wait=True)
    host, device = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, small = _step(x, small, ws, ops)
        xm.mark_step()
        t1 = time.perf_counter()
        xm.wait_device_ops()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        device.append(t2 - t1)
    trace, sync = [], []  # where a pipelined step's time goes: tracing, mark_step
    t0 = time.perf_counter()
    for _ in range(steps):
        t1 = time.perf_counter()
        x, small = _step(x, small, ws, ops)
        t2 = time.perf_counter()
        xm.mark_step()
        trace.append(t2 - t1)
        sync.append(time.perf_counter() - t2)
    xm.wait_device_ops()
    pipe = (time.perf_counter() - t0) / steps
    h, d = statistics.median(host), statistics.median(device)
    finite = bool(torch.isfinite(x).all().item())
    return dict(host=h, device=d, pipe=pipe, hidden=(h + d - pipe) / min(h, d), finite=finite,
                pipe_trace=statistics.median(trace), pipe_sync=statistics.median(sync))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    depth = 4
    for _ in range(2):  # the host's time grows a little with depth: aim twice
        probe = measure(a.size, depth, a.ops, 10)
        print(f"  probe: {depth} products, host {probe['host'] * 1e3:.2f} ms, device {probe['device'] * 1e3:.2f} ms",
              flush=True)  # fmt: skip
        scale = min(4.0, max(0.25, probe["host"] / max(probe["device"], 1e-7)))
        depth = max(1, min(256, round(depth * scale)))
    print(f"device: {xm.xla_device_hw(xm.xla_device())}; size {a.size}, {a.ops} small ops, "
          f"{depth} products a step (device time near the host's)")  # fmt: skip
    print(f"{'round':>5} {'host ms':>8} {'device ms':>9} {'serial ms':>9} {'pipe ms':>8} {'hidden':>7} "
          f"{'pipe: trace ms':>14} {'sync ms':>7}")  # fmt: skip
    rows = [measure(a.size, depth, a.ops, a.steps) for _ in range(a.rounds)]
    for i, r in enumerate(rows):
        bad = "" if r["finite"] else "  (non-finite result)"
        print(f"{i:5d} {r['host'] * 1e3:8.2f} {r['device'] * 1e3:9.2f} {(r['host'] + r['device']) * 1e3:9.2f} "
              f"{r['pipe'] * 1e3:8.2f} {r['hidden']:7.2f} {r['pipe_trace'] * 1e3:14.2f} {r['pipe_sync'] * 1e3:7.2f}"
              f"{bad}")  # fmt: skip
    print(f"median hidden: {statistics.median(r['hidden'] for r in rows):.2f} (1.0: tracing step N+1 fully overlaps "
          "executing step N; 0.0: they run one after the other)")  # fmt: skip


if __name__ == "__main__":
    main()
