"""Ops with no lowering run on CPU: correct results, counted as ``aten::<op>``.

The inputs are materialised (one graph cut), the ATen op runs on CPU, mutated
arguments are written back, and results return to the device as device data.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from xlatorch.debug.metrics import COUNTERS
from xlatorch.runtime.tensor import XlaTensor, wrap, write

__all__ = ["run_on_cpu"]


def _is_xla_device(d) -> bool:
    return d is not None and torch.device(d).type == "xla"


def run_on_cpu(func, args, kwargs):
    """Run ``func`` on CPU copies of its device arguments and bring the results back."""
    from xlatorch.runtime.transfer import to_cpu, to_device

    COUNTERS[str(func._schema.name)] += 1
    xla_in = []

    def down(a):
        if type(a) is XlaTensor:
            c = to_cpu(a)
            xla_in.append((a, c))
            return c
        return a

    cargs = tree_map(down, args)
    ckwargs = tree_map(down, kwargs)
    to_xla = bool(xla_in)
    if _is_xla_device(ckwargs.get("device")):
        ckwargs["device"] = "cpu"
        to_xla = True
    res = func(*cargs, **ckwargs)

    # Arguments the schema marks as written: copy their new CPU value back.
    mutated = {}
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            src = cargs[i] if i < len(cargs) else ckwargs.get(arg.name)
            dst = args[i] if i < len(args) else kwargs.get(arg.name)
            if type(dst) is XlaTensor:
                write(dst, to_device(src))
                mutated[id(src)] = dst

    def up(r):
        if isinstance(r, torch.Tensor) and not isinstance(r, XlaTensor):
            if id(r) in mutated:
                return mutated[id(r)]
            if to_xla:
                return wrap(to_device(r))
        return r

    return tree_map(up, res)
