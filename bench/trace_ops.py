"""Tracing cost per op at steady state: microseconds from a PyTorch call to its IR node.

Each op runs many times on fixed inputs (results dropped, so the graph does not grow),
after a warm-up that fills the per-signature caches. The floor is the same call on a
``__torch_dispatch__`` subclass that does nothing but return a new tensor: the part of
the cost that PyTorch's Python dispatch charges any such backend.

Usage: python -m bench.trace_ops
"""

from __future__ import annotations

import statistics
import time

import torch

import xlatorch.core.xla_model as xm

OPS = {
    "add": lambda a, b, w: a + b,
    "mul scalar": lambda a, b, w: a * 0.5,
    "mm": lambda a, b, w: a @ w,
    "relu": lambda a, b, w: torch.relu(a),
    "sum(dim)": lambda a, b, w: a.sum(1),
    "view": lambda a, b, w: a.view(-1),
    "t": lambda a, b, w: w.t(),
    "softmax": lambda a, b, w: torch.softmax(a, -1),
    "addcmul": lambda a, b, w: torch.addcmul(a, b, b, value=0.1),
}


class _Floor(torch.Tensor):
    """A backend that does no work: each op returns a new tensor shaped like its first input.
    What remains is what PyTorch charges any Python ``__torch_dispatch__`` backend per op."""

    @staticmethod
    def __new__(cls, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="meta")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a = args[0]
        return torch.Tensor._make_wrapper_subclass(_Floor, a.shape, dtype=a.dtype, device="meta")

    __torch_function__ = torch._C._disabled_torch_function_impl


def _time(fn, args, n: int) -> float:
    """Median over 5 rounds of the mean µs per call."""
    for _ in range(200):
        fn(*args)
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def measure(n: int = 2000) -> dict:
    """``{op: (xlatorch µs, floor µs)}`` per call at steady state."""
    dev = xm.xla_device()
    cpu = [torch.randn(64, 128), torch.randn(64, 128), torch.randn(128, 128)]
    xla = [t.to(dev) for t in cpu]
    xm.mark_step()
    floor_args = [_Floor(tuple(t.shape), t.dtype) for t in cpu]
    res = {}
    for name, fn in OPS.items():
        res[name] = (_time(fn, xla, n), _time(fn, floor_args, n))
        xm.mark_step()
    return res


def report(res: dict) -> None:
    print(f"{'op':12} {'xlatorch us':>11} {'floor us':>9} {'ours - floor':>12}")
    for name, (ours, floor) in res.items():
        print(f"{name:12} {ours:11.1f} {floor:9.1f} {ours - floor:12.1f}")
    mean = statistics.mean(o for o, _ in res.values())
    fmean = statistics.mean(f for _, f in res.values())
    print(f"{'mean':12} {mean:11.1f} {fmean:9.1f} {mean - fmean:12.1f}")


def main() -> None:
    report(measure())


if __name__ == "__main__":
    main()
