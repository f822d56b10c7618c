"""FSDP across processes (``xlatorch.distributed.fsdp``): two real processes, each on half the
batch, against one CPU process on the whole batch; checkpoints consolidated; bytes per process.

Workers live in tests/mp_fsdp_workers.py. The one-process checks at the end run in this process
(a world of one replica: the collectives are identities, the wrapping logic is the same).
"""

import copy
import functools
import gc
import math
import os
import sys
import weakref

import mp_fsdp_workers as W
import pytest
import torch
import torch.nn as nn

import xlatorch.core.xla_model as xm
import xlatorch.distributed.xla_multiprocessing as xmp
from tests import warm
from xlatorch.distributed.fsdp import (
    FullyShardedDataParallel,
    XlaFullyShardedDataParallel,
    checkpoint_module,
    consolidate_sharded_model_checkpoints,
    consolidate_sharded_state_dicts,
)
from xlatorch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

FSDP = XlaFullyShardedDataParallel
N = 2
STEPS, PER = 4, 3
EPS32 = torch.finfo(torch.float32).eps


def _reference(dtype):
    """One process, the whole batch, plain PyTorch on CPU in ``dtype``: (losses, state dict)."""
    torch.manual_seed(0)
    model = W.Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = W.data(STEPS, PER, N)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xs[s].to(dtype)), ys[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), {k: v.double() for k, v in model.state_dict().items()}


def _tolerance(x32, x64):
    """How far two float32 computations of the same math in different reduction orders may be
    apart: each is off the exact (float64) result by about what this float32 run is off it,
    ``|x32 - x64|`` (rounding amplified by the training so far); 10x that for another order's
    different rounding, plus 10 ulps of the value where the float32 run happened to be exact."""
    return 10 * (x32 - x64).abs().max().item() + 10 * EPS32 * x64.abs().max().item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    names = list(W.CONFIGS)
    xmp.spawn(W.train, args=(str(out), names, STEPS, PER), nprocs=N, start_method="forkserver")
    res = {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(N)] for name in names}
    return out, res


@pytest.mark.parametrize("name", list(W.CONFIGS))
def test_losses_and_parameters_equal_one_process_on_the_whole_batch(trained, name):
    out, res = trained
    l32, p32 = _reference(torch.float32)
    l64, p64 = _reference(torch.float64)
    tol = _tolerance(l32, l64)
    for r in range(N):
        got = torch.tensor(res[name][r]["losses"], dtype=torch.float64)
        assert (got - l64).abs().max().item() <= tol, f"rank {r}: losses {got} vs {l64} (tolerance {tol:.2e})"
    full, _ = consolidate_sharded_model_checkpoints(str(out / f"{name}_ckpt"), "_rank-*-of-*.pth", save_model=False)
    assert sorted(full) == sorted(p64)
    for k in p64:
        tol = _tolerance(p32[k], p64[k])
        err = (full[k].double() - p64[k]).abs().max().item()
        assert err <= tol, f"{name}: {k} off by {err:.2e} (tolerance {tol:.2e})"
    # each rank holds 1/N of every parameter, padded by less than one row (dim-0 sharding) or one element
    numels = [sum(res[name][r]["shard_numels"]) for r in range(N)]
    total = sum(p.numel() for p in p64.values())
    pad = sum(p[0].numel() if "dim0" in name else 1 for p in p64.values())
    assert numels[0] == numels[1] and total / N <= numels[0] <= total / N + pad


def test_collectives_per_step(trained):
    _, res = trained
    for r in res["nested_ckpt"]:
        # units: root (inp, out: 4 shards), b1, b2 (4 shards each). Forward: 12 gathers; backward: the
        # resharded b1 and b2 gather again (8), the root keeps its parameters; one reduce-scatter per shard;
        # one all_reduce for the logged loss.
        assert r["all_gather"] == STEPS * (12 + 8)
        assert r["reduce_scatter"] == STEPS * 12
        assert r["all_reduce"] == STEPS
        assert r["compiles"] <= 3
    for r in res["size_dim0_optimizer_step"]:
        assert r["all_reduce"] == STEPS  # xm.optimizer_step left the shards alone: only the logged loss


def test_checkpoint_consolidation_command_line(trained, tmp_path):
    # torch_xla's guide: python3 -m torch_xla.distributed.fsdp.consolidate_sharded_ckpts --ckpt_prefix ...
    out, _ = trained
    path = tmp_path / "full.pth"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "xlatorch.compat", "-m", "torch_xla.distributed.fsdp.consolidate_sharded_ckpts",
           "--ckpt_prefix", str(out / "root_ckpt"), "--ckpt_suffix", "_rank-*-of-*.pth",
           "--save_path", str(path)]  # fmt: skip
    p = warm.run(cmd, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    model = W.Net()
    model.load_state_dict(torch.load(path)["model"])


def _memory(out, n, kind, width, depth):
    xmp.spawn(W.memory, args=(str(out), kind, width, depth), nprocs=n, start_method="forkserver")
    return [torch.load(out / f"memory_{kind}_rank{r}.pt") for r in range(n)]


def test_parameter_and_optimizer_bytes_fall_as_one_over_n(tmp_path):
    width, depth = 64, 4
    rep = _memory(tmp_path, N, "replicated", width, depth)
    fsdp = _memory(tmp_path, N, "fsdp", width, depth)
    sizes = [width * width, width] * depth  # weight and bias of each layer: one shard each
    steps = len(sizes) * 4  # Adam's step count: a float32 scalar per parameter
    for r, f in zip(rep, fsdp):
        assert r["params"] == sum(sizes) * 4
        assert f["params"] == sum(math.ceil(k / N) for k in sizes) * 4 <= r["params"] / N + len(sizes) * 4
        # Adam: exp_avg and exp_avg_sq the size of the parameters
        assert r["optimizer"] == 2 * r["params"] + steps and f["optimizer"] == 2 * f["params"] + steps
        # on the device: parameters, gradients, Adam's moments, the batch and a few scalars (and at times
        # one more parameter-sized set: the step before's, not yet released); FSDP's gathered parameters
        # are gone after the step
        for got in (r, f):
            assert 4 * got["params"] <= got["device"] <= 5 * got["params"] + 8192
        print(f"bytes per process, N={N}: replicated {r}, FSDP {f}")


# ---- one process (a world of one replica) --------------------------------------------------


def test_names_and_aliases():
    assert FullyShardedDataParallel is FSDP
    import xlatorch.distributed.fsdp.wrap as wrap

    assert wrap.size_based_auto_wrap_policy is size_based_auto_wrap_policy


def test_auto_wrap_policies_pick_the_modules():
    m = FSDP(W.Net(), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={W.Block}))
    assert isinstance(m.module.b1, FSDP) and isinstance(m.module.b2, FSDP)
    assert not isinstance(m.module.inp, FSDP)
    m = FSDP(W.Net(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=200))
    assert isinstance(m.module.b1.fc, FSDP) and not isinstance(m.module.b1, FSDP)  # the block's remainder is small
    assert not isinstance(m.module.inp, FSDP)  # 135 parameters
    with pytest.raises(RuntimeError, match="already wrapped"):
        FSDP(m)
    with pytest.raises(RuntimeError, match="define forward"):
        FSDP(nn.ModuleList([nn.Linear(2, 2)]))


def _one_process_model(**kw):
    torch.manual_seed(0)
    ref = W.Net()
    return ref, W._nested(copy.deepcopy(ref), **kw)


def test_parameters_are_shards_outside_forward_and_backward():
    ref, m = _one_process_model()
    assert all(getattr(p, "_is_sharded", False) for p in m.parameters())
    assert m.module.b1.module.fc.weight.numel() == 0  # freed: a placeholder
    x = torch.randn(5, 8).to(xm.xla_device())
    m(x).sum().backward()
    assert m.module.b1.module.fc.weight.numel() == 0 and m.module.inp.weight.numel() == 0
    assert {n for n, _ in m.get_original_names_and_sharded_parameters()} == set(dict(ref.named_parameters()))


def test_no_sync_accumulates_then_reduces_once():
    ref, m = _one_process_model()
    d = xm.xla_device()
    xs = torch.randn(2, 4, 8)
    with m.no_sync():
        m(xs[0].to(d)).sum().backward()
    assert all(p.grad is None for p in m.parameters())
    m(xs[1].to(d)).sum().backward()
    (ref(xs[0]).sum() + ref(xs[1]).sum()).backward()
    shards = {n: p.grad.cpu() for n, p in m.get_original_names_and_sharded_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(shards[n][: p.numel()].reshape(p.shape), p.grad, rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_matches_torch():
    ref, m = _one_process_model()
    x = torch.randn(4, 8)
    m(x.to(xm.xla_device())).sum().backward()
    ref(x).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = m.clip_grad_norm_(0.5)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    shards = {n: p.grad.cpu() for n, p in m.get_original_names_and_sharded_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(shards[n][: p.numel()].reshape(p.shape), p.grad, rtol=1e-5, atol=1e-6)


def test_flattened_state_dict_round_trip_and_bf16_compute():
    torch.manual_seed(0)
    ref = W.Net()
    m = FSDP(copy.deepcopy(ref), flatten_parameters=True, compute_dtype=torch.bfloat16)
    assert len(list(m.parameters())) == 1
    full = consolidate_sharded_state_dicts([{k: v.cpu() for k, v in m.state_dict().items()}], m.get_shard_metadata())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v)
    out = m(torch.randn(3, 8).to(xm.xla_device()))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    grad = next(m.parameters()).grad
    assert grad.dtype == torch.float32 and torch.isfinite(grad.cpu()).all()  # LayerNorm's bf16 backward


def test_checkpoint_module_recomputes_in_the_backward():
    torch.manual_seed(0)
    ref = W.Block()
    m = checkpoint_module(copy.deepcopy(ref).to(xm.xla_device()))
    x = torch.randn(3, W.WIDTH, requires_grad=True)
    xd = x.detach().to(xm.xla_device()).requires_grad_()
    calls = []
    m.fc.register_forward_hook(lambda *a: calls.append(1))
    m(xd).sum().backward()
    assert len(calls) == 2  # forward, then again in the backward
    ref(x).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.fc.weight.grad.cpu(), ref.fc.weight.grad, rtol=1e-5, atol=1e-6)


def test_resharded_units_drop_their_gathered_parameters_after_forward():
    _, m = _one_process_model()
    seen = {}
    for name, mod in [("b2.fc", m.module.b2.module.fc), ("b2.ln", m.module.b2.module.ln), ("out", m.module.out)]:
        mod.register_forward_pre_hook(lambda mod, args, name=name: seen.update({name: weakref.ref(mod.weight)}))
    out = m(torch.randn(4, 8).to(xm.xla_device()))
    gc.collect()
    assert seen["b2.fc"]() is None and seen["b2.ln"]() is None  # autograd keeps keys, not the tensors
    assert seen["out"]() is not None  # the root keeps its parameters for the backward
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_autocast_runs_the_unpatched_linear():
    torch.manual_seed(0)
    m = FSDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = m(torch.randn(4, 8).to(xm.xla_device()))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())
