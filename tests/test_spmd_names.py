"""torch_xla.distributed.spmd's names beyond mark_sharding: annotate_custom_sharding, shard_as,
wrap_if_sharded, XLAPatchedLinear, xla_distribute_tensor / module, auto_policy. The SPMD parts
run in one child process with 8 CPU devices (tests/spmd_name_programs.py); references are CPU
eager PyTorch."""

import pytest
import spmd_name_programs as prog
import torch


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    import spmd_programs

    return spmd_programs.run_in_child("spmd_name_programs", tmp_path_factory.mktemp("spmd_names"), "spmd_names.pt")


ROWS, COLS = "{devices=[8,1]0,1,2,3,4,5,6,7}", "{devices=[1,8]0,1,2,3,4,5,6,7}"


def test_annotate_custom_sharding_constrains_the_graph_not_the_storage(res):
    c = prog.data()["c"]
    assert res["custom_constraints"] == 1 and res["custom_is_same_tensor"]
    spec_a, spec_y, a, y = res["custom"]
    assert spec_a == ROWS  # mark_sharding's sharding stays the tensor's
    assert spec_y == COLS  # the custom sharding reached the partitioner
    assert torch.equal(a, c) and torch.equal(y, c * 2)
    spec_p, p = res["custom_plain"]
    assert spec_p == COLS and torch.equal(p, c)
    assert "partition spec length" in res["custom_bad"]


def test_wrap_if_sharded_wraps_only_sharded_xla_tensors(res):
    assert res["wrap"] == ["XlaTensor", "XLAShardedTensor", "int", "Tensor"]


def test_shard_as_shares_one_sharding(res):
    spec_a, spec_u, u, z, kind = res["shard_as"]
    assert spec_a == spec_u == ROWS
    assert torch.equal(u, torch.full((8, 8), 3.0)) and torch.equal(z, torch.full((8, 8), 4.0))
    assert kind == "list"  # pytrees keep their structure


def test_patched_linear_matches_f_linear_forward_and_backward(res):
    d = prog.data()
    x, w, b = (d[k].clone().requires_grad_() for k in ("x", "w", "b"))
    out = torch.nn.functional.linear(x, w, b)
    (out * out).sum().backward()
    got, gx, gw, gb, spec = res["linear"]
    torch.testing.assert_close(got, out.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-3)
    assert spec.startswith("{devices=[8,1,1]")  # the batch dimension's sharding reached the output


def test_xla_distribute_tensor_maps_placements_to_partition_specs(res):
    c = prog.data()["c"]
    expect = {"s0s1": ("{devices=[2,4]0,1,2,3,4,5,6,7}", (0, 1)), "rs0": (None, (1, None)),
              "s0s0": (ROWS, ((0, 1), None)), "none": ("{replicated}", (None, None))}  # fmt: skip
    for name, (spec, pspec) in expect.items():
        got_spec, got_pspec, value = res["distribute"][name]
        assert got_pspec == pspec, name
        if spec is not None:
            assert got_spec == spec, name
        assert torch.equal(value, c), name
    # mesh axis 1 (size 4) splits rows; mesh axis 0 (size 2) replicates
    assert res["distribute"]["rs0"][0] == "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"


def test_xla_distribute_module_partitions_and_hooks(res):
    same, seen, y, spec = res["module"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    torch.testing.assert_close(y, model(prog.data()["c"]), rtol=1e-5, atol=1e-4)
    assert same and seen == ["in", "out"]
    assert spec == "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert "auto=True" in res["auto"]
