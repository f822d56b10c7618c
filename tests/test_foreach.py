"""torch.optim's multi-tensor (foreach) paths on the device, against CPU eager."""

import copy

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
