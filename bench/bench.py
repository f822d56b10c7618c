"""Steady-state step time of the three programs: xlatorch vs PyTorch eager on CPU and vs the
same program written in JAX (``bench/jax_programs.py``, the limit), and tracing cost per op,
measured in one process. Not a test: it prints ratios.

Each step is timed alone (``mark_step(wait=True)``) and, as a training loop runs, back to
back ("pipe": N steps then one wait, per step), where the host traces the next step while
the device runs this one; JAX's program likewise (blocking each step, then not).

"sync ms" is ``mark_step``'s host time (collect, key, launch), "exec ms" the wait that follows
it, with the host idle: the device's time for the step (JAX's "jax ms" is its whole step).

"us/aten op" is the host time of a step (everything before ``mark_step``) divided by the
ATen ops it dispatches to the device; the micro-benchmark that follows (``bench/trace_ops.py``)
times single ops against the floor PyTorch's Python dispatch costs any backend.

"compiled" runs the same step with the model under ``torch.compile(backend="openxla")``.

Usage: python -m bench.bench [--steps N (40)] [--small] [--programs mnist,mlp,gpt] [--no-micro]
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
    if str(device).startswith("xla"):
        xm.mark_step()
    return model, opt, batches


def _step(p, model, opt, batch):
    opt.zero_grad()
    loss = p.loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss


def run_eager(p, steps, device="cpu", small=False):
    """PyTorch eager on ``device`` (``--eager-device cuda`` where a CUDA build of torch is installed:
    in a process of its own, ``bench/eager_child.py`` says why)."""
    if device != "cpu":
        import subprocess

        argv = [sys.executable, "-m", "bench.eager_child", p.name, str(steps), device] + ["--small"] * small
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(argv, cwd=root, check=True, capture_output=True, text=True).stdout.split()
        return float(out[-2]), float(out[-1])
    from bench import eager_child

    return eager_child.run(p, steps, device)


def run_xla(p, steps, compiled=False):
    """xlatorch's lazy path, or with ``compiled`` the model under ``torch.compile(backend="openxla")``
    (its forward and backward each one node of the step's graph)."""
    model, opt, batches = _setup(p, xm.xla_device())
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()
        model = torch.compile(model, backend="openxla")
    met.clear_all()
    first = time.perf_counter()
    loss = _step(p, model, opt, batches[0])
    xm.mark_step(wait=True)
    first = time.perf_counter() - first
    first_loss = loss.item()
    _step(p, model, opt, batches[1])
    xm.mark_step(wait=True)
    ops = _count_ops(lambda: _step(p, model, opt, batches[1]))
    xm.mark_step(wait=True)
    compiles_before = met.counter_value("UncachedCompile") or 0
    transfers_before = _transfers()
    trace, syncs, execs, step_times = [], [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        _step(p, model, opt, batches[i % 4])
        t1 = time.perf_counter()
        xm.mark_step()
        t2 = time.perf_counter()
        xm.wait_device_ops()
        t3 = time.perf_counter()
        step_times.append(t3 - t0)
        trace.append(t1 - t0)
        syncs.append(t2 - t1)
        execs.append(t3 - t2)
    nodes = met.metric_data("TensorsGraphSize")[2][-1][1]
    t0 = time.perf_counter()  # back to back, as a training loop runs: tracing overlaps execution
    for i in range(steps):
        _step(p, model, opt, batches[i % 4])
        xm.mark_step()
    xm.wait_device_ops()
    return dict(
        step=statistics.median(step_times),
        pipelined=(time.perf_counter() - t0) / steps,
        first=first,
        trace_ms=statistics.median(trace) * 1e3,
        sync_ms=statistics.median(syncs) * 1e3,
        exec_ms=statistics.median(execs) * 1e3,
        trace_us_per_op=statistics.median(trace) / ops * 1e6,
        aten_ops=ops,
        graph_nodes=int(nodes),
        first_loss=first_loss,
        steady_compiles=(met.counter_value("UncachedCompile") or 0) - compiles_before,
        steady_transfers=_transfers() - transfers_before,
        fallbacks=met.executed_fallback_ops(),
    )


def _transfers() -> int:
    """Host<->device transfers so far (the samples of both transfer metrics)."""
    return sum((met.metric_data(m) or (0,))[0] for m in ("TransferToDeviceTime", "TransferFromDeviceTime"))


def _count_ops(fn) -> int:
    """The number of ATen ops ``fn`` dispatches to the xla device."""
    from xlatorch.runtime.trace import tensor

    n = [0]
    orig = tensor.DISPATCH

    def counting(func, args, kwargs):
        n[0] += 1
        return orig(func, args, kwargs)

    tensor.DISPATCH = counting
    try:
        fn()
    finally:
        tensor.DISPATCH = orig
    return n[0]


def run_jax(name, p, steps):
    """The same program written in JAX (bench/jax_programs.py): the limit, zero tracing cost."""
    import jax

    from bench import jax_programs as J

    torch.manual_seed(0)
    params, buffers = J.split_buffers(name, J.params_of(p.make_model()))
    gen = torch.Generator().manual_seed(1)
    batches = [J.to_jax_batch(p.make_batch(gen)) for _ in range(4)]
    init, step = J.make_step(name)
    state = init(params)
    t = time.perf_counter()
    params, state, loss = step(params, buffers, state, *batches[0])
    first_loss = float(loss)
    first = time.perf_counter() - t
    params, state, loss = step(params, buffers, state, *batches[1])
    jax.block_until_ready(loss)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        params, state, loss = step(params, buffers, state, *batches[i % 4])
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(steps):
        params, state, loss = step(params, buffers, state, *batches[i % 4])
    jax.block_until_ready((params, loss))
    return dict(
        step=statistics.median(times), pipelined=(time.perf_counter() - t) / steps, first=first, first_loss=first_loss
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)  # 10 gave medians 30% apart on a busy machine
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--programs", default="mnist,mlp,gpt")
    ap.add_argument("--eager-device", default="cpu", help="where PyTorch eager runs (cpu, or cuda on a GPU machine)")
    ap.add_argument("--no-micro", action="store_true", help="skip the per-op tracing micro-benchmark")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    a = ap.parse_args()
    progs = programs(small=a.small)
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        print("torch_xla is importable, but its column is not implemented yet", flush=True)
    print("ms columns: one step waited for (median); 'pipe': steps back to back, then one wait (per step)")
    print(f"{'program':8} {'eager ms':>9} {'jax ms':>7} {'xla ms':>7} {'xla/jax':>7} {'xla/eager':>9} "
          f"{'jax pipe':>8} {'xla pipe':>8} {'pipe x/j':>8} "
          f"{'compiled ms':>11} {'compiled/jax':>12} {'first s':>7} {'jax 1st':>7} {'trace ms':>8} "
          f"{'sync ms':>7} {'exec ms':>7} {'exec/jax':>8} {'us/aten op':>10} {'nodes':>5} {'compiles':>8} "
          f"{'transfers':>9} "
          f"{'loss xla/jax':>13} fallbacks")  # fmt: skip
    for name in a.programs.split(","):
        p = progs[name]
        eager, _ = run_eager(p, a.steps, a.eager_device, a.small)
        j = run_jax(name, p, a.steps)
        x = run_xla(p, a.steps)
        c = run_xla(p, a.steps, compiled=True)
        row = dict(compiled_ms=c["step"] * 1e3, ratio_compiled_jax=c["step"] / j["step"],
                   compiled_trace_ms=c["trace_ms"], compiled_first_s=c["first"],
                   program=name, small=a.small, eager_device=a.eager_device,
                   eager_ms=eager * 1e3, jax_ms=j["step"] * 1e3, xla_ms=x["step"] * 1e3,
                   ratio=x["step"] / eager, ratio_jax=x["step"] / j["step"], first_s=x["first"],
                   jax_pipe_ms=j["pipelined"] * 1e3, xla_pipe_ms=x["pipelined"] * 1e3,
                   ratio_pipe_jax=x["pipelined"] / j["pipelined"],
                   jax_first_s=j["first"], first_loss=x["first_loss"], jax_first_loss=j["first_loss"],
                   ratio_exec_jax=x["exec_ms"] / (j["step"] * 1e3),
                   **{k: x[k] for k in ("trace_ms", "sync_ms", "exec_ms", "trace_us_per_op", "aten_ops", "graph_nodes",
                                         "steady_compiles", "steady_transfers", "fallbacks")},
                   time=time.time())  # fmt: skip
        print(f"{name:8} {row['eager_ms']:9.2f} {row['jax_ms']:7.2f} {row['xla_ms']:7.2f} {row['ratio_jax']:7.2f} "
              f"{row['ratio']:9.2f} {row['jax_pipe_ms']:8.2f} {row['xla_pipe_ms']:8.2f} {row['ratio_pipe_jax']:8.2f} "
              f"{row['compiled_ms']:11.2f} {row['ratio_compiled_jax']:12.2f} "
              f"{row['first_s']:7.2f} {row['jax_first_s']:7.2f} {row['trace_ms']:8.2f} "
              f"{row['sync_ms']:7.2f} {row['exec_ms']:7.2f} {row['ratio_exec_jax']:8.2f} "
              f"{row['trace_us_per_op']:10.1f} "
              f"{row['graph_nodes']:5d} {row['steady_compiles']:8d} {row['steady_transfers']:9d} "
              f"{row['first_loss']:6.3f}/{row['jax_first_loss']:<6.3f} {row['fallbacks']}", flush=True)  # fmt: skip
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    if not a.no_micro:
        from bench import trace_ops

        print("\ntracing cost per op at steady state (bench/trace_ops.py):", flush=True)
        res = trace_ops.measure()
        trace_ops.report(res)
        with open(a.out, "a") as f:
            f.write(json.dumps(dict(micro={k: dict(xla_us=o, floor_us=fl) for k, (o, fl) in res.items()},
                                    time=time.time())) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
