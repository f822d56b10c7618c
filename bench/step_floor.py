"""The floor of a whole training step for any Python lazy-tensor backend, against xlatorch.

``bench/trace_ops.py`` times single ops against PyTorch's Python-dispatch floor. This does the
same for the bench's training steps (``examples/models.py``: zero_grad, forward, loss, backward,
the optimizer's step): the step runs on tensors of a backend that does no work (``_Floor``: each
op's results, learned in the first steps with PyTorch's meta kernels, are made again by their
position in the step: no signature computed, no lookup). What is left is what PyTorch itself
costs a Python backend per step: its Python (modules, autograd's engine, the optimizer), its
dispatch into Python, and tensor creation.

Printed: each step waited for, the floor's step, xlatorch's host time before ``mark_step``
(tracing) and in it (the sync, with the executable's call apart); then steps back to back, per
step: JAX's program for the same step (``bench/jax_programs.py``) alone, JAX's program with the
floor's step run on the host after each dispatch (what a backend that costs nothing beyond
PyTorch's own work, whose device step is as fast as JAX's and which has no sync, could at best
do on this machine), and xlatorch. Not a test: figures from one run, in one process, rounds
interleaved in random order.

Usage: python -m bench.step_floor [--programs mlp,gpt,mnist] [--steps 40] [--rounds 5] [--small]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.optim import optimizer as _optimizer
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xlatorch.core.xla_model as xm  # noqa: E402
from bench.bench import _setup, _step  # noqa: E402
from examples.models import programs  # noqa: E402
from xlatorch.runtime.base import record  # noqa: E402

# What each op of the step returned, in call order, learned in the first step with PyTorch's meta
# kernels: ("new", shape, dtype), ("arg", i) for an in-place op's tensor, (list/tuple, parts), ("value", v).
# Later steps make the same op's results by position: no signature computed, no lookup.
_TAPE: list = []
_AT = [0]
_LEARNED = [0]  # ops learned: none after the first steps, or the steps differ and the floor is not one


class _Floor(torch.Tensor):
    """A tensor of a backend that does no work: its ops make new tensors of the right shapes
    (in-place ops return the tensor they write). It says it is on the xla device, as
    xlatorch's tensors do, so the optimizer takes its foreach path as it does for them."""

    @staticmethod
    def __new__(cls, shape, dtype, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="xla", requires_grad=requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        i = _AT[0]
        _AT[0] = i + 1
        if i < len(_TAPE) and _TAPE[i][0] is func:
            how = _TAPE[i][1]
        else:  # a step not seen yet (the first ones: the optimizer makes its state)
            del _TAPE[i:]
            how = _learn(func, args, kwargs or {})
            _TAPE.append((func, how))
            _LEARNED[0] += 1
        if how[0] == "new":
            return _new(_Floor, how[1], dtype=how[2], device="xla")
        return _make(how, (args, kwargs))

    __torch_function__ = torch._C._disabled_torch_function_impl


_new = torch.Tensor._make_wrapper_subclass


def _learn(func, args, kwargs):
    """What ``func`` returns for these argument shapes: its meta kernel run once."""
    flat = []

    def to_meta(t):
        if isinstance(t, _Floor):
            m = torch.empty(t.shape, dtype=t.dtype, device="meta")
            flat.append((t, m))
            return m
        return t

    margs, mkwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)  # floors numbered in this order
    if "device" in mkwargs:
        mkwargs["device"] = "meta"
    res = func(*margs, **mkwargs)
    metas = [m for _, m in flat]

    def describe(r):
        if isinstance(r, torch.Tensor):
            for i, m in enumerate(metas):
                if r is m:
                    return ("arg", i)
            return ("new", tuple(r.shape), r.dtype)
        if isinstance(r, (list, tuple)):
            return (type(r), tuple(describe(x) for x in r))
        return ("value", r)

    return describe(res)


def _make(how, args):
    """The results ``how`` describes (``args``: the op's positional and keyword arguments)."""
    kind = how[0]
    if kind == "new":
        return _new(_Floor, how[1], dtype=how[2], device="xla")
    if kind == "arg":  # the i-th floor tensor among the arguments, in tree_map's order
        return list(_floors(args))[how[1]]
    if kind == "value":
        return how[1]
    return how[0](_make(h, args) for h in how[1])


def _floors(a):
    if isinstance(a, _Floor):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from _floors(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _floors(x)


def _floor_model(p):
    """The program's model, optimizer and batches on the floor backend."""
    torch.manual_seed(0)
    model = p.make_model()
    for mod in model.modules():
        for name, prm in list(mod._parameters.items()):
            if prm is not None:
                mod._parameters[name] = torch.nn.Parameter(_Floor(tuple(prm.shape), prm.dtype), prm.requires_grad)
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[name] = _Floor(tuple(buf.shape), buf.dtype)
    opt = p.make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(_Floor(tuple(t.shape), t.dtype) for t in p.make_batch(gen)) for _ in range(4)]
    return model, opt, batches


def _xla_model(p):
    return _setup(p, xm.xla_device())


def measure(p, steps: int) -> dict:
    """Median ms of the floor's step, xlatorch's step before ``mark_step`` and its sync (each
    step waited for), rounds of the two interleaved."""
    if _Floor not in _optimizer._foreach_supported_types:
        _optimizer._foreach_supported_types.append(_Floor)
    floor, xla = _floor_model(p), _xla_model(p)
    f_ms, x_ms, s_ms, d_ms = [], [], [], []
    _TAPE.clear()
    for i in range(steps + 5):
        b = i % 4
        if i == 5:
            _LEARNED[0] = 0
        t = time.perf_counter()
        _AT[0] = 0
        _step(p, floor[0], floor[1], floor[2][b])
        t1 = time.perf_counter()
        _step(p, xla[0], xla[1], xla[2][b])
        t2 = time.perf_counter()
        before = len(record.METRICS.get("ExecuteDispatchTime", ()))
        xm.mark_step()
        t3 = time.perf_counter()
        after = record.METRICS.get("ExecuteDispatchTime", ())
        xm.wait_device_ops()
        if i >= 5:  # the first steps compile (and fill the floor's shape table)
            f_ms.append((t1 - t) * 1e3)
            x_ms.append((t2 - t1) * 1e3)
            s_ms.append((t3 - t2) * 1e3)
            d_ms.append(sum(after[before:]) / 1e6)
    if _LEARNED[0]:
        raise RuntimeError(f"bench.step_floor: {_LEARNED[0]} ops learned after the first steps: they differ")
    return {
        "floor": statistics.median(f_ms),
        "xla": statistics.median(x_ms),
        "sync": statistics.median(s_ms),
        "dispatch": statistics.median(d_ms),
    }


def _jax(name, p):
    """JAX's step for the same program (``bench/jax_programs.py``): ``run(i)`` dispatches step
    ``i`` (asynchronously) and returns its loss."""
    from bench import jax_programs as J

    torch.manual_seed(0)
    params, buffers = J.split_buffers(name, J.params_of(p.make_model()))
    gen = torch.Generator().manual_seed(1)
    batches = [J.to_jax_batch(p.make_batch(gen)) for _ in range(4)]
    init, step = J.make_step(name)
    box = [params, init(params)]

    def run(i):
        box[0], box[1], loss = step(box[0], buffers, box[1], *batches[i % 4])
        return loss

    return run


def pipelined(p, name, steps: int, rounds: int = 5) -> dict:
    """Median ms a step, steps back to back then one wait: JAX's program alone; JAX's program
    with the floor's step traced on the host after each dispatch (a Python backend that costs
    nothing, its device step as fast as JAX's); xlatorch. Rounds interleaved in random order."""
    import random

    import jax

    run = _jax(name, p)
    floor, xla = _floor_model(p), _xla_model(p)
    _TAPE.clear()
    for i in range(5):  # compile, learn the floor's step
        jax.block_until_ready(run(i))
        _AT[0] = 0
        _step(p, floor[0], floor[1], floor[2][i % 4])
        _step(p, xla[0], xla[1], xla[2][i % 4])
        xm.mark_step(wait=True)

    def jax_alone():
        for i in range(steps):
            loss = run(i)
        jax.block_until_ready(loss)

    def jax_and_floor():
        for i in range(steps):
            loss = run(i)
            _AT[0] = 0
            _step(p, floor[0], floor[1], floor[2][i % 4])
        jax.block_until_ready(loss)

    def xlatorch():
        for i in range(steps):
            _step(p, xla[0], xla[1], xla[2][i % 4])
            xm.mark_step()
        xm.wait_device_ops()

    ways = {"jax": jax_alone, "jax+floor": jax_and_floor, "xla": xlatorch}
    times: dict = {k: [] for k in ways}
    for _ in range(rounds):
        for k in random.sample(list(ways), len(ways)):
            t = time.perf_counter()
            ways[k]()
            times[k].append((time.perf_counter() - t) / steps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", default="mlp,gpt,mnist")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the back-to-back runs, interleaved")
    a = ap.parse_args()
    progs = programs(small=a.small)
    names = a.programs.split(",")
    print("Each step waited for (ms):")
    print(f"{'program':8} {'floor':>7} {'xla trace':>9} {'trace/floor':>11} {'xla sync':>8} {'of it exe call':>14}")
    for name in names:
        r = measure(progs[name], a.steps)
        f, x = r["floor"], r["xla"]
        print(f"{name:8} {f:7.2f} {x:9.2f} {x / f:11.2f} {r['sync']:8.2f} {r['dispatch']:14.2f}")
    print("Steps back to back (ms a step): JAX alone, JAX with the floor's step on the host, xlatorch")
    print(f"{'program':8} {'jax':>7} {'jax+floor':>9} {'ratio':>6} {'xla':>7} {'ratio':>6}")
    for name in names:
        r = pipelined(progs[name], name, a.steps, a.rounds)
        j = r["jax"]
        print(f"{name:8} {j:7.2f} {r['jax+floor']:9.2f} {r['jax+floor'] / j:6.2f} {r['xla']:7.2f} {r['xla'] / j:6.2f}")


if __name__ == "__main__":
    main()
