"""Programs for tests/test_spmd_names.py, run in a child process with 8 CPU devices
(``CPU_NUM_DEVICES=8``) under SPMD. ``main(out)`` saves what each computed; the tests
compare it with CPU eager PyTorch. Importing this module starts nothing."""

import os

import numpy as np
import torch


def data():
    g = torch.Generator().manual_seed(0)
    return {"c": torch.arange(64.0).reshape(8, 8), "x": torch.randn(8, 4, 16, generator=g),
            "w": torch.randn(12, 16, generator=g), "b": torch.randn(12, generator=g)}  # fmt: skip


def main(out):
    import xlatorch.runtime as xr

    xr.use_spmd()
    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    import xlatorch.distributed.spmd as xs

    d = xm.xla_device()
    mesh = xs.Mesh(np.arange(8), (8,), ("x",))
    ref = data()
    c = ref["c"]
    res = {}

    # annotate_custom_sharding: a constraint in the graph; the storage keeps mark_sharding's sharding
    a = c.to(d)
    sa = xs.mark_sharding(a, mesh, ("x", None))
    before = met.counter_value("xla::sharding_constraint") or 0
    custom = xs.annotate_custom_sharding(sa, mesh, (None, "x"))
    res["custom_constraints"] = (met.counter_value("xla::sharding_constraint") or 0) - before
    res["custom_is_same_tensor"] = custom.global_tensor is a
    y = a * 2
    xm.mark_step()
    res["custom"] = (xs.get_sharding_spec(a), xs.get_sharding_spec(y), a.cpu(), y.cpu())
    p = c.to(d)
    xs.annotate_custom_sharding(p, mesh, (None, "x"))
    xm.mark_step()
    res["custom_plain"] = (xs.get_sharding_spec(p), p.cpu())
    try:
        xs.annotate_custom_sharding(p, mesh, ("x",))
    except ValueError as e:
        res["custom_bad"] = str(e)

    # wrap_if_sharded
    plain = c.to(d)
    res["wrap"] = [type(xs.wrap_if_sharded(v)).__name__ for v in (plain, a, 3, c)]

    # shard_as: the unsharded operand takes the sharded one's sharding
    u = (torch.ones(8, 8) * 3).to(d)
    va, vu = xs.shard_as(a, u)
    z = vu + 1
    ta, tu = xs.shard_as({"k": [a]}, {"k": [u]})
    xm.mark_step()
    res["shard_as"] = (xs.get_sharding_spec(va), xs.get_sharding_spec(vu), vu.cpu(), z.cpu(), type(ta["k"]).__name__)

    # XLAPatchedLinear under sharding: forward and backward against F.linear on CPU
    x = ref["x"].to(d).requires_grad_()
    w = ref["w"].to(d).requires_grad_()
    b = ref["b"].to(d).requires_grad_()
    xs.mark_sharding(x, mesh, ("x", None, None))
    out_ = xs.XLAPatchedLinear.apply(x, w, b)
    (out_ * out_).sum().backward()
    xm.mark_step()
    res["linear"] = (out_.detach().cpu(), x.grad.cpu(), w.grad.cpu(), b.grad.cpu(), xs.get_sharding_spec(out_))

    # xla_distribute_tensor over a DeviceMesh of the xla device
    from torch.distributed import DeviceMesh
    from torch.distributed.tensor.placement_types import Replicate, Shard

    dm = DeviceMesh("xla", torch.arange(8).reshape(2, 4), mesh_dim_names=("a", "b"), _init_backend=False)
    dist = {}
    for name, placements in {"s0s1": [Shard(0), Shard(1)], "rs0": [Replicate(), Shard(0)],
                             "s0s0": [Shard(0), Shard(0)], "none": None}.items():  # fmt: skip
        t = xs.xla_distribute_tensor(c, dm, placements)
        dist[name] = (t.sharding_spec, t.partition_spec, t.global_tensor.cpu())
    res["distribute"] = dist

    # xla_distribute_module: partition_fn shards the Linear's weight, input_fn the input
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(d)
    seen = []

    def partition(name, mod, device_mesh):
        if isinstance(mod, torch.nn.Linear):
            xs.xla_distribute_tensor(mod.weight, device_mesh, [Shard(0), Replicate()])

    def input_fn(mod, inputs, device_mesh):
        seen.append("in")
        xs.xla_distribute_tensor(inputs[0], device_mesh, [Shard(0), Replicate()])

    def output_fn(mod, outputs, device_mesh):
        seen.append("out")
        return outputs * 1

    m = xs.xla_distribute_module(model, dm, partition, input_fn, output_fn)
    inp = c.to(d)
    y = m(inp)
    xm.mark_step()
    res["module"] = (m is model, seen, y.cpu(), xs.get_sharding_spec(model[0].weight))
    try:
        xs.xla_distribute_module(torch.nn.Linear(2, 2), dm, xs.auto_policy)
    except NotImplementedError as e:
        res["auto"] = str(e)
    torch.save(res, os.path.join(out, "spmd_names.pt"))
