"""torch.optim's multi-tensor (foreach) paths on the device, against CPU eager."""

import copy
import re

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=1e-2)),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.Adamax, dict(lr=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-2)),
    (torch.optim.RAdam, dict(lr=1e-2)),
    (torch.optim.Adadelta, dict()),
    (torch.optim.ASGD, dict(lr=1e-2)),
]


@pytest.mark.parametrize("cls, kw", OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_foreach_optimizer_matches_cpu(cls, kw):
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    dev = copy.deepcopy(cpu).to("xla")
    opts = [cls(m.parameters(), foreach=True, **kw) for m in (cpu, dev)]
    data = [torch.randn(5, 4) for _ in range(3)]
    xm.mark_step()
    met.clear_all()
    for x in data:
        for m, opt, dx in ((cpu, opts[0], x), (dev, opts[1], x.to("xla"))):
            opt.zero_grad()
            m(dx).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
            opt.step()
        xm.mark_step()
    for p, q in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), rtol=1e-5, atol=1e-5)
    assert met.executed_fallback_ops() == []


@pytest.mark.parametrize("op", ["addcdiv", "addcmul"])
def test_foreach_scalars_in_a_cpu_tensor_are_read_on_the_host(op):
    """The ``.Tensor`` overloads take ``scalars`` as a 1-d CPU tensor, as PyTorch's kernels
    require (Adam passes one when Dynamo traces it). Its values are traced scalars: new values
    compile no new graph."""
    g = torch.Generator().manual_seed(0)
    xs, t1 = ([torch.randn(3, 2, generator=g) for _ in range(2)] for _ in range(2))
    t2 = [torch.rand(3, 2, generator=g) + 0.5 for _ in range(2)]
    dev, d1, d2 = ([t.to("xla") for t in ts] for ts in (xs, t1, t2))
    fn, fn_ = getattr(torch, f"_foreach_{op}"), getattr(torch, f"_foreach_{op}_")
    xm.mark_step()
    met.clear_all()
    compiles = []
    steps = [torch.tensor([0.5, -2.0]), torch.tensor([3.0, 0.25]), torch.tensor([-1.5, 2.0], dtype=torch.float64)]
    for scalars in steps:
        want = fn(xs, t1, t2, scalars)
        got = fn(dev, d1, d2, scalars)
        fn_(xs, t1, t2, scalars)
        fn_(dev, d1, d2, scalars)
        xm.mark_step()
        compiles.append(met.counter_value("UncachedCompile"))
        for a, b in zip([*got, *dev], [*want, *xs]):  # one elementwise op a step: its rounding only
            torch.testing.assert_close(a.cpu(), b)
    assert compiles[0] == compiles[1] < compiles[2], compiles  # the values are not in the graph's key, the dtype is
    assert not [k for k in met.counter_names() if k.startswith("aten::")]  # no CPU fallback
    # What PyTorch rejects, it rejects here with its own words.
    for bad in (torch.ones(2, 1), torch.ones(3)):
        with pytest.raises(RuntimeError) as cpu_error:
            fn(xs, t1, t2, bad)
        with pytest.raises(RuntimeError, match=re.escape(str(cpu_error.value))):
            fn(dev, d1, d2, bad)
    with pytest.raises(RuntimeError, match="Expected scalars to be on CPU, got xla:0 instead"):
        fn(dev, d1, d2, torch.ones(2).to("xla"))
