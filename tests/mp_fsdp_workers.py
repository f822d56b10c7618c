"""Functions run by spawned workers in tests/test_fsdp.py (importable by child processes).

Each writes what it computed to ``<out>/<name>_rank<ordinal>.pt``; the test compares with one
CPU process trained on the whole batch.
"""

import functools
import gc
import os

import jax
import torch
import torch.nn as nn

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.runtime as xr
from xlatorch.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from xlatorch.distributed.fsdp import checkpoint_module
from xlatorch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

WIDTH = 15  # odd sizes: every parameter needs padding to be split in two


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return torch.tanh(self.ln(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.b1 = Block()
        self.b2 = Block()
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.out(self.b2(self.b1(torch.tanh(self.inp(x)))))


def data(steps, per_replica, replicas):
    """Per step, the whole batch (x, y); replica r's part is rows [r*per:(r+1)*per]."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(steps, per_replica * replicas, 8, generator=g), torch.randint(
        0, 3, (steps, per_replica * replicas), generator=g
    )


def _nested(m, **kw):
    m.b1 = FSDP(checkpoint_module(m.b1), **kw)
    m.b2 = FSDP(m.b2, **kw)
    return FSDP(m, **kw)


def _auto(m, **kw):
    ckpt = lambda mod, *a, **k: FSDP(checkpoint_module(mod), *a, **k)  # noqa: E731
    return FSDP(m, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                auto_wrapper_callable=ckpt, **kw)  # fmt: skip


# name -> (wrap the freshly built Net, step the optimizer)
CONFIGS = {
    "root": (FSDP, lambda opt: opt.step()),
    "nested_ckpt": (_nested, lambda opt: opt.step()),
    "auto_flat": (functools.partial(_auto, flatten_parameters=True), lambda opt: opt.step()),
    "size_dim0_optimizer_step": (
        lambda m: FSDP(
            m,
            shard_param_on_dim_0=True,
            reshard_after_forward=True,
            disable_reshard_on_root=False,
            auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=200),
        ),
        xm.optimizer_step,
    ),  # fmt: skip
}


def _dump(out, name, obj):
    torch.save(obj, os.path.join(out, f"{name}_rank{xr.global_ordinal()}.pt"))


def train(index, out, names, steps, per_replica):
    """Each configuration of ``names``: SGD with momentum on this replica's part of the batch;
    the losses averaged over the replicas, counters, and a sharded checkpoint per rank."""
    n, r = xr.world_size(), xr.global_ordinal()
    d = xm.xla_device()
    xs, ys = data(steps, per_replica, n)
    rows = slice(r * per_replica, (r + 1) * per_replica)
    for name in names:
        wrap, step = CONFIGS[name]
        torch.manual_seed(0)
        model = wrap(Net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        met.clear_counters()
        losses = []
        for s in range(steps):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xs[s, rows].to(d)), ys[s, rows].to(d))
            loss.backward()
            step(opt)
            losses.append(xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / n))
            xm.mark_step()
        ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
                "optimizer": opt.state_dict()}  # fmt: skip
        xm.save(ckpt, os.path.join(out, f"{name}_ckpt_rank-{r:08d}-of-{n:08d}.pth"), master_only=False)
        _dump(out, name, {"losses": [v.item() for v in losses],
                          "all_gather": met.counter_value("xla::all_gather"),
                          "reduce_scatter": met.counter_value("xla::reduce_scatter"),
                          "all_reduce": met.counter_value("xla::all_reduce"),
                          "compiles": met.counter_value("UncachedCompile"),
                          "shard_numels": [p.numel() for p in model.parameters()]})  # fmt: skip


def _state_bytes(model, opt) -> dict:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))  # fmt: skip
    return {"params": params, "optimizer": state}


def _device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def memory(index, out, kind, width, depth):
    """Bytes of parameters + Adam state this replica holds after two steps, ``kind`` "replicated"
    (DDP-style, ``xm.optimizer_step``) or "fsdp" (each of the ``depth`` layers a unit).
    ``device``: the bytes of every array alive on this process's device then, gradients and
    the batch included (one kind per process: a sync keeps the arrays of the step before)."""
    d = xm.xla_device()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    if kind == "fsdp":
        model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                               transformer_layer_cls={nn.Linear}))  # fmt: skip
    else:
        model = model.to(d)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, width).to(d)).square().mean().backward()
        xm.optimizer_step(opt) if kind == "replicated" else opt.step()
        xm.mark_step()
    gc.collect()
    _dump(out, f"memory_{kind}", {**_state_bytes(model, opt), "device": _device_bytes()})
