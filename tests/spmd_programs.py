"""Programs run under SPMD by tests/test_spmd.py, in a child process with 8 CPU devices
(``python -c "import spmd_programs; spmd_programs.main(out)"``, ``CPU_NUM_DEVICES=8``), or by
``xmp.spawn`` (2 processes x 4 devices). Each saves what it computed; the tests compare it
with CPU eager PyTorch. Importing this module starts nothing (the tests build their
references from the same models and data)."""

import os

import numpy as np
import torch

MESHES = {"8": ((8,), ("data",)), "4x2": ((4, 2), ("data", "model")), "2x2x2": ((2, 2, 2), ("data", "model", "x"))}
STEPS = 4


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batches(steps=STEPS, n=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


class TinyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)))


def tokens(steps=STEPS):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (16, 6), generator=g) for _ in range(steps)]


def _specs(names):
    """Partition specs of the MLP's weights and the batch on a mesh with axes ``names``."""
    model = names[1] if len(names) > 1 else None
    return {"w0": (model, "data"), "w2": (None, model), "x": ("data", None)}


def train_mlp(mesh_key, opt_name="adam"):
    """Sharded weights, batch split over "data": losses, parameters, shardings, compiles."""
    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    import xlatorch.distributed.spmd as xs

    shape, names = MESHES[mesh_key]
    mesh = xs.Mesh(np.arange(8), shape, names)
    d = xm.xla_device()
    model = mlp().to(d)
    spec = _specs(names)
    xs.mark_sharding(model[0].weight, mesh, spec["w0"])
    xs.mark_sharding(model[2].weight, mesh, spec["w2"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, compiles, sent = [], [], []
    from xlatorch.runtime.base import topology

    real, puts = topology.put, []  # each packed scalar group sent to the devices

    def counting(a, target):
        puts.append(target)
        return real(a, target)

    topology.put = counting
    try:
        for x, y in batches():
            xd = x.to(d)
            xs.mark_sharding(xd, mesh, spec["x"])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xd), y.to(d))
            loss.backward()
            opt.step()
            before = len(puts)
            xm.mark_step()
            sent.append(len(puts) - before)
            losses.append(loss.item())
            compiles.append(met.counter_value("UncachedCompile") or 0)
    finally:
        topology.put = real
    w0 = model[0].weight
    state = opt.state[w0]
    return {
        "losses": losses,
        "compiles": compiles,
        "sent": sent,
        "params": [p.cpu() for p in model.parameters()],
        "w0_spec": xs.get_sharding_spec(w0),
        "exp_avg_spec": xs.get_sharding_spec(state["exp_avg"]),
        "exp_avg_sq_spec": xs.get_sharding_spec(state["exp_avg_sq"]),
        "w0_pspec": str(w0._st.value.array.sharding.spec),
    }


def fsdp_transformer():
    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    import xlatorch.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    model = xs.SpmdFullyShardedDataParallel(TinyTransformer(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    d = xm.xla_device()
    losses, compiles = [], []
    for x in tokens():
        xd = x.to(d)
        xs.mark_sharding(xd, mesh, ("fsdp", None))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xd).flatten(0, 1), xd.flatten())
        loss.backward()
        opt.step()
        xm.mark_step()
        losses.append(loss.item())
        compiles.append(met.counter_value("UncachedCompile") or 0)
    named = list(model.module.named_parameters())
    return {
        "losses": losses,
        "compiles": compiles,
        "params": {n: p.cpu() for n, p in named},
        "specs": {n: xs.get_sharding_spec(p) for n, p in named},
        "momentum_specs": {n: xs.get_sharding_spec(opt.state[p]["momentum_buffer"]) for n, p in named},
        "fallbacks": met.executed_fallback_ops(),
    }


def shards_and_dumps(out):
    """local_shards, constraints on intermediate values, the graph key, dumps, checkpoints."""
    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    import xlatorch.distributed.spmd as xs
    import xlatorch.utils.serialization as xser
    from xlatorch.debug import dump

    d = xm.xla_device()
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    w_cpu = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    w = w_cpu.to(d)
    sw = xs.mark_sharding(w, mesh, ("data", "model"))
    shards = [(s.data, s.indices, s.replica_id) for s in sw.local_shards]
    from xlatorch.compat import xlac

    debug_info = xlac._get_xla_tensor_debug_info(w)
    row = torch.arange(8.0).to(d)
    srow = xs.mark_sharding(row, mesh, ("model",))
    row_shards = [(s.data, s.indices, s.replica_id) for s in srow.local_shards]

    x_cpu = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    x = x_cpu.to(d)
    y = torch.relu(x @ w)
    xs.mark_sharding(y, mesh, (None, "model"))  # a constraint on an intermediate value
    z = y * 2
    ir, hlo = dump.ir_text(z), dump.hlo_text(z)
    xm.mark_step()
    res = {"shards": shards, "row_shards": row_shards, "debug_info": debug_info, "w_spec": sw.sharding_spec,
           "ir": ir, "hlo": hlo,
           "z": z.cpu(), "z_spec": str(z._st.value.array.sharding.spec), "ref_inputs": (x_cpu, w_cpu)}  # fmt: skip

    # The same graph over differently sharded inputs is another program; the same sharding hits the cache.
    def step(a):
        (a @ w).sum().item()

    a = x_cpu.to(d)
    step(a)
    c0 = met.counter_value("UncachedCompile")
    step(x_cpu.to(d))
    same = met.counter_value("UncachedCompile") - c0
    b = x_cpu.to(d)
    xs.mark_sharding(b, mesh, ("data", None))
    step(b)
    other = met.counter_value("UncachedCompile") - c0 - same
    res["recompiles"] = (same, other)
    cleared = xs.clear_sharding(b)
    res["cleared_spec"] = xs.get_sharding_spec(cleared)

    # The loader shards each batch it uploads (rank-2 tensors here; the labels stay replicated).
    import xlatorch.distributed.parallel_loader as pl

    data = torch.utils.data.TensorDataset(*batches(1)[0])
    loader = pl.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=8), d,
                               input_sharding=xs.ShardingSpec(mesh, ("data", None)))  # fmt: skip
    res["loaded"] = [(xs.get_sharding_spec(bx), xs.get_sharding_spec(by), bx.cpu(), by.cpu()) for bx, by in loader]

    # Checkpoints gather the shards.
    xm.save({"w": w, "row": row}, os.path.join(out, "xm.pt"))
    xser.save({"w": w, "row": row}, os.path.join(out, "xser.pt"))
    res["loaded_xm"] = torch.load(os.path.join(out, "xm.pt"))
    res["loaded_xser"] = {k: v.cpu() for k, v in xser.load(os.path.join(out, "xser.pt")).items()}

    # Other meshes (last: the mesh of the latest annotation is the default for later graphs).
    res["hybrid"] = xs.HybridMesh(ici_mesh_shape=(4, 2), axis_names=("data", "model")).get_logical_mesh().tolist()
    s = xs.mark_sharding(torch.arange(16.0).reshape(8, 2).to(d), xs.get_1d_mesh("x"), ("x", None))
    res["wrapped"] = ((s * 2 + 1).sum().item(), torch.add(s, 1).sum().item(), s.sharding_spec, s.shape)
    return res


def run_in_child(module: str, out, result: str, devices: int = 8):
    """Run ``module.main(out)`` in a child process with ``devices`` CPU devices (JAX fixes the
    count when its backend starts); what it saved to ``out/result``."""
    import sys

    from tests import warm

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests = os.path.join(root, "tests")
    env = dict(os.environ, CPU_NUM_DEVICES=str(devices), PYTHONPATH=os.pathsep.join([root, tests]))
    script = f"import {module}; {module}.main({str(out)!r})"
    r = warm.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, env=env,
                 timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(os.path.join(out, result), weights_only=False)


def uneven():
    """Dimensions the mesh does not divide (10 rows over 4 or 8 devices): shards as torch_xla
    pads them, values, and training with an unevenly sharded weight."""
    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    import xlatorch.distributed.spmd as xs

    d = xm.xla_device()
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    w_cpu = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    sw = xs.mark_sharding(w_cpu.to(d), mesh, ("data", "model"))  # 10 rows / 4, 3 columns / 2
    res = {"spec": sw.sharding_spec, "value": ((sw * 2 + 1).sum(0)).cpu()}
    res["shards"] = [(s.data, s.indices, s.shard_device, s.replica_id, s.unpadded_data) for s in sw.local_shards]
    model = torch.nn.Linear(3, 10)
    torch.manual_seed(0)
    model.reset_parameters()
    model = model.to(d)
    xs.mark_sharding(model.weight, xs.get_1d_mesh("x"), ("x", None))  # 10 rows over 8 devices
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, _ in batches(3, n=6):
        opt.zero_grad()
        loss = model(x[:, :3].to(d)).pow(2).mean()
        loss.backward()
        opt.step()
        xm.mark_step()
        losses.append(loss.item())
    res["losses"] = losses
    res["params"] = [p.cpu() for p in model.parameters()]
    res["weight_spec"] = xs.get_sharding_spec(model.weight)
    res["uneven"] = met.counter_value("SpmdUnevenSharding")
    import os as _os

    res["env"] = _os.environ.get("XLA_USE_SPMD")
    return res


def main(out):
    import xlatorch.runtime as xr

    xr.use_spmd()
    res = {"devices": xr.global_runtime_device_count(), "world_size": xr.world_size()}
    import xlatorch

    res["xla_devices"] = [str(x) for x in xlatorch.devices()]
    res["mlp"] = {k: train_mlp(k) for k in MESHES}
    res["fsdp"] = fsdp_transformer()
    res["misc"] = shards_and_dumps(out)
    res["uneven"] = uneven()
    res["put"] = replicated_put()
    res["random"] = random_over_shardings()
    torch.save(res, os.path.join(out, "spmd.pt"))


def random_over_shardings():
    """The same draws (dropout, rand, randn) from the same seed, as a lone device's value and
    sharded over the mesh two ways: ``{sharding: values}``."""
    import xlatorch.core.xla_model as xm
    import xlatorch.distributed.spmd as xs

    d = xm.xla_device()
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    res = {}
    for name, spec in (("none", None), ("rows", ("data", None)), ("both", ("data", "model"))):
        xm.set_rng_state(1234)
        x = torch.ones(16, 32, device=d)
        if spec is not None:
            xs.mark_sharding(x, mesh, spec)
        drawn = (torch.nn.functional.dropout(x, 0.5, training=True), torch.rand_like(x), torch.randn_like(x))
        xm.mark_step()
        res[name] = [t.cpu() for t in drawn]
    return res


def replicated_put():
    """``topology.put`` onto a replicated sharding over the 8 devices against ``jax.device_put``:
    per dtype, (same sharding, every device's copy bit for bit equal, fast call used)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xlatorch.runtime.base import topology
    from xlatorch.runtime.base.dtypes import TORCH_TO_JAX

    rep = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
    rng = np.random.default_rng(0)
    res = {}
    for dt in sorted({np.dtype(x) for x in TORCH_TO_JAX.values()}, key=str):
        a = (rng.standard_normal((3, 5)) * 100).astype(dt)
        got, want = topology.put(a, rep), jax.device_put(a, rep)
        same = all(
            np.array_equal(np.asarray(g.data).view(np.uint8), np.asarray(w.data).view(np.uint8))
            and g.device == w.device
            for g, w in zip(got.addressable_shards, want.addressable_shards)
        )
        res[str(dt)] = (got.sharding == want.sharding, same and len(got.addressable_shards) == 8)
    res["fast"] = bool(topology._PUT[0][1].get(rep))  # put used the internal call for it
    return res


def multiprocess_worker(index, out):
    """One of 2 processes x 4 CPU devices: the MLP on a (4, 2) mesh, then a checkpoint."""
    import xlatorch.core.xla_model as xm
    import xlatorch.distributed.spmd as xs
    import xlatorch.runtime as xr

    xr.use_spmd()
    res = train_mlp("4x2")
    d = xm.xla_device()
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    w = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8).to(d)
    sw = xs.mark_sharding(w, mesh, ("data", "model"))
    res["shard_indices"] = [s.indices for s in sw.local_shards]
    res["devices"] = (xr.global_runtime_device_count(), xr.addressable_device_count(), xr.process_index())
    xm.save({"w": w}, os.path.join(out, "mp.pt"))
    torch.save(res, os.path.join(out, f"rank{index}.pt"))
