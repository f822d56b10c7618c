"""Graphs whose shapes change from sync to sync run as stages (``runtime/plan/stages.py``): the
unchanged part compiles once, the changing part per shape or, when it is small integer
bookkeeping, on the host. Results equal CPU eager; compiles stay flat."""

from __future__ import annotations

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch.runtime.base import record
from xlatorch.runtime.execute import host
from xlatorch.runtime.lower import cache, compiler
from xlatorch.runtime.plan import stages

DEV = "xla"


def _counter(name: str) -> int:
    return met.counter_value(name) or 0


class _Decoder(torch.nn.Module):
    """A toy next-token model: enough layers for the unchanged part of a step to be split off."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(8))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(8))
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids):
        h = self.emb(ids)
        for lin, norm in zip(self.layers, self.norms):
            h = h + torch.tanh(lin(norm(h)))
        return self.head(h)


def _generate(model, ids, mask, steps, device, sync=None):
    """A generation loop in the style of Hugging Face's: the ids and the mask grow by one
    column per step, the model reads the newest token, a host read decides to go on."""
    out = []
    for _ in range(steps):
        pos = mask.sum(-1, keepdim=True) - 1  # the newest token's position
        last = ids.gather(1, pos)
        logits = model(last)[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        done = bool((nxt == 0).all())  # a read of the device each step, like a stopping criterion
        out.append(logits)
        if sync is not None:
            sync()
        if done:
            break
    return ids, torch.stack(out)


def _run(steps=12, prompt=5):
    model = _Decoder()
    ids = torch.randint(1, 50, (2, prompt), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    want_ids, want_logits = _generate(model, ids, mask, steps, "cpu")
    model.to(DEV)
    return model, ids, mask, want_ids, want_logits


def test_a_growing_loop_compiles_its_unchanged_part_once_and_matches_cpu():
    model, ids, mask, want_ids, want_logits = _run()
    staged = _counter("StagedSync")
    host = _counter("StageOnHost")
    compiles = []

    def count():
        compiles.append(_counter("UncachedCompile"))

    got_ids, got_logits = _generate(model, ids.to(DEV), mask.to(DEV), 12, DEV, sync=count)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_logits.cpu(), want_logits, rtol=1e-5, atol=1e-5)
    # Steps 0 and 1 compile whole; step 2 (the shapes changed again) compiles the unchanged
    # stages; from step 3 on, each new length compiles nothing: the changing part (the ids'
    # gather and concatenations) is integer bookkeeping, run on the host.
    steps = want_ids.shape[1] - ids.shape[1]
    assert steps >= 6 and len(compiles) == steps
    assert compiles[-1] == compiles[2], compiles
    assert _counter("StagedSync") - staged == steps - 1  # every step after the first
    assert _counter("StageOnHost") - host >= steps - 1


def test_what_the_host_stages_compute_stays_on_the_host_until_a_graph_reads_it():
    model, ids, mask, want_ids, want_logits = _run()
    uploads, downloads = [], []

    def count():
        uploads.append(_counter("TensorToData"))
        downloads.append((met.metric_data("TransferFromDeviceTime") or (0,))[0])

    got_ids, got_logits = _generate(model, ids.to(DEV), mask.to(DEV), 12, DEV, sync=count)
    # Each step the host computes the new ids, mask, position and the token to read; of
    # those only the token the model reads is uploaded (before: every result of the stage).
    per_step = [b - a for a, b in zip(uploads[2:], uploads[3:])]
    assert per_step and all(n <= 1 for n in per_step), per_step
    # The ids were computed on the host: reading them downloads nothing.
    before = downloads[-1]
    assert torch.equal(got_ids.cpu(), want_ids)
    assert (met.metric_data("TransferFromDeviceTime") or (0,))[0] == before
    torch.testing.assert_close(got_logits.cpu(), want_logits, rtol=1e-5, atol=1e-5)


def test_the_same_loop_again_compiles_nothing():
    model, ids, mask, want_ids, _ = _run()
    _generate(model, ids.to(DEV), mask.to(DEV), 12, DEV)
    ids2 = torch.randint(1, 50, ids.shape, generator=torch.Generator().manual_seed(4))
    want2, _ = _generate(model.cpu(), ids2, mask, 12, "cpu")
    model.to(DEV)
    before = _counter("UncachedCompile")
    got2, _ = _generate(model, ids2.to(DEV), mask.to(DEV), 12, DEV)
    assert torch.equal(got2.cpu(), want2)
    assert _counter("UncachedCompile") - before <= 2  # steps 0-1 of the new run compile whole if new


def test_a_float_changing_part_compiles_per_shape_but_only_that_part():
    torch.manual_seed(0)
    model = _Decoder()
    x = torch.randn(2, 1, 16)

    def loop(model, x, hist, device, steps=8):
        outs = []
        for _ in range(steps):
            h = x
            for lin, norm in zip(model.layers, model.norms):
                h = h + torch.tanh(lin(norm(h)))
            hist = torch.cat([hist, h], dim=1)  # a float history growing by one row per step
            outs.append(hist.mean(1))
            if device != "cpu":
                xm.mark_step()
        return torch.stack(outs), hist

    want, want_hist = loop(model, x, torch.zeros(2, 1, 16), "cpu")
    model.to(DEV)
    host = _counter("StageOnHost")
    sizes = []  # nodes of each graph compiled

    def hook(request, *args):
        sizes.append(len(request.nodes))

    record.COMPILE_HOOKS.append(hook)
    try:
        got, got_hist = loop(model, x.to(DEV), torch.zeros(2, 1, 16).to(DEV), DEV)
    finally:
        record.COMPILE_HOOKS.remove(hook)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_hist.cpu(), want_hist, rtol=1e-5, atol=1e-6)
    assert _counter("StageOnHost") == host  # float values stay on the device
    # Step 0 compiles whole; step 1 (the shapes changed) compiles the unchanged stage once;
    # every later compile is the small changing part (cat and mean).
    big = [s for s in sizes[1:] if s >= 32]
    assert len(big) == 1, sizes
    assert all(s <= 4 for s in sizes[2:]), sizes


def _growing(model, x, device, rounds=1, steps=5):
    """A float history growing by one row per step (a changing stage per length), started
    afresh each round (lengths 2 to ``steps + 1`` come back); the means at each step."""
    outs = []
    for _ in range(rounds):
        hist = torch.zeros(2, 1, 16, device=device)
        for _ in range(steps):
            h = x
            for lin, norm in zip(model.layers, model.norms):
                h = h + torch.tanh(lin(norm(h)))
            hist = torch.cat([hist, h], dim=1)
            outs.append(hist.mean(1))
            if device != "cpu":
                xm.mark_step()
    return outs


def _spy_compiles(monkeypatch, fail_unless_fast=None) -> list:
    """Per XLA compile from now on: was it compiled to compile fast. ``fail_unless_fast``
    (a list): while it holds True, a compile with XLA's defaults raises."""
    seen = []
    compile_ = compiler.compile

    def spy(lowered, once=False):
        seen.append(once)
        if fail_unless_fast and fail_unless_fast[0] and not once:
            raise RuntimeError("no memory left to compile")
        return compile_(lowered, once)

    monkeypatch.setattr(compiler, "compile", spy)
    monkeypatch.setattr(cache, "CACHE", {})  # compile afresh what earlier tests compiled
    return seen


def test_a_changing_stage_compiles_for_speed_of_compiling(monkeypatch):
    """The stages compiled per shape run once each: XLA compiles them with the options that
    compile fast (on CPU, the classic fusion emitters); the graphs that run every step get
    XLA's defaults (``runtime/lower/compiler.py``)."""
    seen = _spy_compiles(monkeypatch)
    model = _Decoder()
    x = torch.randn(2, 1, 16)
    want = _growing(model, x, "cpu")
    model.to(DEV)
    got = _growing(model, x.to(DEV), DEV)
    torch.testing.assert_close(torch.stack(got).cpu(), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert seen[0] is False and seen.count(True) >= 3, seen  # step 0 whole; the changing part, per shape
    fast = compiler.options(True, "cpu")
    assert fast["xla_cpu_use_fusion_emitters"] is False and fast["xla_backend_optimization_level"] == 0
    every = {"xla_allow_excess_precision": False}  # every graph rounds half floats where PyTorch does
    assert fast["xla_allow_excess_precision"] is False
    assert compiler.options(False, "cpu") == every and compiler.options(True, "gpu") == every


def _recurring(monkeypatch):
    """A model on the device, its input and CPU's results for 5 rounds of ``_growing``; a
    fast-compiled graph is compiled to run fast at its second cache hit, however little work
    it has."""
    monkeypatch.setattr(compiler, "RUNS_BEFORE_OPTIMIZING", 2)
    monkeypatch.setattr(compiler, "MIN_WORK_TO_OPTIMIZE", 0)
    model = _Decoder()
    x = torch.randn(2, 1, 16)
    want = _growing(model, x, "cpu", 5)
    return model.to(DEV), x, want


def test_a_fast_compiled_stage_that_keeps_running_is_compiled_to_run_fast(monkeypatch):
    """A per-shape stage whose shape keeps coming back is compiled again with XLA's defaults
    at a fixed cache hit (``compiler.RUNS_BEFORE_OPTIMIZING``), once; results equal CPU's."""
    seen = _spy_compiles(monkeypatch)
    model, x, want = _recurring(monkeypatch)
    before = _counter("OptimizedRecompile")
    got = _growing(model, x.to(DEV), DEV, 4)
    fast = seen.count(True)
    upgraded = _counter("OptimizedRecompile") - before
    assert fast >= 1 and upgraded == fast, (seen, upgraded)
    compiles = _counter("UncachedCompile")
    got += _growing(model, x.to(DEV), DEV)  # everything compiled, and compiled to run fast
    assert _counter("UncachedCompile") == compiles and _counter("OptimizedRecompile") - before == upgraded
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)


def test_a_recurring_stage_too_small_to_gain_is_not_compiled_again(monkeypatch):
    """A per-shape stage with little work (a growing history's cat and mean) runs as fast at
    either optimization level: it keeps its fast executable however often it comes back, and
    a loop's later rounds compile nothing (a generate() loop's 30 attention stages, compiled
    again at once, had stalled one call 5 s)."""
    seen = _spy_compiles(monkeypatch)
    monkeypatch.setattr(compiler, "RUNS_BEFORE_OPTIMIZING", 2)
    model = _Decoder()
    x = torch.randn(2, 1, 16)
    want = _growing(model, x, "cpu", 5)
    model.to(DEV)
    before = _counter("OptimizedRecompile")
    got = _growing(model, x.to(DEV), DEV)
    n = len(seen)
    assert seen.count(True) >= 1, seen
    got += _growing(model, x.to(DEV), DEV, 4)
    assert len(seen) == n and _counter("OptimizedRecompile") == before, seen
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)


def test_only_a_graph_with_work_enough_is_worth_compiling_again():
    """XLA's cost analysis decides: a small attention-sized graph is not, a layer-sized matmul is."""
    import jax
    import jax.numpy as jnp

    def mlp(x, w):
        return jnp.tanh(x @ w).sum()

    small = jax.jit(mlp).lower(jnp.ones((1, 32)), jnp.ones((32, 40))).compile()
    large = jax.jit(mlp).lower(jnp.ones((256, 1024)), jnp.ones((1024, 1024))).compile()
    assert not compiler.worth_optimizing(small)
    assert compiler.worth_optimizing(large)
    assert compiler.worth_optimizing(None)  # no analysis: as before, compiled again


def test_a_failed_recompile_to_run_fast_keeps_the_graph_running(monkeypatch):
    """Compiling a graph again to run fast is an optimization: when it fails, the step runs
    with the executable it had, and nothing is compiled again for it."""
    armed = [False]
    seen = _spy_compiles(monkeypatch, fail_unless_fast=armed)
    model, x, want = _recurring(monkeypatch)
    before = _counter("OptimizedRecompile")
    got = _growing(model, x.to(DEV), DEV)
    fast, n = seen.count(True), len(seen)
    armed[0] = True  # from here, only the recompiles to run fast would compile: they fail
    got += _growing(model, x.to(DEV), DEV, 3)
    assert fast >= 1 and seen[n:] == [False] * fast, seen
    got += _growing(model, x.to(DEV), DEV)  # a failed recompile is not tried again
    assert len(seen) == n + fast and _counter("OptimizedRecompile") == before
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)


def test_xla_options_from_the_environment_reach_the_compiler(monkeypatch):
    x = torch.arange(6.0).to(DEV)
    monkeypatch.setenv("XLATORCH_XLA_OPTIONS", "xla_cpu_use_fusion_emitters=false")
    assert compiler.options() == {"xla_cpu_use_fusion_emitters": False}
    torch.testing.assert_close((x * 3 + 1).cpu(), torch.arange(6.0) * 3 + 1)
    monkeypatch.setenv("XLATORCH_XLA_OPTIONS", "xla_no_such_option_here=1")
    with pytest.raises(Exception, match="xla_no_such_option_here") as e:
        (x * 5 - 2).cpu()
    assert any("XLATORCH_XLA_OPTIONS" in n for n in getattr(e.value, "__notes__", [])), e.value
    monkeypatch.setenv("XLATORCH_XLA_OPTIONS", "fusion")
    with pytest.raises(ValueError, match="XLATORCH_XLA_OPTIONS: 'fusion' is not name=value"):
        compiler.options()
    monkeypatch.setenv("XLATORCH_XLA_OPTIONS", "")
    assert compiler.options(True, "cpu") is None


def test_a_convolutions_weight_gradient_compiles_with_xlas_own_convolutions_on_cpu(monkeypatch):
    """On CPU a graph computing a convolution's weight gradient compiles its convolutions with
    XLA's own kernels, not YNNPACK's (``compiler._EIGEN_CONVOLUTIONS``); a forward-only one
    keeps XLA's defaults. Results equal CPU's either way."""
    seen = []
    detect = compiler._weight_gradient_on_cpu

    def spy(lowered):
        seen.append(detect(lowered))
        return seen[-1]

    monkeypatch.setattr(compiler, "_weight_gradient_on_cpu", spy)
    monkeypatch.setattr(cache, "CACHE", {})
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    want = conv(x)
    want_grad = torch.autograd.grad(want.square().sum(), conv.weight)[0]
    conv.to(DEV)
    with torch.no_grad():
        got = conv(x.to(DEV))
        xm.mark_step()
    assert seen == [False], seen
    got_grad = torch.autograd.grad(conv(x.to(DEV)).square().sum(), conv.weight)[0]
    xm.mark_step()
    assert seen[-1] is True, seen
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.cpu(), want_grad, rtol=1e-4, atol=1e-4)


def test_a_small_graph_or_a_mostly_changing_one_compiles_whole():
    staged = _counter("StagedSync")
    x = torch.rand(6, 6).to(DEV)
    for d in (0, 1, 0):
        y = torch.amax(x - 3, dim=d)  # noqa: F841  (a graph of two nodes: below MIN_UNCHANGED)
        xm.mark_step()
    lin = torch.nn.Linear(8, 8).to(DEV)
    for n in (3, 4, 5):  # every node reads the changing batch
        y = torch.ones(n, 8, device=DEV)
        for _ in range(20):
            y = torch.tanh(lin(y))
        xm.mark_step()
    assert _counter("StagedSync") == staged
    assert stages.MIN_UNCHANGED > 2


def test_an_error_in_a_changing_stage_is_reported_as_without_stages():
    model, ids, mask, _, _ = _run(steps=4)
    ids, mask = ids.to(DEV), mask.to(DEV)
    _generate(model, ids, mask, 3, DEV)  # the loop's structure is known and split from now on
    bad = torch.full((2, 1), 99, dtype=torch.long, device=DEV)  # past the end of a row of 6
    longer = torch.cat([ids, ids[:, :1]], dim=-1)
    with pytest.raises(Exception) as e:
        _generate(model, longer, torch.cat([mask, bad], dim=-1), 1, DEV)
    assert "index" in str(e.value).lower() and "out of" in str(e.value).lower(), e.value
    # The model's weights are untouched and the loop still runs and matches CPU.
    got, _ = _generate(model, ids, mask, 3, DEV)
    want, _ = _generate(model.cpu(), ids.cpu(), mask.cpu(), 3, "cpu")
    assert torch.equal(got.cpu(), want)


def test_changing_integer_bookkeeping_alone_runs_on_the_host():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 4.0])
    xd = x.to(DEV)
    host = _counter("StageOnHost")
    compiles = []
    for k in (0.5, 1.5, 2.5, 3.5):
        y = torch.nonzero(xd > k).flatten() * 3 + 1  # a new length each time
        xm.mark_step()
        assert torch.equal(y.cpu(), torch.nonzero(x > k).flatten() * 3 + 1)
        compiles.append(_counter("UncachedCompile"))
    assert compiles[-1] == compiles[1], compiles  # lengths 2 and 1 compile nothing
    assert _counter("StageOnHost") - host == 3


def test_an_interrupt_between_stages_changes_nothing(monkeypatch):
    model, ids, mask, want_ids, _ = _run(steps=6)
    ids_d, mask_d = ids.to(DEV), mask.to(DEV)
    _generate(model, ids_d, mask_d, 3, DEV)  # the loop's graph is known: the next one is staged
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    real = host.on_host
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:  # after the first stage ran
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(host, "on_host", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _generate(model, ids_d, mask_d, 6, DEV)
    monkeypatch.setattr(host, "on_host", real)
    assert len(calls) == 2
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p.detach().cpu(), w)
    got, _ = _generate(model, ids_d, mask_d, 6, DEV)  # the same loop runs on, as on CPU
    assert torch.equal(got.cpu(), want_ids[:, : got.shape[1]])


def _generate_padded(model, ids, steps, width, device):
    """As ``_generate``, with the mask padded to ``width`` columns while it is shorter (a static
    cache's mask): the last step, whose mask fills the width, has no pad op."""
    mask = torch.ones_like(ids)
    out, compiles = [], []
    for _ in range(steps):
        c0 = _counter("UncachedCompile")
        full = mask if mask.shape[1] == width else torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
        pos = full.sum(-1, keepdim=True) - 1
        logits = model(ids.gather(1, pos))[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        bool((nxt == -1).all())  # the host read that cuts each step
        out.append(logits)
        compiles.append(_counter("UncachedCompile") - c0)
    return ids, torch.stack(out), compiles


def test_last_step_without_its_pad_borrows_the_plan(monkeypatch):
    """The last step's graph lacks one op (no padding left): a new structure, whose nodes match
    the previous plan's but for that op. It runs as the same stages (cached) and compiles
    nothing; results equal CPU's."""
    monkeypatch.setattr(cache, "CACHE", {})
    model = _Decoder()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (2, 5), generator=gen)
    steps, width = 6, 10  # lengths 5..10: the last step's mask is 10 wide
    want_ids, want, _ = _generate_padded(model, ids, steps, width, "cpu")
    stages.SEEN.clear()
    got_ids, got, compiles = _generate_padded(model.to(DEV), ids.to(DEV), steps, width, DEV)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    # Steps 0 and 1 are new structures (step 0 makes the mask), step 2 compiles its unchanged stage.
    assert compiles == [1, 1, 1, 0, 0, 0], compiles
