"""Eager mode (``torch_xla.experimental.eager_mode``): each op runs at once, compiled once per signature.

Values are compared with PyTorch eager on CPU; compiles and executions are counted through
the metrics API (torch_xla's ``EagerOpCompileTime`` / ``EagerOpExecuteTime``).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests.tolerances import AdaptiveSteps
from xlatorch.experimental import eager_mode, eager_mode_context, is_eager_mode
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.trace import dispatch as D
from xlatorch.runtime.trace import tensor as T


@pytest.fixture
def eager():
    eager_mode(True)
    try:
        yield
    finally:
        eager_mode(False)


def _count(name: str) -> int:
    data = met.metric_data(name)
    return 0 if data is None else data[0]


def _is_data(t) -> bool:
    return type(T.value_of(t)) is Data


def test_the_mode_is_off_by_default_and_switches():
    assert not is_eager_mode()
    assert T.DISPATCH is D.dispatch  # the lazy per-op path is untouched
    with eager_mode_context(True) as before:
        assert before is False and is_eager_mode()
        assert T.DISPATCH is not D.dispatch
        with eager_mode_context(False) as inner:
            assert inner is True and not is_eager_mode()
        assert is_eager_mode()
    assert not is_eager_mode() and T.DISPATCH is D.dispatch


def test_each_op_runs_at_once_compiled_once_per_signature(eager):
    cpu = torch.randn(5, 5)
    x = cpu.to("xla")
    met.clear_all()
    y = x * 5
    assert _is_data(y)  # computed, not pending
    xm.wait_device_ops()
    assert _count("EagerOpCompileTime") == 1 and _count("EagerOpExecuteTime") == 1
    z = x * 3  # the same op and signature: the cached executable
    xm.wait_device_ops()
    assert _count("EagerOpCompileTime") == 1 and _count("EagerOpExecuteTime") == 2
    assert met.counter_value("CachedCompile") == 1
    w = torch.logsumexp(y, 0)  # a new op: one more compile
    xm.wait_device_ops()
    assert _count("EagerOpCompileTime") == 2 and _count("EagerOpExecuteTime") == 3
    # Eager ops are not steps' graphs: CompileTime / ExecuteTime count lazy graphs only.
    assert met.metric_data("CompileTime") is None and met.metric_data("ExecuteTime") is None
    torch.testing.assert_close(y.cpu(), cpu * 5)
    torch.testing.assert_close(z.cpu(), cpu * 3)
    torch.testing.assert_close(w.cpu(), torch.logsumexp(cpu * 5, 0))


def test_factories_views_and_in_place_ops(eager):
    met.clear_all()
    z = torch.zeros(3, 4, device="xla")  # a factory runs below dispatch: computed at once too
    assert _is_data(z)
    z[0].add_(1)  # a view written in place changes its base, as on CPU
    z[:, 1] = 7.0
    want = torch.zeros(3, 4)
    want[0].add_(1)
    want[:, 1] = 7.0
    assert _is_data(z)
    torch.testing.assert_close(z.cpu(), want)
    t = torch.tensor([1.0, 2.0], device="xla")
    assert _is_data(t)
    assert not T.PENDING


def test_random_ops_do_not_recompile_and_follow_the_seed(eager):
    xm.set_rng_state(1234)
    a = torch.randn(12, 13, device="xla")
    compiles = _count("EagerOpCompileTime")
    b = torch.randn(12, 13, device="xla")
    assert _count("EagerOpCompileTime") == compiles
    assert not torch.equal(a.cpu(), b.cpu())
    xm.set_rng_state(1234)
    c = torch.randn(12, 13, device="xla")
    torch.testing.assert_close(a.cpu(), c.cpu(), rtol=0, atol=0)


def test_autograd_matches_cpu(eager):
    x_cpu = torch.randn(4, 3, requires_grad=True)
    w_cpu = torch.randn(3, 2, requires_grad=True)
    (x_cpu @ w_cpu).tanh().sum().backward()
    x = x_cpu.detach().to("xla").requires_grad_()
    w = w_cpu.detach().to("xla").requires_grad_()
    loss = (x @ w).tanh().sum()
    assert _is_data(loss)
    loss.backward()  # backward ops run on autograd's device thread, eagerly as well
    assert _is_data(x.grad) and _is_data(w.grad)
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad)
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)


def test_a_fallback_is_counted_and_correct(eager):
    cpu = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    x = cpu.to("xla") * 2
    got = torch.special.bessel_j0(x)
    assert met.counter_value("aten::special_bessel_j0") == 1
    assert met.executed_fallback_ops() == ["aten::special_bessel_j0"]
    torch.testing.assert_close((got + 1).cpu(), torch.special.bessel_j0(cpu * 2) + 1)


def test_an_out_of_range_index_raises_as_in_lazy_mode(eager):
    x = torch.arange(6.0).reshape(3, 2).to("xla")
    bad = x[torch.tensor([0, 5], device="xla")]
    line = sys._getframe().f_lineno - 1
    with pytest.raises(IndexError, match=rf"out of bounds for dimension 0 with size 3.*test_eager_mode.py:{line}"):
        bad.cpu()  # the check's rows are read when a result is next needed, as in lazy mode
    torch.testing.assert_close((x + 1).cpu(), torch.arange(6.0).reshape(3, 2) + 1)  # later work runs


def test_mark_step_and_lazy_mode_still_work(eager):
    x = torch.ones(3, device="xla") * 2
    xm.mark_step()  # nothing is pending: a no-op
    assert met.counter_value("MarkStep") >= 1
    eager_mode(False)
    y = x + 1
    assert not _is_data(y)  # lazy again: pending until the step ends
    xm.mark_step()
    assert _is_data(y)
    torch.testing.assert_close(y.cpu(), torch.full((3,), 3.0))


def test_the_debug_tools_do_not_report_eager_ops_as_graph_cuts(eager):
    from xlatorch.debug import explain

    explain.clear()
    x = torch.randn(3, device="xla")
    (x.sin() + 1).cos()
    assert explain.sync_counts() == {}
    assert explain.compile_reasons() == []


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_training_an_mlp_matches_cpu(eager):
    torch.manual_seed(1)
    batches = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(4)]
    ref = _mlp()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    # Adam divides each gradient by its own magnitude: its rounding is amplified (tests/tolerances.py).
    steps = AdaptiveSteps()
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        steps.before(ref.parameters())
        opt.step()
        steps.after(ref.parameters())
    model = _mlp().to("xla")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to("xla")), y.to("xla"))
        loss.backward()
        opt.step()
        losses.append(loss)
    assert not T.PENDING  # every op ran as it was called
    steps.assert_close(list(model.parameters()), list(ref.parameters()))
    # A second epoch compiles nothing: every op's signature was seen in the first.
    compiles = met.counter_value("UncachedCompile")
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x.to("xla")), y.to("xla")).backward()
        opt.step()
    assert met.counter_value("UncachedCompile") == compiles


def test_a_compile_region_traces_lazily_inside_eager_mode(eager):
    cpu = torch.randn(5, 5)
    t = cpu.to("xla")

    @xlatorch.compile
    def cos_sin(x):
        y = torch.sin(x)
        assert not _is_data(y)  # traced, not run
        return torch.cos(y)

    xm.wait_device_ops()
    met.clear_all()
    got = cos_sin(t)
    xm.wait_device_ops()
    assert met.metric_data("ExecuteTime")[0] == 1  # one graph for the region
    assert "EagerOpExecuteTime" not in met.metric_names()
    assert is_eager_mode()  # restored after the region
    torch.testing.assert_close(got.cpu(), cpu.sin().cos())
