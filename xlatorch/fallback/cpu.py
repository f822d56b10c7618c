"""Ops with no lowering run on CPU: correct results, counted as ``aten::<op>``.

The inputs are materialised (one graph cut), the ATen op runs on CPU, mutated
arguments are written back, and results return to the device as device data.
"""

from __future__ import annotations

import atexit
import json

import torch
from torch.utils._pytree import tree_map

from xlatorch.runtime.base import config
from xlatorch.runtime.base.record import COUNTERS, cause
from xlatorch.runtime.base.source import user_line as user_frame
from xlatorch.runtime.base.topology import device_index
from xlatorch.runtime.execute.materialize import to_cpu
from xlatorch.runtime.execute.transfer import to_device
from xlatorch.runtime.trace import dispatch, outs
from xlatorch.runtime.trace.tensor import XlaTensor, wrap

__all__ = ["run_on_cpu", "ORIGINS", "SITE_HOOKS", "user_frame"]

# op -> "file:line" of the user code that first sent it to CPU.
ORIGINS: dict[str, str] = {}
# Called with (op, "file:line" or None) at every fallback (xlatorch.check counts them by line).
SITE_HOOKS: list = []


def _write_report(path: str) -> None:
    recs = {op: {"count": COUNTERS[op], "origin": origin} for op, origin in ORIGINS.items() if COUNTERS[op]}
    with open(path, "a") as f:  # one line per process; several processes may append
        f.write(json.dumps(recs) + "\n")


if config.env("XLATORCH_FALLBACK_REPORT"):
    atexit.register(_write_report, config.env("XLATORCH_FALLBACK_REPORT"))


def _is_xla_device(d) -> bool:
    return d is not None and torch.device(d).type == "xla"


# Results PyTorch keeps on the host on every device (op -> their positions): a packed
# sequence's ``batch_sizes`` (nn.utils.rnn checks it is on the CPU).
_HOST_RESULTS = {"aten::_pack_padded_sequence": (1,)}


def run_on_cpu(func, args, kwargs):
    """Run ``func`` on CPU copies of its device arguments and bring the results back."""
    name = str(func._schema.name)
    COUNTERS[name] += 1
    if name not in ORIGINS or SITE_HOOKS:
        site = user_frame()
        ORIGINS.setdefault(name, site)
        for hook in SITE_HOOKS:
            hook(name, site)
    xla_in = []

    def down(a):
        if type(a) is XlaTensor:
            c = to_cpu(a).clone()  # a resizable tensor of its own (to_cpu's may wrap a numpy buffer)
            xla_in.append((a, c))
            return c
        return a

    with cause(f"CPU fallback {name}"):  # how xlatorch.debug reports the graph cut
        cargs = tree_map(down, args)
        ckwargs = tree_map(down, kwargs)
    to_xla = bool(xla_in)
    dev = xla_in[0][0]._st.dev if xla_in else None  # results go to the inputs' local device
    if _is_xla_device(ckwargs.get("device")):
        dev = device_index(torch.device(ckwargs["device"]))
        ckwargs["device"] = "cpu"
        to_xla = True
    res = func(*cargs, **ckwargs)

    # Arguments the schema marks as written: copy their new CPU value back.
    mutated = {}
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            src = cargs[i] if i < len(cargs) else ckwargs.get(arg.name)
            dst = args[i] if i < len(args) else kwargs.get(arg.name)
            # Tensor(a!)[] (the _foreach_ and _fused_ optimizer ops): every element was written.
            pairs = zip(src, dst) if isinstance(dst, (list, tuple)) else [(src, dst)]
            for s, d in pairs:
                if type(d) is XlaTensor:  # an out= CPU resized (and warned of) is resized here too
                    outs.write_outs((d,), (to_device(s, d._st.dev),), warn=False)
                    mutated[id(s)] = d

    def up(r):
        if isinstance(r, torch.Tensor) and not isinstance(r, XlaTensor):
            if id(r) in mutated:
                return mutated[id(r)]
            if to_xla:
                return wrap(to_device(r, dev))
        return r

    host = _HOST_RESULTS.get(name)
    if host is not None and isinstance(res, tuple):
        return tuple(r if i in host else tree_map(up, r) for i, r in enumerate(res))
    return tree_map(up, res)


dispatch.FALLBACK[0] = run_on_cpu  # the runtime's dispatch calls up through this slot
