"""The guides' training loops: xla losses match CPU eager, no fallbacks, two compiles."""

import pytest
import torch

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from examples.models import programs
from tests.tolerances import AdaptiveSteps

STEPS = 5


def _train(p, device, sync, steps=STEPS, opt_kwargs=None, record=None):
    torch.manual_seed(0)
    model = p.make_model().to(device)
    opt = p.make_opt(model.parameters())
    if opt_kwargs:
        for g in opt.param_groups:
            g.update(opt_kwargs)
    gen = torch.Generator().manual_seed(1)
    losses, compiles = [], []
    for _ in range(steps):
        x, y = p.make_batch(gen)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = p.loss_fn(model(x), y)
        loss.backward()
        if record:
            record.before(model.parameters())
        if sync == "optimizer_step_barrier":
            xm.optimizer_step(opt, barrier=True)
        else:
            opt.step()
            if sync == "mark_step":
                xm.mark_step()
            elif sync == "sync":
                xlatorch.sync()
        if record:
            record.after(model.parameters())
        losses.append(loss.item())
        compiles.append(met.counter_value("UncachedCompile") or 0)
    return losses, compiles, model


@pytest.mark.parametrize("name", ["mnist", "mlp", "gpt"])
@pytest.mark.parametrize("sync", ["mark_step", "sync", "optimizer_step_barrier"])
def test_program_matches_cpu(name, sync):
    p = programs(small=True)[name]
    # MLP and GPT train with Adam: an element's step is its gradient's rounding amplified
    # (GPT's key bias has a true gradient of zero, which softmax ignores: its steps are noise).
    steps = AdaptiveSteps(rtol=1e-4, atol=1e-5) if name != "mnist" else None
    want, _, cpu_model = _train(p, "cpu", None, record=steps)
    got, compiles, xla_model = _train(p, xm.xla_device(), sync)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if steps:
        steps.assert_close(xla_model.parameters(), cpu_model.parameters(), [n for n, _ in cpu_model.named_parameters()])
    else:
        for (n, a), b in zip(cpu_model.state_dict().items(), xla_model.state_dict().values()):
            torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=n)
    assert met.executed_fallback_ops() == []
    # First step and steady state compile; nothing after step 2.
    assert compiles[1] == compiles[-1] <= 2, compiles


def test_foreach_optimizer_path():
    p = programs(small=True)["mlp"]
    want, _, _ = _train(p, "cpu", None, opt_kwargs={"foreach": True})
    got, compiles, _ = _train(p, xm.xla_device(), "mark_step", opt_kwargs={"foreach": True})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert met.executed_fallback_ops() == [] and compiles[1] == compiles[-1] <= 2


def test_changing_learning_rate_does_not_recompile():
    p = programs(small=True)["mlp"]
    torch.manual_seed(0)
    model = p.make_model().to("xla")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(6):
        x, y = p.make_batch(gen)
        opt.zero_grad()
        p.loss_fn(model(x.to("xla")), y.to("xla")).backward()
        opt.step()
        sched.step()
        xm.mark_step()
        counts.append(met.counter_value("UncachedCompile") or 0)
    assert counts[1] == counts[-1] <= 2, counts
    assert met.counter_value("CachedCompile") >= 4
