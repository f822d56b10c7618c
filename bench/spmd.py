"""SPMD: per-device memory and step time of a replicated vs a fully sharded model, one run.

One process, ``--devices`` CPU devices (``CPU_NUM_DEVICES``), ``xr.use_spmd()``. Both
variants train the bench's GPT (Adam-W) with the batch split over the mesh axis ``"fsdp"``:

- replicated: every device holds every parameter and its optimizer state (data parallel);
- sharded: ``xs.SpmdFullyShardedDataParallel``: each parameter (and so its optimizer state)
  is split over the devices; XLA's partitioner adds the all-gathers and reduce-scatters.

Memory is XLA's memory analysis of the compiled training step, per device: arguments
(parameters, optimizer state, batch), outputs and temporaries, plus the bytes of
parameters and optimizer state resident on device 0 after training. Step time is the median
over steady-state steps (``mark_step(wait=True)``). Not a test: it prints and appends to
``bench/results.jsonl``. On CPU the "devices" share the host's cores: the step times say
what partitioning costs in work and collectives, not what separate accelerators would gain.

Usage: python -m bench.spmd [--devices 8] [--steps 6] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _device0_bytes(tensors) -> int:
    """Bytes that device 0 holds for ``tensors``' data (its shard of each)."""
    total = 0
    for t in tensors:
        arr = t._st.value.array
        total += next(s.data.nbytes for s in arr.addressable_shards if s.device == arr.sharding.mesh.devices.flat[0])
    return total


def run(variant: str, small: bool, steps: int) -> dict:
    import numpy as np
    import torch

    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    import xlatorch.distributed.spmd as xs
    from examples.models import programs
    from xlatorch.runtime.lower import cache

    p = programs(small=small)["gpt"]
    n = int(os.environ["CPU_NUM_DEVICES"])
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    dev = xm.xla_device()
    torch.manual_seed(0)
    model = p.make_model()
    if variant == "sharded":
        model = xs.SpmdFullyShardedDataParallel(model, mesh)
    else:
        model = model.to(dev)
    opt = p.make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        x, y = _batch(p, gen, n, dev)
        xs.mark_sharding(x, mesh, ("fsdp", None))
        xs.mark_sharding(y, mesh, ("fsdp", None))
        batches.append((x, y))
    xm.mark_step()
    met.clear_all()
    times, losses = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = p.loss_fn(model(batches[i % 2][0]), batches[i % 2][1])
        loss.backward()
        opt.step()
        xm.mark_step(wait=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if i == 1:
            warm = met.counter_value("UncachedCompile") or 0
    step_exe = max(cache.CACHE.values(), key=lambda e: e.used)  # the training step ran last
    m = step_exe.xla.memory_analysis()
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return dict(
        variant=variant,
        step_ms=statistics.median(times[2:]) * 1e3,
        arg_mib=m.argument_size_in_bytes / 2**20,
        out_mib=m.output_size_in_bytes / 2**20,
        temp_mib=m.temp_size_in_bytes / 2**20,
        params_state_dev0_mib=_device0_bytes(params + state) / 2**20,
        params_total_mib=sum(t.numel() * t.element_size() for t in params) / 2**20,
        compiles_steady=(met.counter_value("UncachedCompile") or 0) - warm,
        last_loss=losses[-1],
    )


def _batch(p, gen, n, dev):
    """The program's batch, repeated to ``n`` rows at least (one per device) and a multiple of ``n``."""
    import torch

    x, y = p.make_batch(gen)
    reps = max(1, -(-n // x.shape[0]))
    x, y = torch.cat([x] * reps), torch.cat([y] * reps)
    rows = x.shape[0] - x.shape[0] % n
    return x[:rows].to(dev), y[:rows].to(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    a = ap.parse_args()
    os.environ["CPU_NUM_DEVICES"] = str(a.devices)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import xlatorch.runtime as xr

    xr.use_spmd()
    rows = [run(v, a.small, a.steps) for v in ("replicated", "sharded")]
    for r in rows:
        print(f"gpt{' (small)' if a.small else ''} {r['variant']:>10} on {a.devices} devices: "
              f"{r['step_ms']:.1f} ms/step; per device: arguments {r['arg_mib']:.2f} MiB, outputs "
              f"{r['out_mib']:.2f} MiB, temporaries {r['temp_mib']:.2f} MiB; parameters + optimizer state on "
              f"device 0 {r['params_state_dev0_mib']:.2f} MiB (parameters in all {r['params_total_mib']:.2f} MiB); "
              f"compiles at steady state {r['compiles_steady']}; last loss {r['last_loss']:.4f}")  # fmt: skip
    rep, sh = rows
    print(f"sharded / replicated: arguments {sh['arg_mib'] / rep['arg_mib']:.3f}, parameters + state on device 0 "
          f"{sh['params_state_dev0_mib'] / rep['params_state_dev0_mib']:.3f}, step time "
          f"{sh['step_ms'] / rep['step_ms']:.2f}")  # fmt: skip
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps(dict(bench="spmd", devices=a.devices, small=a.small, time=time.time(), **r)) + "\n")


if __name__ == "__main__":
    main()
