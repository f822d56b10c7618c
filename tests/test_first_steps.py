"""The first two steps of a training loop compile one large graph, not two: optimizer state
born in step 0 from a constant is computed by a small graph of its own (runtime/plan/births.py),
so step 0's graph is step 1's. Losses and weights match CPU eager."""

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from examples.models import programs
from tests.tolerances import AdaptiveSteps, recorded_step
from xlatorch.runtime.lower import cache, compiler
from xlatorch.runtime.plan import births


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Compile counts of a first run: no executables from earlier tests."""
    monkeypatch.setattr(cache, "CACHE", {})
    births._SPLIT.clear()


def _train(p, device, make_opt, steps=4, hold=None, record=None):
    """Losses, the compiles of each step, the graphs each step ran, and the model. ``hold``:
    "zeros" or "zeros_like" makes an accumulator anew each step, kept across the sync;
    ``record``: an ``AdaptiveSteps`` that sees each step (on the CPU reference)."""
    torch.manual_seed(0)
    model = p.make_model().to(device)
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in p.make_batch(gen)) for _ in range(steps)]
    if device != "cpu":
        xm.mark_step()
    met.clear_all()
    losses, compiles, graphs, held = [], [], [], []
    for x, y in batches:
        c0 = met.counter_value("UncachedCompile") or 0
        g0 = (met.metric_data("TensorsGraphSize") or (0,))[0]
        if hold:
            b = list(model.parameters())[-1].detach()  # device data before the step's update
            acc = torch.zeros((), device=device) if hold == "zeros" else torch.zeros_like(b)
        opt.zero_grad()
        loss = p.loss_fn(model(x), y)
        loss.backward()
        recorded_step(opt, model.parameters(), record)
        if hold:
            acc += loss.detach()
            held = [acc]
        if device != "cpu":
            xm.mark_step()
        losses.append(loss.item())
        compiles.append((met.counter_value("UncachedCompile") or 0) - c0)
        graphs.append((met.metric_data("TensorsGraphSize") or (0,))[0] - g0)
    if hold:
        assert (held[0].cpu() == losses[-1]).all()
    return losses, compiles, graphs, model


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam_loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    # Its step counts live on the device: ``zeros(())``, made from a shape alone, not split off.
    "adamw_capturable": lambda ps: torch.optim.AdamW(ps, lr=1e-2, capturable=ps[0].device.type != "cpu"),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    # State made by the constructor (before the first mark_step): nothing to split.
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_step_one_reuses_step_zero_graph(opt):
    p = programs(small=True)["mlp"]
    make_opt = OPTIMIZERS[opt]
    steps = AdaptiveSteps(rtol=1e-4, atol=1e-5)  # these optimizers normalise each element's gradient
    want, _, _, cpu_model = _train(p, "cpu", lambda ps: make_opt(list(ps)), record=steps)
    got, compiles, graphs, xla_model = _train(p, xm.xla_device(), lambda ps: make_opt(list(ps)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    names = [n for n, _ in cpu_model.named_parameters()]
    steps.assert_close(xla_model.parameters(), cpu_model.parameters(), names)
    if opt == "adagrad":
        assert compiles == [1, 0, 0, 0] and graphs == [1, 1, 1, 1], (compiles, graphs)
        return
    if opt == "adamw_capturable":  # the step counts still differ: step 1 compiles (as without the split)
        assert compiles == [2, 1, 0, 0] and graphs == [2, 1, 1, 1], (compiles, graphs)
        return
    # Step 0: the state's constants (one small graph) and the step; step 1 on: cached.
    assert compiles == [2, 0, 0, 0], compiles
    assert graphs == [2, 1, 1, 1], graphs
    assert met.counter_value("BirthsHoisted") > 0
    assert met.executed_fallback_ops() == []


def test_the_state_graph_compiles_fast_and_the_step_graph_runs_fast(monkeypatch):
    """The optimizer state's graph runs once: it gets the options that compile fast
    (``runtime/lower/compiler.py``); the step's graph, run every step, XLA's defaults."""
    seen = []  # per compile: was it compiled to compile fast
    compile_ = compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda lowered, once=False: seen.append(once) or compile_(lowered, once))
    p = programs(small=True)["mlp"]
    make_opt = OPTIMIZERS["adamw"]
    want, _, _, _ = _train(p, "cpu", lambda ps: make_opt(list(ps)))
    got, compiles, _, _ = _train(p, xm.xla_device(), lambda ps: make_opt(list(ps)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert compiles == [2, 0, 0, 0] and seen == [True, False], (compiles, seen)


def test_checked_ops_and_embedding_gradients():
    """GPT: embedding and cross-entropy carry on-device checks (each step's graph gives state
    back when one fires, keyed by the state's data before the step); the embedding's
    gradient is made anew each step and is not hoisted."""
    p = programs(small=True)["gpt"]
    want, _, _, _ = _train(p, "cpu", p.make_opt)
    got, compiles, graphs, _ = _train(p, xm.xla_device(), p.make_opt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert compiles == [2, 0, 0, 0] and graphs == [2, 1, 1, 1], (compiles, graphs)


def test_same_numbers_as_without_the_split(monkeypatch):
    """Bit for bit: the split changes which graph computes the state's constants, not a value.
    (Without it, step 0 and step 1 compile a graph each.)"""
    p = programs(small=True)["gpt"]
    make_opt = OPTIMIZERS["adamw"]
    got, _, _, model = _train(p, xm.xla_device(), make_opt)
    monkeypatch.setattr(births, "ENABLED", False)
    monkeypatch.setattr(cache, "CACHE", {})
    want, compiles, _, ref = _train(p, xm.xla_device(), make_opt)
    assert compiles == [1, 1, 0, 0], compiles
    assert got == want
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("hold", ["zeros", "zeros_like"])
def test_a_birth_every_step_keeps_one_execution_per_step(hold):
    """A tensor made from a constant in every step and kept across mark_step. ``zeros(())`` (a
    shape alone) is never split off: one compile, as without births. ``zeros_like(weight)`` is
    split twice (step 1 reuses the split graph), then the step compiles whole: one graph a step."""
    p = programs(small=True)["mlp"]
    want, _, _, _ = _train(p, "cpu", _sgd, steps=5, hold=hold)
    got, compiles, graphs, _ = _train(p, xm.xla_device(), _sgd, steps=5, hold=hold)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if hold == "zeros":
        assert compiles == [1, 0, 0, 0, 0] and graphs == [1, 1, 1, 1, 1], (compiles, graphs)
    else:
        assert compiles == [2, 0, 1, 0, 0] and graphs == [2, 2, 1, 1, 1], (compiles, graphs)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def test_failed_check_in_step_zero_keeps_state_usable():
    """An out-of-range target in step 0 raises when the step's results are next needed, as
    without the split; the next steps train."""
    torch.manual_seed(0)
    dev = xm.xla_device()
    model = torch.nn.Linear(4, 3).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4)
    bad, good = torch.tensor([0, 1, 7, 1, 0]), torch.tensor([0, 1, 2, 1, 0])
    loss = torch.nn.functional.cross_entropy(model(x.to(dev)), bad.to(dev))
    loss.backward()
    opt.step()
    xm.mark_step()
    with pytest.raises(Exception, match="out of bounds|Target"):
        loss.item()
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dev)), good.to(dev))
        loss.backward()
        opt.step()
        xm.mark_step()
        assert torch.isfinite(loss.cpu())
    assert all(torch.isfinite(p.cpu()).all() for p in model.parameters())


def test_equal_scalars_share_a_parameter_until_they_differ(monkeypatch):
    """Equal host scalars are read as one parameter (XLA folds what depends on them); a step
    whose scalars stop being equal recompiles once, without sharing, and is still right."""
    from xlatorch.runtime.base.record import COUNTERS
    from xlatorch.runtime.lower import executable

    monkeypatch.setattr(executable, "SHARE_SCALARS", True)
    dev = xm.xla_device()

    def step(a, b, c):
        t = torch.zeros(4, device=dev)
        t = t + a
        t = t * b
        t = t - c
        out = t.cpu()
        assert torch.equal(out, (torch.zeros(4) + a) * b - c), (a, b, c)

    met.clear_counters()
    step(2.0, 2.0, 2.0)  # all three share a slot
    step(3.0, 3.0, 3.0)  # still equal: the same executable
    assert met.counter_value("UncachedCompile") == 1
    assert not COUNTERS.get("UnsharedScalarRecompile")
    step(1.0, 2.0, -0.0)  # no longer equal: compiled once without sharing
    step(5.0, 5.0, 0.0)
    step(2.0, 2.0, 2.0)
    assert met.counter_value("UncachedCompile") == 2  # the recompile without sharing counts as a compile
    assert COUNTERS["UnsharedScalarRecompile"] == 1
