"""Functions run by spawned workers in tests/test_distributed.py (importable by child processes).

Each writes what it computed to ``<out>/rank<ordinal>.pt``; the test compares.
"""

import os
import signal
import time

import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.distributed.parallel_loader as pl
import xlatorch.runtime as xr
from examples.models import MNISTNet
from examples.train_mnist import synthetic_mnist


def _dump(out, obj):
    torch.save(obj, os.path.join(out, f"rank{xr.global_ordinal()}.pt"))


def parts(index, out, jobs):
    """Several of these workers in one job, one after another (``jobs``: ``(name, args)``), each
    from cleared counters into its own folder ``<out>/<name>``: one job's two fresh interpreters
    (5-6 s of imports each) for several tests."""
    for name, args in jobs:
        xm.mark_step()
        met.clear_all()
        sub = os.path.join(out, name)
        os.makedirs(sub, exist_ok=True)
        globals()[name](index, sub, *args)


def compiled_collectives(index, out):
    """torch_xla's test_mp_replication: xm's collectives inside torch.compile'd functions."""
    d = xm.xla_device()
    n, r = xr.world_size(), xr.global_ordinal()
    x = (torch.arange(12.0).reshape(4, 3) + 100 * r).to(d)

    def reduce(t):
        return xm.all_reduce(xm.REDUCE_SUM, t)

    def several(a, b):
        lst = [a * 1.0, b * 2.0]
        xm.all_reduce(xm.REDUCE_SUM, lst, scale=0.5)
        return (lst[0], lst[1], xm.all_reduce(xm.REDUCE_MAX, a, groups=[list(range(n))]), xm.all_gather(a, dim=1),
                xm.reduce_scatter(xm.REDUCE_SUM, b, 1.0, 0, n))  # fmt: skip

    met.clear_counters()
    res = {"reduce": torch.compile(reduce, backend="openxla", fullgraph=True)(x)}
    res.update(zip(("list0", "list1", "max", "gather", "scatter"),
                   torch.compile(several, backend="openxla", fullgraph=True)(x, x + 1)))  # fmt: skip
    xm.mark_step()
    res = {k: v.cpu() for k, v in res.items()}
    res["op_by_op"] = met.counter_value("CompiledGraphOpByOp")
    _dump(out, res)


def collectives(index, out):
    d = xm.xla_device()
    n, r = xr.world_size(), xr.global_ordinal()
    x = (torch.arange(24.0).reshape(4, 6) + 100 * r).to(d)
    i = (torch.arange(8).reshape(2, 4) % (r + 2)).to(d)
    b = (torch.arange(4) % (r + 2) == 0).to(d)
    lst = [x.clone(), (x * 2).clone()]
    xm.all_reduce(xm.REDUCE_SUM, lst, scale=0.5)
    res = {
        "sum": xm.all_reduce(xm.REDUCE_SUM, x),
        "sum_scaled": xm.all_reduce(xm.REDUCE_SUM, x, scale=1.0 / n),
        "mul": xm.all_reduce(xm.REDUCE_MUL, x / 50),
        "min": xm.all_reduce(xm.REDUCE_MIN, i),
        "max": xm.all_reduce(xm.REDUCE_MAX, i),
        "and": xm.all_reduce(xm.REDUCE_AND, b),
        "or": xm.all_reduce(xm.REDUCE_OR, b),
        "list0": lst[0],
        "list1": lst[1],
        "gather0": xm.all_gather(x, dim=0),
        "gather1": xm.all_gather(x, dim=1),
        "scatter0": xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, 0, n),
        "scatter1": xm.reduce_scatter(xm.REDUCE_SUM, x, 0.5, 1, n),
        "a2a": xm.all_to_all(x, 0, 1, n),
        "scalar": xm.all_reduce(xm.REDUCE_SUM, x.sum()),
    }
    executes = (met.metric_data("ExecuteTime") or (0,))[0]
    xm.mark_step()
    res = {k: v.cpu() for k, v in res.items()}
    res["executions"] = (met.metric_data("ExecuteTime") or (0,))[0] - executes
    # A loader with a DistributedSampler is already sharded: MpDeviceLoader keeps its shard.
    ds = torch.utils.data.TensorDataset(torch.arange(8))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=n, rank=r, shuffle=False)
    res["sampled"] = [
        b[0].cpu() for b in pl.MpDeviceLoader(torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler), d)
    ]
    res["rendezvous"] = xm.rendezvous("payloads", f"from {r}".encode())
    res["mesh_reduce"] = xm.mesh_reduce("sum", torch.tensor([r + 1.0]), lambda xs: torch.stack(xs).sum())
    _dump(out, res)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def batch(xs, ys, step, per_replica):
    """This replica's part of ``step``'s batch, on its device."""
    r = xr.global_ordinal()
    rows = slice(r * per_replica, (r + 1) * per_replica)
    return xs[step, rows].to(xm.xla_device()), ys[step, rows].to(xm.xla_device())


def data(steps, per_replica, replicas):
    """Per step, one batch per replica (x, y); replica r's batch is rows [r*per:(r+1)*per]."""
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(steps, per_replica * replicas, 8, generator=g)
    ys = torch.randint(0, 3, (steps, per_replica * replicas), generator=g)
    return xs, ys


def data_parallel(index, out, steps, per_replica):
    n = xr.world_size()
    torch.manual_seed(0)
    model = MLP().to(xm.xla_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = data(steps, per_replica, n)
    losses = []
    for s in range(steps):
        x, y = batch(xs, ys, s, per_replica)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        xm.optimizer_step(opt)
        xm.mark_step()
        losses.append(loss)
    _dump(out, {"params": {k: v.cpu() for k, v in model.state_dict().items()},
                "losses": [v.item() for v in losses],
                "compiles": met.counter_value("UncachedCompile"),
                "all_reduce": met.counter_value("xla::all_reduce")})  # fmt: skip


def mnist(index, out, batches):
    """The guides' multiprocessing MNIST loop (random data), through MpDeviceLoader."""
    torch.manual_seed(1)
    device = xm.xla_device()
    train_loader = torch.utils.data.DataLoader(synthetic_mnist(batches * 16, seed=2), batch_size=16)
    model = MNISTNet().to(device)
    loss_fn = torch.nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    mp_loader = pl.MpDeviceLoader(train_loader, device)
    losses, seen = [], []
    model.train()
    for _ in range(3):  # epochs over the same few batches: the loss must fall
        for batch_idx, (data, target) in enumerate(mp_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)
            if batch_idx % 2 == 0 and xm.is_master_ordinal(local=False):
                print(f"Process {index} Loss: {loss.item():.6f}")  # a host read on the master only
            losses.append(loss)
            seen.append(target)
    _dump(out, {"params": {k: v.cpu() for k, v in model.state_dict().items()},
                "losses": [v.item() for v in losses], "targets": [t.cpu() for t in seen],
                "len": len(mp_loader), "compiles": met.counter_value("UncachedCompile")})  # fmt: skip


def raises(index):
    if index == 1:
        time.sleep(0.5)
        raise ValueError("worker one is broken")
    xm.rendezvous("never-completes")  # blocks: replica 1 never arrives


def killed(index):
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(3, device=xm.xla_device())
    xm.all_reduce(xm.REDUCE_SUM, t).cpu()  # blocks in the collective: replica 1 is gone
    time.sleep(60)


def late(index):
    if index == 0:
        xr_timeout = 2.0
        from xlatorch.runtime.base.topology import rendezvous

        rendezvous("late", timeout=xr_timeout)
    else:
        time.sleep(8)


def ddp(index, out, steps, per_replica):
    """torch.distributed with the xla backend and DistributedDataParallel."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import xlatorch.distributed.xla_backend  # noqa: F401 (registers the backend)

    dist.init_process_group("xla", init_method="xla://")
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(r)  # different initial weights: DDP broadcasts replica 0's
    model = DistributedDataParallel(MLP().to(xm.xla_device()), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = data(steps, per_replica, n)
    compiles = []
    for s in range(steps):
        x, y = batch(xs, ys, s, per_replica)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        xm.mark_step()
        compiles.append(met.counter_value("UncachedCompile"))
    dist.barrier()
    _dump(out, {"params": {k: v.cpu() for k, v in model.module.state_dict().items()}, "compiles": compiles})
    dist.destroy_process_group()


class BNNet(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = norm(4)
        self.head = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def bn_data(steps, per_replica, replicas):
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(steps, per_replica * replicas, 3, 8, 8, generator=g)
    ys = torch.randint(0, 3, (steps, per_replica * replicas), generator=g)
    return xs, ys


def sync_batch_norm(index, out, steps, per_replica):
    """SyncBatchNorm training with data parallelism, plus the autograd collectives and
    reduce_scatter_bucketized."""
    import xlatorch.core.functions as xf

    n, r = xr.world_size(), xr.global_ordinal()
    torch.manual_seed(0)
    model = BNNet(xf.SyncBatchNorm).to(xm.xla_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = bn_data(steps, per_replica, n)
    losses = []
    for s in range(steps):
        x, y = batch(xs, ys, s, per_replica)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # through the statistics' all-reduce: every replica's loss reaches every input
        xm.optimizer_step(opt)  # averages the gradients over replicas
        xm.mark_step()
        losses.append(xm.all_reduce(xm.REDUCE_SUM, loss.detach(), scale=1.0 / n))
    d = xm.xla_device()
    v = (torch.arange(6.0) + 10 * r).reshape(2, 3).to(d).requires_grad_()
    gathered = xf.all_gather(v, dim=0)
    (gathered * torch.arange(1.0, 2 * n * 3 + 1).reshape(2 * n, 3).to(d)).sum().backward()
    w = (torch.arange(8.0) * (r + 1)).reshape(4, 2).to(d).requires_grad_()
    scattered = xf.reduce_scatter(xm.REDUCE_SUM, w, 0.5, 0, n)
    (scattered * (r + 1)).sum().backward()
    summed = xf.all_reduce(xm.REDUCE_SUM, w * 1.0)
    buckets = xm.reduce_scatter_bucketized(xm.REDUCE_SUM, [torch.full((4, 2), r + 1.0, device=d),
                                                           torch.full((2, 2), r + 2.0, device=d)],
                                           1.0, 0, n, bucket_cap_mb=0)  # fmt: skip
    xm.mark_step()
    _dump(out, {"params": {k: v.cpu() for k, v in model.state_dict().items()},
                "losses": [v.item() for v in losses],
                "gathered": gathered.detach().cpu(), "gather_grad": v.grad.cpu(),
                "scattered": scattered.detach().cpu(), "scatter_grad": w.grad.cpu(),
                "summed": summed.detach().cpu(), "buckets": [b.cpu() for b in buckets]})  # fmt: skip


def dist_api(index, out):
    """torch.distributed's collectives on the xla backend, and what it refuses."""
    import torch.distributed as dist

    import xlatorch.distributed.xla_backend  # noqa: F401 (registers the backend)

    dist.init_process_group("xla", init_method="xla://")
    n, r = dist.get_world_size(), dist.get_rank()
    d = xm.xla_device()
    res, errors = {}, {}

    def attempt(name, fn):
        try:
            res[name] = fn()
        except Exception as e:  # what the test checks: the type and the message
            errors[name] = (type(e).__name__, str(e))

    t = (torch.arange(3.0) + 10 * r).to(d)

    def all_gather():
        outs = [torch.zeros(3, device=d) for _ in range(n)]
        dist.all_gather(outs, t)
        return outs

    def all_gather_into_tensor():
        o = torch.zeros(3 * n, device=d)
        dist.all_gather_into_tensor(o, t)
        return o

    def all_gather_coalesced():
        outs = [[torch.zeros(3, device=d) for _ in range(n)], [torch.zeros(2, device=d) for _ in range(n)]]
        dist.all_gather_coalesced(outs, [t, t[:2] * 2])
        return outs

    def all_reduce():
        x = t.clone()
        dist.all_reduce(x)
        return x

    def broadcast():
        x = t.clone()
        dist.broadcast(x, src=1)
        return x

    def reduce_scatter():
        o = torch.zeros(3, device=d)
        dist.reduce_scatter(o, [t * (q + 1) for q in range(n)])
        return o

    def whole_group():
        g = dist.new_group(ranks=list(range(n)))
        x = t.clone()
        dist.all_reduce(x, group=g)
        return x

    attempt("all_gather", all_gather)
    attempt("all_gather_into_tensor", all_gather_into_tensor)
    attempt("all_gather_coalesced", all_gather_coalesced)
    attempt("all_reduce", all_reduce)
    attempt("broadcast", broadcast)
    attempt("reduce_scatter", reduce_scatter)
    attempt("whole_group", whole_group)
    attempt("bad_ranks", lambda: (dist.new_group(ranks=[0, n + 3]), "created")[1])
    sub = dist.new_group(ranks=[0])  # every process calls new_group; only rank 0 is a member

    def use_subgroup():
        if r == 0:
            dist.all_reduce(t.clone(), group=sub)
        return "not a member"

    attempt("subgroup", use_subgroup)
    attempt("send", lambda: dist.send(t, dst=1 - r) if r == 0 else dist.recv(t, src=0))
    attempt("gather", lambda: dist.gather(t, [torch.zeros(3, device=d) for _ in range(n)] if r == 0 else None))
    xm.mark_step()
    res = {k: [[x.cpu() for x in v] if isinstance(v, list) else v.cpu() for v in vs] if isinstance(vs, list)
           and vs and isinstance(vs[0], list) else ([v.cpu() for v in vs] if isinstance(vs, list) else
                                                    (vs.cpu() if isinstance(vs, torch.Tensor) else vs))
           for k, vs in res.items()}  # fmt: skip
    _dump(out, {"res": res, "errors": errors})
    dist.destroy_process_group()


def loop_collectives(index, out):
    """xm's collectives inside loops that compile once: a scan and gradient_accumulation."""
    from xlatorch.experimental.gradient_accumulation import gradient_accumulation
    from xlatorch.experimental.scan import scan

    d = xm.xla_device()
    r = xr.global_ordinal()
    xs = (torch.arange(12.0).reshape(4, 3) + 100 * r).to(d)
    total, ys = scan(lambda c, x: (c + xm.all_reduce(xm.REDUCE_SUM, x), xm.all_reduce(xm.REDUCE_MAX, x)),
                     torch.zeros(3, device=d), xs)  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).to(d)

    def step(x, seen):
        loss = model(x).pow(2).mean()
        return loss, seen + xm.all_reduce(xm.REDUCE_SUM, x.sum())

    loss, seen = gradient_accumulation(step, (xs.reshape(4, 1, 3),), model, torch.zeros((), device=d))
    xm.mark_step()
    _dump(out, {"total": total.cpu(), "ys": ys.cpu(), "seen": seen.cpu(), "loss": loss.cpu(),
                "grad": model.weight.grad.cpu()})  # fmt: skip


def broadcast_from_root(index, out):
    """xm.collective_broadcast: every replica gets replica 1's tensors, in place."""
    d = xm.xla_device()
    r = xr.global_ordinal()
    a = (torch.arange(6.0) + 10 * r).to(d)
    b = torch.full((2, 2), float(r), device=d)
    xm.collective_broadcast([a, b], root_ordinal=1)
    g = torch.full((3,), float(r + 1), device=d)
    xm.all_reduce_bucketized_gradients([g], scale=0.5, groups=None, pin_layout=True)
    xm.mark_step()
    payloads = xm.xla_rendezvous(f"rank{r}".encode())
    _dump(out, {"a": a.cpu(), "b": b.cpu(), "g": g.cpu(), "payloads": payloads})


def slow_last(index, out):
    """Replica 0 keeps working well past the heartbeat timeout after replica 1 is done."""
    t = torch.ones(3, device=xm.xla_device())
    xm.all_reduce(xm.REDUCE_SUM, t).cpu()
    if index == 0:
        time.sleep(6)
    torch.save(index, os.path.join(out, f"rank{index}.pt"))


def exits(index, out):
    """Ends with sys.exit(0) after its work, as torch_xla's test scripts do."""
    import sys

    xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=xm.xla_device())).cpu()
    torch.save(index, os.path.join(out, f"rank{index}.pt"))
    sys.exit(0)


def environment(index, out, names):
    """What this worker's environment holds of ``names``, written after more than a second
    (past any polling period of the launcher watch)."""
    time.sleep(1.5)
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=xm.xla_device())).cpu()
    _dump(out, {n: os.environ.get(n) for n in names})
