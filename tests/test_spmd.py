"""SPMD (``xr.use_spmd()``, ``xlatorch.distributed.spmd``): one program over 8 CPU devices.

JAX fixes the device count when its backend starts, and this test process has started it
with one device: the programs (tests/spmd_programs.py) run in a child process with
``CPU_NUM_DEVICES=8`` (one run shared by the tests here), or in 2 processes x 4 devices
through ``xmp.spawn``. References are CPU eager PyTorch, computed here.
"""

import os
import sys

import numpy as np
import pytest
import spmd_programs as prog
import torch

import xlatorch.core.xla_model as xm
import xlatorch.distributed.spmd as xs
import xlatorch.distributed.xla_multiprocessing as xmp
from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


@pytest.fixture(scope="module")
def spmd(tmp_path_factory):
    return prog.run_in_child("spmd_programs", tmp_path_factory.mktemp("spmd"), "spmd.pt")


def _reference_mlp():
    model = prog.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for x, y in prog.batches():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def test_put_onto_a_replicated_sharding_gives_what_jax_device_put_gives(spmd):
    # An SPMD program's packed scalars go to every device through topology.put's fast call
    # (jax.device_put without its Python wrapping): same sharding, every copy bit for bit.
    got = dict(spmd["put"])
    assert got.pop("fast") is True
    assert got and all(v == (True, True) for v in got.values()), got


def test_random_numbers_from_a_seed_are_the_same_whatever_the_sharding(spmd):
    # lowering/rng.py: the bits come from XLA's RngBitGenerator, which generates the whole
    # tensor and gives each device its part (a per-device draw would repeat or shift them).
    got = spmd["random"]
    lone = got.pop("none")
    assert 0.3 < (lone[0] == 0).float().mean() < 0.7  # dropout at p=0.5 did drop about half
    for name, drawn in got.items():
        for want, have in zip(lone, drawn):
            assert torch.equal(want, have), name


def test_one_virtual_device_spans_every_device(spmd):
    assert spmd["devices"] == 8
    assert spmd["xla_devices"] == ["xla:0"]
    assert spmd["world_size"] == 1  # one program, one replica


@pytest.mark.parametrize("mesh", list(prog.MESHES))
def test_sharded_training_equals_unsharded(spmd, mesh):
    got = spmd["mlp"][mesh]
    losses, params = _reference_mlp()
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    for p, want in zip(got["params"], params):
        torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-5)
    c = got["compiles"]
    assert c[-1] == c[1], f"compiles after warm-up: {c}"  # step 1 creates Adam's state; then flat
    # The packed scalar groups go to the devices at an executable's first run; after it only
    # the groups that changed (Adam's bias corrections), not every group at every step.
    sent = got["sent"]
    assert sent[1] > 0 and all(0 < k < sent[1] for k in sent[2:]), sent
    assert got["w0_spec"] not in ("", "{replicated}")
    # Adam's state, created from the gradients of a sharded weight, is sharded as the weight.
    assert got["exp_avg_spec"] == got["w0_spec"] == got["exp_avg_sq_spec"]


def test_fsdp_wrapper_trains_a_transformer_as_one_device(spmd):
    got = spmd["fsdp"]
    ref = prog.TinyTransformer()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in prog.tokens():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-4, atol=1e-5)
    assert got["compiles"][-1] == got["compiles"][1]
    assert got["fallbacks"] == []
    # Every parameter is split over the 8 devices along its first dimension (all divide by 8 here).
    assert got["specs"]["layer.self_attn.in_proj_weight"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert got["specs"]["head.bias"] == "{devices=[8]0,1,2,3,4,5,6,7}"
    assert got["momentum_specs"] == got["specs"]


def test_local_shards(spmd):
    misc = spmd["misc"]
    w = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    assert misc["w_spec"] == "{devices=[4,2]0,1,2,3,4,5,6,7}"  # torch_xla lists the devices
    assert len(misc["shards"]) == 8
    for data, idx, replica in misc["shards"]:
        assert data.shape == (4, 4) and replica == 0
        torch.testing.assert_close(data, w[tuple(idx)])
    assert {tuple((s.start, s.stop) for s in idx) for _, idx, _ in misc["shards"]} == {
        ((r, r + 4), (c, c + 4)) for r in range(0, 16, 4) for c in (0, 4)
    }
    # torch_xla's debug text of a sharded tensor (its tests read these lines).
    for line in ("ShardingSpec: {devices=[4,2]0,1,2,3,4,5,6,7}", "XLAShardedData", "Data Device: SPMD:0",
                 "OpSharding: {devices=[4,2]", "NumShards: 8"):  # fmt: skip
        assert line in misc["debug_info"], misc["debug_info"]
    # A vector split over "model" only: each half held by the 4 devices of a "data" row, replicas 0..3.
    row = misc["row_shards"]
    assert sorted((idx[0].start, rep) for _, idx, rep in row) == [(s, r) for s in (0, 4) for r in range(4)]
    for data, idx, _ in row:
        torch.testing.assert_close(data, torch.arange(8.0)[tuple(idx)])


def test_a_dimension_the_mesh_does_not_divide_is_padded_as_torch_xla_pads_it(spmd):
    res = spmd["uneven"]
    assert res["env"] == "1"  # use_spmd() leaves XLA_USE_SPMD set, as torch_xla's does
    w = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    assert res["spec"] == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    torch.testing.assert_close(res["value"], (w * 2 + 1).sum(0))
    # Blocks of ceil(10/4) = 3 rows and ceil(3/2) = 2 columns; the last ones padded with zeros.
    assert len(res["shards"]) == 8
    bounds = set()
    for data, idx, device, replica, unpadded in res["shards"]:
        assert data.shape == (3, 2) and replica == 0 and device.startswith("CPU:")
        torch.testing.assert_close(unpadded, w[tuple(idx)])
        assert data.sum() == w[tuple(idx)].sum()  # the padding is zeros
        bounds.add(tuple((s.start, s.stop) for s in idx))
    assert bounds == {(r, c) for r in ((0, 3), (3, 6), (6, 9), (9, 10)) for c in ((0, 2), (2, 3))}
    # Training with a weight of 10 rows over 8 devices equals CPU.
    model = torch.nn.Linear(3, 10)
    torch.manual_seed(0)
    model.reset_parameters()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, _ in prog.batches(3, n=6):
        opt.zero_grad()
        loss = model(x[:, :3]).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(res["losses"], losses, rtol=1e-5)
    for got, want in zip(res["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert res["weight_spec"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert res["uneven"] >= 2


def test_xla_use_spmd_in_the_environment_runs_spmd_from_the_first_use():
    code = (
        "import torch, xlatorch.core.xla_model as xm, xlatorch.runtime as xr\n"
        "print(xr.is_spmd(), xr.global_runtime_device_count(), xm.xla_device(),\n"
        "      (torch.ones(3).to('xla') * 2).sum().item())"
    )
    env = dict(os.environ, XLA_USE_SPMD="1", CPU_NUM_DEVICES="4", PYTHONPATH=ROOT)
    r = warm.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "4", "xla:0", "6.0"]


def test_constraint_on_an_intermediate_value_and_dumps(spmd):
    misc = spmd["misc"]
    x, w = misc["ref_inputs"]
    torch.testing.assert_close(misc["z"], torch.relu(x @ w) * 2, rtol=1e-5, atol=1e-4)  # |z| ~ 1e3
    assert misc["z_spec"] == "P(None, 'model')"  # the partitioner carried the constraint on y to z
    assert "xla::sharding_constraint" in misc["ir"]
    assert "device_data : f32[16,8] {sharding={devices=[4,2]0,1,2,3,4,5,6,7}}" in misc["ir"]
    assert "device_data : f32[8,16] {sharding={replicated}}" in misc["ir"]
    assert '{sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {"model"}]>}' in misc["hlo"]
    assert "sdy.sharding_constraint %" in misc["hlo"] and '<@mesh, [{}, {"model"}]>' in misc["hlo"]


def test_input_shardings_are_part_of_the_graph_key(spmd):
    same, other = spmd["misc"]["recompiles"]
    assert (same, other) == (0, 1)
    assert spmd["misc"]["cleared_spec"] == ""  # no annotation, as torch_xla reports it


def test_loader_input_sharding(spmd):
    loaded = spmd["misc"]["loaded"]
    x, y = prog.batches(1)[0]
    assert len(loaded) == 2  # every batch in this one process: SPMD does not split batches by process
    for i, (xspec, yspec, bx, by) in enumerate(loaded):
        assert (xspec, yspec) == ("{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}", "")
        torch.testing.assert_close(bx, x[8 * i : 8 * i + 8])
        torch.testing.assert_close(by, y[8 * i : 8 * i + 8])


def test_checkpoints_gather_the_shards(spmd):
    misc = spmd["misc"]
    w = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    for loaded in (misc["loaded_xm"], misc["loaded_xser"]):
        torch.testing.assert_close(loaded["w"], w)
        torch.testing.assert_close(loaded["row"], torch.arange(8.0))


def test_two_processes_of_four_devices(tmp_path):
    os.environ["CPU_NUM_DEVICES"] = "4"  # devices per process under SPMD
    try:
        xmp.spawn(prog.multiprocess_worker, args=(str(tmp_path),), nprocs=2, start_method="forkserver")
    finally:
        del os.environ["CPU_NUM_DEVICES"]
    assert_two_processes_of_four_devices(tmp_path)


def assert_two_processes_of_four_devices(tmp_path):
    """What spmd_programs.multiprocess_worker wrote from 2 processes x 4 devices, against CPU."""
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    losses, params = _reference_mlp()
    for r, got in enumerate(res):
        assert got["devices"] == (8, 4, r)
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
        for p, want in zip(got["params"], params):
            torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-5)
        assert got["compiles"][-1] == got["compiles"][1]
    # Each process holds the shards of its own 4 devices: together, each block of the (4, 2) mesh once.
    blocks = [tuple((s.start, s.stop) for s in idx) for got in res for idx in got["shard_indices"]]
    assert sorted(blocks) == sorted(((r, r + 4), (c, c + 4)) for r in range(0, 16, 4) for c in (0, 4))
    saved = torch.load(tmp_path / "mp.pt")  # written by process 0 from shards gathered from both
    torch.testing.assert_close(saved["w"], torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8))


def test_hybrid_and_1d_meshes_and_the_sharded_tensor_wrapper(spmd):
    misc = spmd["misc"]
    assert misc["hybrid"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # one process: the ICI mesh in device order
    total = float(torch.arange(16.0).sum())
    assert misc["wrapped"] == (2 * total + 16, total + 16, "{devices=[8,1]0,1,2,3,4,5,6,7}", torch.Size([8, 2]))


def test_annotations_need_spmd():
    t = torch.zeros(4, device=xm.xla_device())
    mesh = xs.Mesh(np.arange(1), (1,), ("data",))
    with pytest.raises(RuntimeError, match="use_spmd"):
        xs.mark_sharding(t, mesh, ("data",))
