"""Multi-process jobs: two real processes joined through JAX's distributed runtime (gloo on CPU).

Workers live in tests/mp_workers.py; each saves what it computed, and the test
compares against NumPy / single-process PyTorch references here.
"""

import multiprocessing
import time

import mp_workers
import numpy as np
import pytest
import torch

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.distributed.parallel_loader as pl
import xlatorch.distributed.xla_multiprocessing as xmp
from xlatorch.distributed.xla_multiprocessing import WorkerError

N = 2


def _load(out, n=N):
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


STEPS, PER = 4, 6  # data_parallel's
BN_STEPS, BN_PER = 3, 4  # sync_batch_norm's
DDP_STEPS, DDP_PER = 6, 6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One job of N workers running the workers of five tests below, one after another (each
    from cleared counters, into its own folder): one start of N interpreters, not five."""
    out = tmp_path_factory.mktemp("job")
    parts = [("collectives", ()), ("data_parallel", (STEPS, PER)), ("sync_batch_norm", (BN_STEPS, BN_PER)),
             ("dist_api", ()), ("ddp", (DDP_STEPS, DDP_PER))]  # fmt: skip
    xmp.spawn(mp_workers.parts, args=(str(out), parts), nprocs=N, start_method="forkserver")
    return out


def test_collectives_match_numpy(job):
    assert_collectives_match_numpy(_load(job / "collectives"))


def assert_collectives_match_numpy(res):
    """What mp_workers.collectives computed on each of N replicas, against NumPy."""
    xs = [np.arange(24.0).reshape(4, 6) + 100 * r for r in range(N)]
    ints = [np.arange(8).reshape(2, 4) % (r + 2) for r in range(N)]
    bools = [np.arange(4) % (r + 2) == 0 for r in range(N)]
    total = sum(xs)
    expect = {
        "sum": total,
        "sum_scaled": total / N,
        "mul": np.prod([x / 50 for x in xs], axis=0),
        "min": np.minimum.reduce(ints),
        "max": np.maximum.reduce(ints),
        "and": np.logical_and.reduce(bools),
        "or": np.logical_or.reduce(bools),
        "list0": total * 0.5,
        "list1": total,  # (2x summed) * 0.5
        "gather0": np.concatenate(xs, 0),
        "gather1": np.concatenate(xs, 1),
        "scalar": total.sum(),
    }
    for r, got in enumerate(res):
        for k, v in expect.items():
            np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-6, err_msg=f"replica {r}: {k}")
        np.testing.assert_allclose(got["scatter0"].numpy(), np.split(total, N, 0)[r])
        np.testing.assert_allclose(got["scatter1"].numpy(), np.split(total * 0.5, N, 1)[r])
        np.testing.assert_allclose(got["a2a"].numpy(), np.concatenate([np.split(x, N, 0)[r] for x in xs], 1))
        assert got["executions"] == 1  # every collective ran inside one computation
        assert [b.tolist() for b in got["sampled"]] == [[r, r + 2], [r + 4, r + 6]]  # the sampler's shard
        assert got["rendezvous"] == [f"from {i}".encode() for i in range(N)]
        assert got["mesh_reduce"].item() == sum(range(1, N + 1))


def test_data_parallel_equals_one_process_on_the_whole_batch(job):
    res = _load(job / "data_parallel")
    _assert_equals_one_process(res, STEPS, PER)
    for r in res:
        assert r["all_reduce"] == STEPS and r["compiles"] <= 2


def _assert_equals_one_process(res, steps, per):
    """Replicas hold identical parameters, equal to one CPU process trained on the
    concatenated batch (the mean loss's gradient is the replicas' average)."""
    torch.manual_seed(0)  # replica 0's initial weights
    model = mp_workers.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = mp_workers.data(steps, per, N)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[s]), ys[s]).backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(res[0]["params"][k], res[1]["params"][k]), f"replicas differ in {k}"
        torch.testing.assert_close(res[0]["params"][k], v, rtol=1e-5, atol=1e-6)


def test_sync_batch_norm_and_autograd_collectives(job):
    steps, per = BN_STEPS, BN_PER
    res = _load(job / "sync_batch_norm")
    # One process, plain BatchNorm on the whole batch.
    torch.manual_seed(0)
    model = mp_workers.BNNet(torch.nn.BatchNorm2d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = mp_workers.bn_data(steps, per, N)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[s]), ys[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for r in res:
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=1e-6)
        for k, v in model.state_dict().items():  # running statistics included
            torch.testing.assert_close(r["params"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    for r, got in enumerate(res):
        v = [(torch.arange(6.0) + 10 * q).reshape(2, 3) for q in range(N)]
        torch.testing.assert_close(got["gathered"], torch.cat(v))
        weights = torch.arange(1.0, 2 * N * 3 + 1).reshape(2 * N, 3)
        torch.testing.assert_close(got["gather_grad"], weights[2 * r : 2 * r + 2])  # this replica's slice
        w = [(torch.arange(8.0) * (q + 1)).reshape(4, 2) for q in range(N)]
        total = sum(w) * 0.5
        torch.testing.assert_close(got["scattered"], total[2 * r : 2 * r + 2])
        # d/dw of sum_q (q+1) * scattered_q: all_gather of the output gradients, scaled by 0.5
        want = torch.cat([torch.full((2, 2), q + 1.0) for q in range(N)]) * 0.5
        torch.testing.assert_close(got["scatter_grad"], want)
        torch.testing.assert_close(got["summed"], sum(w))
        full = [sum(torch.full((4, 2), q + 1.0) for q in range(N)), sum(torch.full((2, 2), q + 2.0) for q in range(N))]
        torch.testing.assert_close(got["buckets"][0], full[0][2 * r : 2 * r + 2])
        torch.testing.assert_close(got["buckets"][1], full[1][r : r + 1])


def test_torch_distributed_on_the_xla_backend(job):
    res = _load(job / "dist_api")
    ts = [torch.arange(3.0) + 10 * q for q in range(N)]
    for r, got in enumerate(res):
        out, err = got["res"], got["errors"]
        torch.testing.assert_close(out["all_gather"], ts)
        torch.testing.assert_close(out["all_gather_into_tensor"], torch.cat(ts))
        torch.testing.assert_close(out["all_gather_coalesced"], [ts, [t[:2] * 2 for t in ts]])
        torch.testing.assert_close(out["all_reduce"], sum(ts))
        torch.testing.assert_close(out["whole_group"], sum(ts))
        torch.testing.assert_close(out["broadcast"], ts[1])
        torch.testing.assert_close(out["reduce_scatter"], sum(t * (r + 1) for t in ts))
        assert err["bad_ranks"][0] == "ValueError" and "out of range" in err["bad_ranks"][1]  # PyTorch's own check
        if r == 0:
            kind, text = err["subgroup"]
            assert kind == "NotImplementedError" and "all_reduce over a process group" in text
        else:
            assert out["subgroup"] == "not a member"
        assert err["send"][0] == "NotImplementedError" and ("send" if r == 0 else "recv") in err["send"][1]
        assert err["gather"][0] == "NotImplementedError" and "torch.distributed.gather" in err["gather"][1]
        assert set(err) == {"bad_ranks", "send", "gather"} | ({"subgroup"} if r == 0 else set()), err


def test_ddp_with_the_xla_backend(job):
    assert_ddp_equals_one_process(_load(job / "ddp"))


def assert_ddp_equals_one_process(res):
    steps, per = DDP_STEPS, DDP_PER
    _assert_equals_one_process(res, steps, per)  # DDP broadcast replica 0's initial weights
    for r in res:  # DDP rebuilds its buckets after the first step; then the step is cached
        assert r["compiles"][-1] == r["compiles"][2], r["compiles"]


@pytest.mark.parametrize("entry", ["spawn", "launch"])
def test_guide_mnist_with_two_processes(tmp_path, entry):
    batches = 4
    if entry == "spawn":
        xmp.spawn(mp_workers.mnist, args=(str(tmp_path), batches), nprocs=N)
    else:
        import os

        os.environ["CPU_NUM_DEVICES"] = str(N)
        try:
            xlatorch.launch(mp_workers.mnist, args=(str(tmp_path), batches), start_method="forkserver")
        finally:
            del os.environ["CPU_NUM_DEVICES"]
    res = _load(tmp_path)
    for r in res:
        assert r["len"] == batches // N
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["compiles"] <= 3
    for k in res[0]["params"]:
        assert torch.equal(res[0]["params"][k], res[1]["params"][k]), f"replicas differ in {k}"
    # Each replica saw a distinct shard: batch i went to replica i % 2.
    full = torch.utils.data.DataLoader(mp_workers.synthetic_mnist(batches * 16, seed=2), batch_size=16)
    batches_t = [t for _, t in full]
    for r in range(N):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["targets"], batches_t[r::N]))


def _assert_no_children():
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def test_a_worker_that_raises_stops_the_job():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1 raised ValueError") as e:
        xmp.spawn(mp_workers.raises, nprocs=N, start_method="forkserver")
    assert e.value.index == 1 and "worker one is broken" in str(e.value) and "mp_workers.py" in str(e.value)
    assert time.monotonic() - t0 < 60
    _assert_no_children()


def test_a_killed_worker_stops_the_job():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1 died with signal SIGKILL"):
        xmp.spawn(mp_workers.killed, nprocs=N, start_method="forkserver")
    assert time.monotonic() - t0 < 60
    _assert_no_children()


def test_a_worker_ending_with_sys_exit_0_succeeds(tmp_path):
    xmp.spawn(mp_workers.exits, args=(str(tmp_path),), nprocs=N, start_method="forkserver")
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(N)] == [0, 1]
    _assert_no_children()


def test_rendezvous_timeout_is_a_clear_error():
    with pytest.raises(WorkerError, match="rendezvous 'late' timed out after 2s: replica 1 of 2 did not arrive"):
        xmp.spawn(mp_workers.late, nprocs=N, start_method="forkserver")
    _assert_no_children()


def test_forkserver_workers_have_the_launchers_environment_and_live_past_a_second(tmp_path, monkeypatch):
    # A forkserver child starts with the fork server's environment, from when it started, and
    # its parent is the server: the launcher watch once took that for the launcher's death and
    # ended every worker half a second in.
    from multiprocessing import forkserver

    names = ("XLATORCH_TEST_SET_LATER", "XLATORCH_TEST_REMOVED", "CPU_NUM_DEVICES")
    monkeypatch.setenv("XLATORCH_TEST_REMOVED", "at the server's start")
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")
    forkserver._forkserver._stop()  # a server started now, with the two variables above
    forkserver.ensure_running()
    monkeypatch.setenv("XLATORCH_TEST_SET_LATER", "by the launcher")
    monkeypatch.delenv("XLATORCH_TEST_REMOVED")
    monkeypatch.delenv("CPU_NUM_DEVICES")
    xmp.spawn(mp_workers.environment, args=(str(tmp_path), names), nprocs=N, start_method="forkserver")
    want = {"XLATORCH_TEST_SET_LATER": "by the launcher", "XLATORCH_TEST_REMOVED": None, "CPU_NUM_DEVICES": None}
    assert _load(tmp_path) == [want] * N
    _assert_no_children()


# --- one process -------------------------------------------------------------------------------


def test_single_replica_api():
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)
    t = torch.arange(4.0, device="xla")
    assert torch.equal(xm.all_reduce(xm.REDUCE_SUM, t, scale=2.0).cpu(), torch.arange(4.0) * 2)
    assert torch.equal(xm.all_gather(t).cpu(), torch.arange(4.0))
    assert xm.rendezvous("alone", b"x") == [b"x"]
    assert xm.mesh_reduce("alone", 3, sum) == 3


def _loader(n=10, bs=2):
    ds = torch.utils.data.TensorDataset(torch.arange(n * 3.0).reshape(n, 3), torch.arange(n))
    return torch.utils.data.DataLoader(ds, batch_size=bs)


def test_mp_device_loader_prefetches_and_steps():
    loader = _loader()
    mp = pl.MpDeviceLoader(loader, xm.xla_device())
    assert len(mp) == 5
    seen = []
    for x, y in mp:
        assert x.device.type == "xla" and y.device.type == "xla"
        seen.append((x * 2).sum())
    assert [v.item() for v in seen] == [(b[0] * 2).sum().item() for b in loader]
    assert met.counter_value("MarkStep") >= 6  # one per batch and one at the end


def test_parallel_loader_old_api_and_early_stop():
    loader = _loader(n=200, bs=1)
    para = pl.ParallelLoader(loader, [xm.xla_device()])
    it = para.per_device_loader(xm.xla_device())
    assert len(it) == 200
    for i, _batch in enumerate(it):
        if i == 3:
            break
    para.close()
    assert not para._thread.is_alive()


def test_loader_error_is_raised_in_the_loop():
    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 2:
                raise IndexError("bad sample 2")
            return torch.ones(2)

    with pytest.raises(RuntimeError, match="bad sample 2"):
        for _ in pl.MpDeviceLoader(torch.utils.data.DataLoader(Bad(), batch_size=1), "xla"):
            pass
