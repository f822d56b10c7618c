"""The host's shortcuts on the per-op and per-sync paths behave as the general paths they skip:
fused shims (trace/dispatch._fuse), the pack layout kept per leaf signatures (plan/collect.pack),
the newest cache hit (execute/sync._cached), ExecuteTime of an execution over at its commit."""

from __future__ import annotations

import numpy as np
import torch
from xlatorch._generated import dispatch as generated

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch.runtime.ir.values import Data, Scalar
from xlatorch.runtime.lower import cache
from xlatorch.runtime.plan.collect import pack
from xlatorch.runtime.trace import dispatch
from xlatorch.runtime.trace.tensor import pending_storages

aten = torch.ops.aten


def _count(name: str) -> int:
    return met.counter_value(name) or 0


def test_fused_shim_computes_and_counts_as_the_generated_one():
    dev = xm.xla_device()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    xa, xb = a.to(dev), b.to(dev)
    torch.addcmul(xa, xb, xb, value=0.5)  # the first call fuses the shim
    fused = dispatch.SHIMS[aten.addcmul.default]
    assert fused.__wrapped__ is generated.addcmul
    made, ops = _count("CreateXlaTensor"), _count("xla::addcmul")
    got = fused(xa, xb, xb, value=0.5)
    ref = generated.addcmul(xa, xb, xb, value=0.5)
    assert _count("CreateXlaTensor") == made + 2 and _count("xla::addcmul") == ops + 2
    torch.testing.assert_close(got.cpu(), ref.cpu())
    torch.testing.assert_close(got.cpu(), torch.addcmul(a, b, b, value=0.5))


def test_fused_shim_takes_defaults_and_new_signatures():
    dev = xm.xla_device()
    x = torch.randn(2, 3)
    y = (x.to(dev) + 1).sum(1)  # add.Tensor's alpha from the shim's defaults
    z = torch.ones(2, 3, dtype=torch.float64).to(dev) + 2  # a signature not seen yet: through _node
    torch.testing.assert_close(y.cpu(), (x + 1).sum(1))
    torch.testing.assert_close(z.cpu(), torch.full((2, 3), 3.0, dtype=torch.float64))
    assert hasattr(dispatch.SHIMS[aten.add.Tensor], "__wrapped__")


def test_pack_layout_reuse_packs_the_new_values():
    d = Data(np.zeros(2, np.float32), ((2,), torch.float32))
    first = [d, Scalar(1.5, torch.float64), Scalar(2, torch.int64), Scalar(3.5, torch.float64)]
    second = [d, Scalar(-1.0, torch.float64), Scalar(7, torch.int64), Scalar(0.25, torch.float64)]
    p1, k1 = pack(first)
    p2, k2 = pack(second)
    assert k1 == k2 and k1[0] == ("d", 0)
    assert [a.tolist() for a in p1] == [[1.5, 3.5], [2]] and [a.tolist() for a in p2] == [[-1.0, 0.25], [7]]


def test_a_runs_scalars_go_to_the_device_only_when_their_group_changed(monkeypatch):
    # A group of packed scalars whose bytes did not change since the executable's last run is
    # not transferred again (its device copy is reused); a changed one is, and computes with
    # the new values (as CPU does, value by value).
    from xlatorch.runtime.base import topology

    dev = xm.xla_device()
    x = torch.randn(5)
    xd = x.to(dev)
    xm.mark_step()
    puts = []
    real = topology.put  # the upload of one host array

    def counting(v, *args, **kwargs):
        puts.append(1)
        return real(v, *args, **kwargs)

    monkeypatch.setattr(topology, "put", counting)

    def step(scale, shift):
        y = xd * scale + shift  # a float64 group (scale, alpha) and an int64 one (shift)
        xm.mark_step()
        return y.cpu()

    cases = [(1.5, 2), (1.5, 2), (1.5, 3), (-0.25, 3), (-0.25, 3), (1.5, 2)]
    sent = []
    for scale, shift in cases:
        before = sum(puts)
        got = step(scale, shift)
        sent.append(sum(puts) - before)
        torch.testing.assert_close(got, x * scale + shift, msg=str((scale, shift)))  # XLA may fuse into an FMA
    assert sent[1] == sent[4] == 0 and sent[2] == sent[3] == 1 and sent[5] == 2, sent


def test_equal_scalars_checked_at_each_run_and_skipped_when_unchanged():
    # A graph compiled while two scalars were equal reads them once; a run whose scalars are
    # no longer equal there compiles the general program (once), and a run whose packed bytes
    # are those of the last run skips the check: every value as CPU computes it.
    dev = xm.xla_device()
    x = torch.randn(6)
    xd = x.to(dev)
    xm.mark_step()
    unshared = _count("UnsharedScalarRecompile")
    for a, b in [(2.0, 2.0), (2.0, 2.0), (2.0, 3.0), (2.0, 3.0), (-1.5, -1.5), (4.0, 0.5)]:
        y = xd * a + xd * b
        xm.mark_step()
        torch.testing.assert_close(y.cpu(), x * a + x * b, msg=str((a, b)))
    assert _count("UnsharedScalarRecompile") == unshared + 1


def test_a_cleared_cache_compiles_again():
    dev = xm.xla_device()
    a = torch.ones(3, device=dev)
    xm.mark_step()

    def step():
        s = (a * 3 + 1).sum()
        assert pending_storages()
        xm.mark_step()
        assert s.item() == 12.0

    step()
    step()  # a hit: the newest one
    compiled = _count("UncachedCompile")
    step()
    assert _count("UncachedCompile") == compiled
    cache.CACHE.clear()
    step()  # not the executable that was cleared: compiled anew
    assert _count("UncachedCompile") == compiled + 1


def test_execute_time_has_one_sample_per_execution():
    dev = xm.xla_device()
    a = torch.ones(4, device=dev)
    xm.mark_step()
    met.clear_all()
    for _ in range(3):
        a = a + 1
        xm.mark_step()
    xm.wait_device_ops()
    n, total, _ = met.metric_data("ExecuteTime")
    assert n == 3 and total > 0
    assert a.cpu().tolist() == [4.0] * 4


def test_fused_view_shim_aliases_its_base():
    dev = xm.xla_device()
    x = torch.arange(6.0).reshape(2, 3)
    xx = x.to(dev)
    xx.t()  # the first call fuses the shim
    assert hasattr(dispatch.SHIMS[aten.t.default], "__wrapped__")
    v = xx.t()
    vv = v.t()  # a view of a view
    v.mul_(2)  # written through the view: the base changes
    xx.add_(1)  # and the views read the base's new value
    x.t().mul_(2)
    x.add_(1)
    torch.testing.assert_close(xx.cpu(), x)
    torch.testing.assert_close(v.cpu(), x.t())
    torch.testing.assert_close(vv.cpu(), x)


def test_put_gives_what_jax_device_put_gives_for_every_stored_dtype():
    # topology.put is jax.device_put's own last call without its Python wrapping (uploads and
    # a run's changed scalar groups go through it); any dtype the device stores comes back
    # bit for bit, and a dtype outside them falls back to jax.device_put.
    import jax
    import numpy as np

    from xlatorch.runtime.base.dtypes import TORCH_TO_JAX
    from xlatorch.runtime.base.topology import jax_device, put

    dev = jax_device(0)
    rng = np.random.default_rng(0)
    for dt in sorted({np.dtype(d) for d in TORCH_TO_JAX.values()}, key=str):
        a = (rng.standard_normal((3, 5)) * 100).astype(dt)
        got, want = put(a, dev), jax.device_put(a, dev)
        assert got.dtype == want.dtype and got.shape == want.shape, dt
        assert got.devices() == {dev}, dt
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8), err_msg=str(dt))
    from xlatorch.runtime.base import topology

    assert topology._PUT[0][0] is not None  # the pinned jax has the internal call (else every put is the slow one)
    odd = np.arange(4, dtype=np.uint64)  # not a dtype the device stores: jax.device_put decides
    np.testing.assert_array_equal(np.asarray(put(odd, dev)), np.asarray(jax.device_put(odd, dev)))


def test_a_scalar_at_its_schema_default_is_a_constant_and_any_other_value_a_parameter():
    # add's alpha=1 and addmm's beta=1 / alpha=1 never change from step to step: they enter the
    # graph as constants (no leaf to collect, pack and send; XLA drops the multiplications by
    # 1). A value given is a parameter as every scalar is: new values compile nothing, and a
    # loop that also uses the default compiles one more graph, not one per value.
    from xlatorch.runtime.ir.values import Scalar
    from xlatorch.runtime.plan.collect import collect

    dev = xm.xla_device()
    a, b, w, bias = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    i, j = torch.randint(-50, 50, (4, 3), dtype=torch.int32), torch.randint(-50, 50, (4, 3), dtype=torch.int32)
    ad, bd, wd, biasd, id_, jd = (t.to(dev) for t in (a, b, w, bias, i, j))
    xm.mark_step()

    def program(a, b, w, bias, i, j, alpha=None, beta=None):
        kw = {} if alpha is None else {"alpha": alpha}
        mm = {} if alpha is None else {"alpha": alpha, "beta": beta}
        return [torch.add(a, b, **kw), torch.sub(a, b, **kw), torch.addmm(bias, a, w, **mm), torch.add(i, j, **kw)]

    def scalars(outs) -> int:
        return sum(type(v) is Scalar for v in collect([o._st.value for o in outs]).leaves)

    outs = program(ad, bd, wd, biasd, id_, jd)
    assert scalars(outs) == 0
    xm.mark_step()  # one graph, as in the loop below (a read of the first add alone runs on the host)
    for got, want in zip(outs, program(a, b, w, bias, i, j)):
        torch.testing.assert_close(got.cpu(), want)
    before = _count("UncachedCompile")
    for alpha, beta in [(2, 0.5), (3, 0.25), (None, None), (-1, 2.0), (None, None)]:
        outs = program(ad, bd, wd, biasd, id_, jd, alpha, beta)
        assert scalars(outs) == (0 if alpha is None else 5), (alpha, beta)
        xm.mark_step()
        for got, want in zip(outs, program(a, b, w, bias, i, j, alpha, beta)):
            torch.testing.assert_close(got.cpu(), want, msg=str((alpha, beta)))
    assert _count("UncachedCompile") - before == 1  # the graph with parameters, once


def test_a_fused_shim_makes_the_node_output_and_storage_their_constructors_make():
    # The fused shims make a cached signature's Node, its Out and the result's Storage inline,
    # without their __init__ (trace/dispatch._fuse): every slot those set must be set alike, so a
    # field added to one constructor and not to the fused code fails here, not in a later sync.
    from xlatorch.runtime.ir.values import Node, Out
    from xlatorch.runtime.trace.tensor import PENDING, Storage

    dev = xm.xla_device()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    xa, xb = a.to(dev), b.to(dev)
    xm.mark_step()
    xa + xb  # the first call fuses the shim and caches the signature
    fused = dispatch.SHIMS[aten.add.Tensor]
    assert fused.__wrapped__ is generated.add_Tensor
    got, ref = fused(xa, xb), generated.add_Tensor(xa, xb)  # inline / through Node() and Storage()
    (gn, go, gs), (rn, ro, rs) = [(t._st.value.node, t._st.value, t._st) for t in (got, ref)]
    assert go is not ro and gs is not rs and gs.sid in PENDING and PENDING[gs.sid]() is gs
    for cls, g, r, skip in ((Node, gn, rn, ("args", "outs")), (Out, go, ro, ("node",)),
                            (Storage, gs, rs, ("refs", "gen", "sid", "value", "__weakref__"))):  # fmt: skip
        for slot in cls.__slots__:
            assert hasattr(g, slot) == hasattr(r, slot), (cls.__name__, slot)
            if slot not in skip and hasattr(r, slot):
                assert getattr(g, slot) == getattr(r, slot), (cls.__name__, slot)
    assert gn.outs == (go,) and go.node is gn and gs.value is go and gs.gen == gs.sid
    assert [w() for w in gs.refs] == [got]
    assert gn.args[:2] == rn.args[:2] and gn.key is rn.key
    torch.testing.assert_close(got.cpu(), a + b)
    torch.testing.assert_close(ref.cpu(), a + b)
