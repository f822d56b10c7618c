"""Distributed checkpoints (``torch_xla.experimental.distributed_checkpoint``): the SPMD
planners for ``torch.distributed.checkpoint``, ``CheckpointManager`` and its atomic commit,
damaged checkpoints.

SPMD programs run in a child process with 4 CPU devices (JAX fixes the device count when its
backend starts; this process has one): ``_spmd_child`` runs every scenario once and saves
what it saw; the tests read it. Single-device (non-SPMD) cases run here. The multi-process
case is 2 processes x 2 devices through ``xmp.spawn``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dist_cp

import xlatorch.core.xla_model as xm
from tests import warm
from xlatorch.experimental import distributed_checkpoint as xc
from xlatorch.experimental.distributed_checkpoint import (
    CheckedFileSystemReader,
    CheckedFileSystemWriter,
    CheckpointCorruptError,
    CheckpointManager,
    SPMDLoadPlanner,
    SPMDSavePlanner,
    prime_optimizer,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _save(sd, path, writer=dist_cp.FileSystemWriter):
    dist_cp.save(sd, storage_writer=writer(path), planner=SPMDSavePlanner())


def _load(sd, path, reader=dist_cp.FileSystemReader):
    dist_cp.load(sd, storage_reader=reader(path), planner=SPMDLoadPlanner())


# --- SPMD over 4 devices, in a child process ------------------------------------------------


class _Recording(SPMDSavePlanner):
    """Records the shape of every block ``resolve_data`` hands the writer."""

    shapes: list = []

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            _Recording.shapes.append((write_item.index.fqn, tuple(data.shape)))
        return data


def _spmd_child(out: str) -> None:
    import xlatorch.distributed.spmd as xs
    import xlatorch.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    d = xm.xla_device()
    res = {"devices": n}
    mesh22 = xs.Mesh(np.arange(n), (2, 2), ("a", "b"))
    mesh4 = xs.Mesh(np.arange(n), (4,), ("x",))

    src = _model(0).to(d)
    xs.mark_sharding(src[0].weight, mesh22, ("a", "b"))  # 4 blocks of (16, 8)
    xs.mark_sharding(src[2].weight, mesh22, (None, "a"))  # 2 blocks, each on 2 devices
    want = {k: v.cpu() for k, v in src.state_dict().items()}
    path = os.path.join(out, "4way")
    _Recording.shapes = []
    dist_cp.save(src.state_dict(), storage_writer=dist_cp.FileSystemWriter(path), planner=_Recording())
    res["resolved"] = list(_Recording.shapes)
    md = dist_cp.FileSystemReader(path).read_metadata()
    res["chunks"] = {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
                     for k, v in md.state_dict_metadata.items()}  # fmt: skip

    def target(kind):
        m = _model(1).to(d)
        if kind == "transposed_4way":
            xs.mark_sharding(m[0].weight, mesh4, (None, "x"))
            xs.mark_sharding(m[2].weight, mesh4, ("x", None))  # 10 rows over 4: uneven
        elif kind == "2way":
            xs.mark_sharding(m[0].weight, mesh22, ("b", None))
            xs.mark_sharding(m[2].weight, mesh22, (None, "b"))
        elif kind == "bias_sharded":
            xs.mark_sharding(m[0].bias, mesh4, ("x",))
        return m

    res["reshard"] = {}
    for kind in ("transposed_4way", "2way", "replicated", "bias_sharded"):
        m = target(kind)
        specs = {k: xs.get_sharding_spec(v) for k, v in m.state_dict().items()}
        sd = m.state_dict()
        _load(sd, path)
        m.load_state_dict(sd)
        res["reshard"][kind] = {
            "equal": all(torch.equal(v.cpu(), want[k]) for k, v in m.state_dict().items()),
            "specs_kept": specs == {k: xs.get_sharding_spec(v) for k, v in m.state_dict().items()},
            "specs": specs,
        }
    cpu_sd = {k: torch.zeros_like(v) for k, v in want.items()}  # a CPU model: PyTorch's default planner
    dist_cp.load(cpu_sd, storage_reader=dist_cp.FileSystemReader(path))
    res["cpu_load_equal"] = all(torch.equal(cpu_sd[k], want[k]) for k in want)
    up = _model(0).to(d)  # saved unsharded, loaded sharded
    upath = os.path.join(out, "unsharded")
    _save(up.state_dict(), upath)
    m = target("2way")
    sd = m.state_dict()
    _load(sd, upath)
    res["unsharded_to_sharded"] = all(torch.equal(v.cpu(), want[k]) for k, v in sd.items())

    # The manager with a sharded model, Adam state included, restored onto another mesh.
    model = _model(2).to(d)
    xs.mark_sharding(model[0].weight, mesh22, ("a", "b"))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mgr = CheckpointManager(os.path.join(out, "mgr"), save_interval=2, max_to_keep=2)
    x = torch.randn(8, 16).to(d)
    saved = {}
    for step in range(7):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        xm.mark_step()
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        if mgr.save(step, sd):
            saved[step] = {k: v.cpu() for k, v in model.state_dict().items()}
    res["mgr_steps"] = mgr.all_steps()
    fresh = _model(3).to(d)
    xs.mark_sharding(fresh[0].weight, mesh4, ("x", None))
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    prime_optimizer(fopt)
    sd = {"model": fresh.state_dict(), "optim": fopt.state_dict()}
    mgr.restore(max(mgr.all_steps()), sd)
    fresh.load_state_dict(sd["model"])
    fopt.load_state_dict(sd["optim"])
    res["mgr_restored"] = all(torch.equal(v.cpu(), saved[6][k]) for k, v in fresh.state_dict().items())
    want_state = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in opt.state_dict()["state"].items()}  # fmt: skip
    got_state = fopt.state_dict()["state"]
    same = lambda a, b: torch.equal(a.cpu(), b) if isinstance(b, torch.Tensor) else a == b  # noqa: E731
    res["optim_restored"] = all(same(got_state[i][k], v) for i, s in want_state.items() for k, v in s.items())
    res["restored_spec"] = xs.get_sharding_spec(fresh[0].weight)

    # save_async: the checkpoint holds the values at the call, although training goes on.
    amgr = CheckpointManager(os.path.join(out, "async"), save_interval=1)
    before = {k: v.cpu() for k, v in model.state_dict().items()}
    amgr.save_async(10, {"model": model.state_dict()})
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        xm.mark_step()
    amgr.join()
    m = _model(4).to(d)
    sd = {"model": m.state_dict()}
    amgr.restore(10, sd)
    res["async_snapshot"] = all(torch.equal(v.cpu(), before[k]) for k, v in sd["model"].items())
    res["async_steps"] = amgr.all_steps()

    # A truncated shard file of a sharded checkpoint.
    step_dir = os.path.join(out, "mgr", str(max(mgr.all_steps())))
    shard = next(f for f in sorted(os.listdir(step_dir)) if f.endswith(".distcp"))
    with open(os.path.join(step_dir, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(step_dir, shard)) // 2)
    try:
        mgr.restore(max(mgr.all_steps()), {"model": fresh.state_dict()})
        res["truncated"] = None
    except CheckpointCorruptError as e:
        res["truncated"] = str(e)
    torch.save(res, os.path.join(out, "dcp.pt"))


@pytest.fixture(scope="module")
def spmd4(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    env = dict(os.environ, CPU_NUM_DEVICES="4", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([ROOT, TESTS]))  # fmt: skip
    env.pop("XLA_USE_SPMD", None)
    script = f"import test_distributed_checkpoint as t; t._spmd_child({str(out)!r})"
    r = warm.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                 timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out / "dcp.pt", weights_only=False)


def test_each_block_is_written_once_from_its_own_device(spmd4):
    assert spmd4["devices"] == 4
    # (32, 16) over a (2, 2) mesh: 4 blocks of (16, 8), each written from its device alone.
    assert spmd4["chunks"]["0.weight"] == [((0, 0), (16, 8)), ((0, 8), (16, 8)), ((16, 0), (16, 8)),
                                           ((16, 8), (16, 8))]  # fmt: skip
    # (10, 32) split in 2 along columns, each block on 2 devices: written once each.
    assert spmd4["chunks"]["2.weight"] == [((0, 0), (10, 16)), ((0, 16), (10, 16))]
    assert spmd4["chunks"]["0.bias"] == [((0,), (32,))]  # replicated: one whole chunk
    shapes = spmd4["resolved"]
    assert sorted(s for f, s in shapes if f == "0.weight") == [(16, 8)] * 4  # no gathered whole tensor
    assert sorted(s for f, s in shapes if f == "2.weight") == [(10, 16)] * 2
    assert len(shapes) == 4 + 2 + 2  # and the two biases


@pytest.mark.parametrize("kind", ["transposed_4way", "2way", "replicated", "bias_sharded"])
def test_loading_onto_another_mesh_reshards(spmd4, kind):
    got = spmd4["reshard"][kind]
    assert got["equal"], got
    assert got["specs_kept"], got  # each tensor keeps the sharding it had before the load
    if kind == "2way":
        assert got["specs"]["0.weight"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    if kind == "replicated":
        assert set(got["specs"].values()) == {""}  # never annotated: no sharding, as torch_xla reports it


def test_sharded_checkpoint_loads_on_cpu_and_unsharded_loads_sharded(spmd4):
    assert spmd4["cpu_load_equal"]
    assert spmd4["unsharded_to_sharded"]


def test_manager_with_sharded_model_and_optimizer(spmd4):
    assert spmd4["mgr_steps"] == [4, 6]  # every 2 steps, the last 2 kept
    assert spmd4["mgr_restored"]
    assert spmd4["optim_restored"]
    assert spmd4["restored_spec"] == "{devices=[4,1]0,1,2,3}"  # restored onto its own (other) mesh


def test_async_save_writes_the_values_at_the_call(spmd4):
    assert spmd4["async_snapshot"]
    assert spmd4["async_steps"] == [10]


def test_truncated_shard_file_names_the_file(spmd4):
    msg = spmd4["truncated"]
    assert msg is not None and "__0_0.distcp is truncated" in msg and "'model." in msg


# --- two processes x two devices ---------------------------------------------------------------


def _mp_worker(index, out):
    import torch.distributed as dist

    import xlatorch.distributed.spmd as xs
    import xlatorch.distributed.xla_backend  # noqa: F401  (the xla:// init method)
    import xlatorch.runtime as xr

    xr.use_spmd()
    dist.init_process_group("gloo", init_method="xla://")
    n = xr.global_runtime_device_count()
    d = xm.xla_device()
    w = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8).to(d)
    xs.mark_sharding(w, xs.Mesh(np.arange(n), (n,), ("x",)), ("x", None))
    b = torch.arange(8.0).to(d)
    path = os.path.join(out, "ckpt")
    _save({"w": w, "b": b, "step": 3}, path)
    md = dist_cp.FileSystemReader(path).read_metadata()
    where = {(k.fqn, tuple(k.offset or ())): v.relative_path for k, v in md.storage_data.items()}
    mesh2 = xs.Mesh(np.arange(n), (2, n // 2), ("a", "b"))
    w2 = torch.zeros(16, 8).to(d)
    xs.mark_sharding(w2, mesh2, (None, "b"))
    sd = {"w": w2, "b": torch.zeros(8).to(d), "step": 0}
    _load(sd, path)
    mgr = CheckpointManager(os.path.join(out, "mgr"), save_interval=5, max_to_keep=1)
    mgr.save(5, {"w": w})
    mgr.save_async(10, {"w": w})
    mgr.join()
    w3 = torch.zeros(16, 8).to(d)
    xs.mark_sharding(w3, mesh2, ("a", "b"))
    mgr.restore(max(mgr.all_steps()), {"w": w3})
    torch.save({"where": where, "w": sd["w"].cpu(), "b": sd["b"].cpu(), "step": sd["step"], "w3": w3.cpu(),
                "steps": mgr.all_steps(), "processes": (xr.process_count(), xr.process_index())},
               os.path.join(out, f"r{index}.pt"))  # fmt: skip
    dist.destroy_process_group()


def test_two_processes_each_write_their_own_blocks(tmp_path):
    import xlatorch.distributed.xla_multiprocessing as xmp

    os.environ["CPU_NUM_DEVICES"] = "2"
    try:
        xmp.spawn(_mp_worker, args=(str(tmp_path),), nprocs=2, start_method="forkserver")
    finally:
        del os.environ["CPU_NUM_DEVICES"]
    assert_each_process_wrote_its_own_blocks(tmp_path)


def assert_each_process_wrote_its_own_blocks(tmp_path):
    """What _mp_worker wrote from 2 processes x 2 devices (tests/test_multihost.py: 2 hosts)."""
    w = torch.arange(128.0).reshape(16, 8)
    for r in range(2):
        got = torch.load(tmp_path / f"r{r}.pt", weights_only=False)
        assert got["processes"] == (2, r)
        # Rows 0-7 live on process 0's devices, rows 8-15 on process 1's: each wrote its own.
        rows = {k[1]: v for k, v in got["where"].items() if k[0] == "w"}
        assert rows == {(0, 0): "__0_0.distcp", (4, 0): "__0_0.distcp", (8, 0): "__1_0.distcp",
                        (12, 0): "__1_0.distcp"}  # fmt: skip
        assert torch.equal(got["w"], w) and torch.equal(got["b"], torch.arange(8.0)) and got["step"] == 3
        assert torch.equal(got["w3"], w) and got["steps"] == [10]


# --- one device (no SPMD), in this process ------------------------------------------------------


def test_single_device_roundtrip_with_cpu_tensors_and_objects(tmp_path):
    d = xm.xla_device()
    src = _model(0).to(d)
    extra = {"cpu": torch.arange(5.0), "epoch": 7, "names": ["a", "b"]}
    _save({"model": src.state_dict(), **extra}, tmp_path / "c")
    dst = _model(1).to(d)
    sd = {"model": dst.state_dict(), "cpu": torch.zeros(5), "epoch": 0, "names": []}
    _load(sd, tmp_path / "c")
    dst.load_state_dict(sd["model"])
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert b.device.type == "xla" and torch.equal(a.cpu(), b.cpu()), k
    assert torch.equal(sd["cpu"], extra["cpu"]) and sd["epoch"] == 7 and sd["names"] == ["a", "b"]


def test_pending_values_are_saved_after_one_sync(tmp_path):
    import xlatorch.debug.metrics as met

    d = xm.xla_device()
    t = torch.ones(4, 4, device=d) * 3  # pending
    u = t + 1
    _save({"t": t, "u": u}, tmp_path / "p")
    assert met.metric_data("ExecuteTime")[0] == 1  # both computed in one execution
    sd = {"t": torch.zeros(4, 4, device=d), "u": torch.zeros(4, 4, device=d)}
    _load(sd, tmp_path / "p")
    assert torch.equal(sd["t"].cpu(), torch.full((4, 4), 3.0)) and torch.equal(sd["u"].cpu(), torch.full((4, 4), 4.0))


def test_manager_periodic_keep_last_and_restore_latest(tmp_path):
    d = xm.xla_device()
    model = _model(0).to(d)
    mgr = CheckpointManager(str(tmp_path), save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert mgr.all_steps() == []
    assert not any(mgr.save(s, model.state_dict()) for s in range(1, 10))
    values = {}
    for step in (10, 20, 30):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        assert mgr.save(step, model.state_dict())
        values[step] = model[0].weight.cpu()
    assert mgr.all_steps() == [20, 30]
    assert sorted(os.listdir(tmp_path)) == ["20", "30"]
    assert mgr.save(10, model.state_dict())  # the oldest by time goes, not the lowest step
    assert mgr.all_steps() == [10, 30]
    again = CheckpointManager(str(tmp_path), save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert again.all_steps() == [10, 30]
    assert again.save(40, model.state_dict())
    assert again.all_steps() == [10, 40]
    fresh = _model(1).to(d)
    sd = fresh.state_dict()
    again.restore(max(again.all_steps()), sd)
    assert torch.equal(sd["0.weight"].cpu(), model[0].weight.cpu())
    with pytest.raises(ValueError, match="no checkpoint of step 20"):
        again.restore(20, sd)


def test_async_save_does_not_wait_for_the_write_and_commits_at_the_end(tmp_path, monkeypatch):
    import threading

    d = xm.xla_device()
    model = _model(0).to(d)
    mgr = CheckpointManager(str(tmp_path), save_interval=5, chkpt_on_preemption=False)
    gate, entered = threading.Event(), threading.Event()
    real = CheckedFileSystemWriter.write_data

    def slow(self, plan, planner):
        entered.set()
        gate.wait(30)
        return real(self, plan, planner)

    monkeypatch.setattr(CheckedFileSystemWriter, "write_data", slow)
    t0 = time.perf_counter()
    assert mgr.save_async(5, model.state_dict())
    assert time.perf_counter() - t0 < 10
    assert entered.wait(30)
    assert mgr.all_steps() == [] and os.listdir(tmp_path) == [".5.tmp"]  # written aside, not committed
    before = model[0].weight.cpu()
    with torch.no_grad():
        model[0].weight.mul_(2)  # training goes on
    xm.mark_step()
    gate.set()
    mgr.join()
    assert mgr.all_steps() == [5] and os.listdir(tmp_path) == ["5"]
    sd = _model(1).to(d).state_dict()
    mgr.restore(5, sd)
    assert torch.equal(sd["0.weight"].cpu(), before)


def test_a_failed_save_commits_nothing_and_keeps_the_previous(tmp_path, monkeypatch):
    d = xm.xla_device()
    model = _model(0).to(d)
    mgr = CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False)
    mgr.save(1, model.state_dict())

    def crash(self, metadata, results):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckedFileSystemWriter, "finish", crash)
    with pytest.raises(BaseException, match="No space left"):
        mgr.save(2, model.state_dict())
    with pytest.raises(BaseException, match="No space left"):
        mgr.save_async(3, model.state_dict())
        mgr.join()
    monkeypatch.undo()
    assert mgr.all_steps() == [1]
    assert os.listdir(tmp_path) == ["1"]  # nothing of steps 2 and 3, not even their temporaries
    os.makedirs(tmp_path / ".5.tmp")  # as a process killed in the middle of a save leaves it
    os.makedirs(tmp_path / "7")  # a directory without the manager's metadata: not a checkpoint
    again = CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False)
    assert again.all_steps() == [1]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # leftovers removed
    sd = _model(1).to(d).state_dict()
    again.restore(1, sd)
    assert torch.equal(sd["0.weight"].cpu(), model[0].weight.cpu())


def _killed_child(path: str) -> None:
    """Saves step 1, then is killed (SIGKILL) in the middle of writing step 2."""
    mgr = CheckpointManager(path, save_interval=1, chkpt_on_preemption=False)
    mgr.save(1, _model(0).to(xm.xla_device()).state_dict())
    real = CheckedFileSystemWriter.finish

    def die(self, metadata, results):  # the shard files are written; .metadata is not
        sys.stdout.write("writing\n")
        sys.stdout.flush()
        time.sleep(60)
        real(self, metadata, results)

    CheckedFileSystemWriter.finish = die
    mgr.save_async(2, _model(1).to(xm.xla_device()).state_dict())
    mgr.join()


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    script = f"import test_distributed_checkpoint as t; t._killed_child({str(tmp_path)!r})"
    p = warm.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert p.stdout.readline().strip() == "writing"
        assert any(f.endswith(".distcp") for f in os.listdir(tmp_path / ".2.tmp"))
    finally:
        p.kill()
        p.wait()
    mgr = CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False)
    assert mgr.all_steps() == [1] and os.listdir(tmp_path) == ["1"]
    sd = _model(5).to(xm.xla_device()).state_dict()
    mgr.restore(1, sd)
    assert torch.equal(sd["0.weight"].cpu(), _model(0)[0].weight)


def _damage(path, how):
    files = sorted(os.listdir(path))
    shard = os.path.join(path, next(f for f in files if f.endswith(".distcp")))
    if how == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 100)
    elif how == "missing":
        os.remove(shard)
    elif how == "flipped":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    elif how == "bad_metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(b"not a pickle")
    elif how == "no_metadata":
        os.remove(os.path.join(path, ".metadata"))
    return shard


@pytest.mark.parametrize("how", ["truncated", "missing", "flipped", "bad_metadata", "no_metadata"])
def test_damaged_checkpoint_raises_naming_the_file(tmp_path, how):
    d = xm.xla_device()
    mgr = CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False)
    mgr.save(1, _model(0).to(d).state_dict())
    shard = _damage(str(tmp_path / "1"), how)
    target = _model(1).to(d)
    with pytest.raises(CheckpointCorruptError) as e:
        mgr.restore(1, target.state_dict())
    name = ".metadata" if how.endswith("metadata") else os.path.basename(shard)
    assert name in str(e.value)
    if how in ("truncated", "missing", "flipped"):
        assert "'0.weight'" in str(e.value) or "'2.weight'" in str(e.value) or "bias'" in str(e.value)
    # PyTorch's own reader, with the planner: an error naming the file too (except bad metadata).
    if how in ("truncated", "missing"):
        with pytest.raises(BaseException, match=os.path.basename(shard)):
            _load(target.state_dict(), tmp_path / "1")


def test_checked_reader_loads_plain_checkpoints(tmp_path):
    d = xm.xla_device()
    src = _model(0).to(d)
    _save(src.state_dict(), tmp_path / "plain")  # PyTorch's writer: no checksums
    sd = _model(1).to(d).state_dict()
    _load(sd, tmp_path / "plain", reader=CheckedFileSystemReader)
    assert torch.equal(sd["2.weight"].cpu(), src[2].weight.cpu())


def test_sigterm_is_a_preemption_notice(tmp_path):
    from xlatorch.runtime.base import preemption

    mgr = CheckpointManager(str(tmp_path), save_interval=100)
    try:
        assert not mgr.should_save(3)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while not mgr.should_save(4):
            assert time.time() < deadline
            time.sleep(0.01)
        assert not mgr.should_save(5)  # one checkpoint per notice
    finally:
        preemption.deactivate()


def test_prime_optimizer_makes_state_to_load_into(tmp_path):
    d = xm.xla_device()
    model = _model(0).to(d)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16, device=d)).sum().backward()
    opt.step()
    xm.mark_step()
    _save({"optim": opt.state_dict()}, tmp_path / "o")
    fresh = torch.optim.AdamW(_model(1).to(d).parameters())
    assert fresh.state_dict()["state"] == {}
    prime_optimizer(fresh)
    sd = {"optim": fresh.state_dict()}
    _load(sd, tmp_path / "o")
    fresh.load_state_dict(sd["optim"])
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(fresh.state_dict()["state"][i][k].cpu(), v.cpu()), (i, k)


def test_package_exports_torch_xla_names():
    assert {"CheckpointManager", "SPMDSavePlanner", "SPMDLoadPlanner", "prime_optimizer"} <= set(xc.__all__)
