"""A step that fails an on-device check is undone as CPU leaves it: the parameters and optimizer
state it updated get their data from before it (kept by the sync on CPU, or selected by the
graph itself), in both ways of undoing; and a step whose checks the host can decide before it
runs (targets, token ids uploaded from a CPU batch) runs unchecked.
"""

import pytest
import torch
import torch.nn.functional as F

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests.tolerances import AdaptiveSteps, recorded_step
from xlatorch.runtime.ir.failed import FailedValueError

I = torch.tensor  # noqa: E741


@pytest.fixture(params=["keep", "graph"])
def undo(request, monkeypatch):
    """Both ways a failed step is undone: the sync gives back the data it kept (CPU's way),
    or the graph selects it itself and the data is donated (accelerators')."""
    from xlatorch.runtime.lower import cache
    from xlatorch.runtime.plan import keep

    monkeypatch.setattr(keep, "UNDO_IN_GRAPH", [request.param == "graph"])
    monkeypatch.setattr(cache, "CACHE", {})
    return request.param


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_with_a_bad_target_raises_and_keeps_the_model_as_cpu_does(optimizer, undo):
    # On CPU the exception stops the step before backward and the update: the parameters
    # and optimizer state keep their values, and the next good step trains from them.
    def run(device, record=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 5)).to(device)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=0.01, capturable=device != "cpu"))  # fmt: skip
        tokens = I([1, 2, 3], device=device)
        losses = []

        def step(target):
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens), I(target, device=device))
            loss.backward()
            recorded_step(opt, model.parameters(), record)
            xm.mark_step()
            losses.append(loss.item())

        step([0, 1, 2])
        with pytest.raises(IndexError, match="Target 5 is out of bounds"):
            step([0, 1, 5])
        step([2, 1, 0])
        step([2, 1, 0])
        return losses, [p.detach().cpu() for p in model.parameters()]

    steps = AdaptiveSteps(rtol=1e-5, atol=1e-6)  # AdamW: an element's step is its gradient's rounding amplified
    cpu_losses, cpu_params = run("cpu", steps)
    xla_losses, xla_params = run("xla")
    assert len(xla_losses) == 3
    torch.testing.assert_close(xla_losses, cpu_losses, rtol=1e-5, atol=1e-6)
    if optimizer == "sgd":
        for a, b in zip(xla_params, cpu_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        steps.assert_close(xla_params, cpu_params)


def _adam_steps_with_a_bad_target(device, record=None, computed=False):
    """A small model trained by Adam, with a step whose target is out of range in the middle;
    its parameters at the end (``record``: an ``AdaptiveSteps`` that sees each step).
    ``computed``: the targets are computed on the device (not data the host holds, so every
    step runs its checks on the device, ``runtime/plan/prechecks.py``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=device != "cpu")
    x = torch.randn(4, 6).to(device)

    def step(target):
        opt.zero_grad()
        t = I(target, device=device)
        F.cross_entropy(model(x), t.float().long() if computed else t).backward()
        recorded_step(opt, model.parameters(), record)
        xm.mark_step()

    for _ in range(3):
        step([0, 1, 2, 3])
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        step([0, 1, 2, 7])
        model[0].weight.cpu()  # the step's rows are read here at the latest
    step([3, 2, 1, 0])
    return [p.detach().cpu() for p in model.parameters()]


def _donated() -> int:
    """The most buffers one graph compiled since the metrics were cleared donates."""
    return max(v for _, v in met.metric_data("InputOutputAliasCount")[2])


def test_a_checked_step_undone_in_the_graph_donates_the_state_it_updates(undo):
    """Undone in the graph, a checked step costs no second copy of the model's state: its
    updated tensors' buffers are donated (written in place) as without checks. Kept by the
    sync instead (CPU's default), they are not. Either way a failed step leaves the model as
    CPU does."""
    steps = AdaptiveSteps(rtol=1e-5, atol=1e-6)
    cpu_params = _adam_steps_with_a_bad_target("cpu", steps, computed=True)
    met.clear_all()
    xla_params = _adam_steps_with_a_bad_target("xla", computed=True)
    # The step's graph updates 4 parameters and Adam's 8 moments (and 4 step counts).
    assert (_donated() >= 12) == (undo == "graph"), _donated()
    assert not met.counter_value("ChecksOnHost")
    steps.assert_close(xla_params, cpu_params)


def test_checks_on_targets_the_host_holds_are_decided_before_the_step(undo):
    """Targets uploaded from the host are checked there before the step runs: a good step runs
    unchecked and donates what it updates (either undo mode), reading no rows; the bad step
    runs checked, raises CPU's error and leaves the model as CPU does."""
    steps = AdaptiveSteps(rtol=1e-5, atol=1e-6)
    cpu_params = _adam_steps_with_a_bad_target("cpu", steps)
    met.clear_all()
    xla_params = _adam_steps_with_a_bad_target("xla")
    assert met.counter_value("ChecksOnHost") >= 4  # the good steps (a step may be prepared twice)
    assert met.counter_value("CheckRowsRead") == 1  # the bad one's
    assert _donated() >= 12
    steps.assert_close(xla_params, cpu_params)


def _lm_steps_with_a_bad_target(device, record=None):
    """A language model's step as users write it: token ids and positions (a buffer, sliced)
    through embeddings, the targets reshaped for the loss (``y.view(-1)``), Adam; a step with
    an out-of-range target in the middle. The parameters at the end."""
    torch.manual_seed(0)
    vocab, seq = 7, 4

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, 6), torch.nn.Embedding(seq, 6)
            self.head = torch.nn.Linear(6, vocab)
            self.register_buffer("positions", torch.arange(seq))

        def forward(self, idx):
            return self.head(self.tok(idx) + self.pos(self.positions[: idx.shape[1]]))

    model = LM().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=device != "cpu")
    x = I([[1, 2, 3], [4, 5, 6]], device=device)

    def step(target):
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.view(-1, vocab), I(target, device=device).view(-1)).backward()
        recorded_step(opt, model.parameters(), record)
        xm.mark_step()

    for _ in range(3):
        step([[0, 1, 2], [3, 4, 5]])
    with pytest.raises(IndexError, match="Target 9 is out of bounds"):
        step([[0, 1, 2], [3, 9, 5]])
        model.head.weight.cpu()  # the step's rows are read here at the latest
    step([[5, 4, 3], [2, 1, 0]])
    return [p.detach().cpu() for p in model.parameters()]


def test_checks_on_views_of_data_the_host_holds_are_decided_before_the_step(undo):
    """A check reading a view of data the host holds (targets reshaped for the loss, positions
    sliced from a buffer) is decided on the host too: a language model's good steps run
    unchecked and donate, the bad one raises CPU's error and leaves the model as CPU does."""
    steps = AdaptiveSteps(rtol=1e-5, atol=1e-6)
    cpu_params = _lm_steps_with_a_bad_target("cpu", steps)
    met.clear_all()
    xla_params = _lm_steps_with_a_bad_target("xla")
    assert met.counter_value("ChecksOnHost") >= 4  # the good steps
    assert met.counter_value("CheckRowsRead") == 1  # the bad one's
    assert _donated() >= 15  # 5 parameters, their 10 moments
    steps.assert_close(xla_params, cpu_params)


def test_on_cpu_checked_steps_undo_in_the_graph_once_keeping_the_state_would_not_fit(monkeypatch):
    """CPU keeps the data a failed step gives back until the state it would keep takes a
    quarter of the host's available memory; from then on the process undoes in the graph."""
    from xlatorch.runtime.base import memory
    from xlatorch.runtime.lower import cache
    from xlatorch.runtime.plan import keep

    monkeypatch.setattr(keep, "UNDO_IN_GRAPH", [None])
    monkeypatch.setattr(keep, "_UNDO", "")
    monkeypatch.setattr(cache, "CACHE", {})
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 4000)  # the state kept: ~1.5 kB
    monkeypatch.setattr(keep, "_SMALL", 0)  # read the host's memory for this small a state too
    steps = AdaptiveSteps(rtol=1e-5, atol=1e-6)
    cpu_params = _adam_steps_with_a_bad_target("cpu", steps)
    met.clear_all()
    xla_params = _adam_steps_with_a_bad_target("xla")
    assert keep.UNDO_IN_GRAPH == [True] and _donated() >= 12
    steps.assert_close(xla_params, cpu_params)


def test_a_step_traced_on_a_failed_steps_results_carries_its_error(undo):
    # Checks are read at the next sync, after the program traced the next step from the
    # failed step's results: the failed step is undone, and what the next step computed
    # from its results carries the error; the rest of the next step runs.
    w = torch.zeros(3, device="xla")
    other = torch.ones(2, device="xla")
    xm.mark_step()
    w.add_(torch.arange(3.0, device="xla")[I([0, 1, 5], device="xla")])  # index 5: out of range
    xm.mark_step()  # runs; not read yet
    w.mul_(2)  # traced from the failed step's result
    from_w = w.sum()
    fine = other * 3
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        xm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.zeros(3))  # as before the failed step (its update undone)
    with pytest.raises(FailedValueError, match="index 5 is out of bounds"):
        from_w.cpu()
    torch.testing.assert_close(fine.cpu(), torch.full((2,), 3.0))
    w.add_(1)
    xm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.ones(3))


@pytest.mark.parametrize("source", ["computed", "device data", "host data"])
def test_a_tensor_overwritten_after_a_failed_op_keeps_its_value(undo, source):
    # On CPU the failed op raises before the later copy: the tensor keeps its value. The step
    # never reads that value (the copy overwrites it), so the sync keeps it to give it back;
    # a copy of data that is ready joins the step as a pending value for that.
    buf = torch.zeros(3, device="xla")
    src = torch.ones(3, device="xla")
    xm.mark_step()
    y = torch.arange(3.0, device="xla")[I([0, 5], device="xla")]  # index 5: out of range
    buf.copy_({"computed": lambda: src * 2, "device data": lambda: src, "host data": lambda: torch.ones(3)}[source]())
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        xm.mark_step()
        buf.cpu()
    torch.testing.assert_close(buf.cpu(), torch.zeros(3))
    with pytest.raises(FailedValueError, match="index 5 is out of bounds"):
        y.cpu()


def test_a_tensor_written_before_and_after_a_failed_op_carries_its_error(undo):
    # CPU would keep the first write (the failed op stops the program before the second);
    # that value is not kept here, so the tensor fails loudly instead of going back further.
    w = torch.zeros(3, device="xla")
    v = torch.zeros(3, device="xla")
    xm.mark_step()
    w.add_(1)
    y = torch.arange(3.0, device="xla")[I([0, 5], device="xla")]  # index 5: out of range
    w.add_(1)
    v.add_(1)  # written only after it: its value at the failed op is the one before the step
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        xm.mark_step()
        v.cpu()
    with pytest.raises(FailedValueError, match="index 5 is out of bounds"):
        w.cpu()
    torch.testing.assert_close(v.cpu(), torch.zeros(3))
    with pytest.raises(FailedValueError):
        y.cpu()


def test_a_value_the_program_gave_a_tensor_after_a_failed_step_is_kept(undo):
    # The failed step is undone for the tensors whose values come from it; a tensor the
    # program has since given a value of its own (a checkpoint loaded into it) keeps that.
    w = torch.zeros(3, device="xla")
    v = torch.zeros(3, device="xla")
    xm.mark_step()
    w.add_(torch.arange(3.0, device="xla")[I([0, 1, 5], device="xla")])
    v.add_(w.sum())
    xm.mark_step()
    w.copy_(torch.full((3,), 7.0))  # from the host, not from the failed step's results
    v.mul_(2)  # from them
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        xm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.full((3,), 7.0))
    torch.testing.assert_close(v.cpu(), torch.zeros(3))  # as before the failed step


def test_a_step_that_fails_gives_back_data_the_program_wrote_in_an_earlier_step(undo):
    # The tensor held zeros, then the program gave it ones from the host, in a step of their
    # own. The failed step's update of it is undone to the ones, as CPU (which raises before
    # the update) leaves it: not to the zeros it held two steps ago, nor to the error.
    x = torch.zeros(3, device="xla")
    xm.mark_step()
    x.copy_(torch.ones(3))
    xm.mark_step()
    y = torch.arange(3, device="xla").float()[I([5], device="xla")] * 2.5  # index 5: out of range
    x.add_(1)  # traced after the failed op: undone
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        xm.mark_step()
        y.cpu()
    torch.testing.assert_close(x.cpu(), torch.ones(3))


def test_a_compiled_graphs_checks_are_its_ops_checks_decided_on_the_host():
    """A node holding torch.compile's graph gives its checked ops (``FxProgram.inner_checks``):
    over indices the host holds, their ops.yaml checks are decided on the host as a lazily traced
    op's are (the step then compiles and runs without them), and one that fires leaves the step
    checked, raising CPU's error from the device."""
    w = torch.randn(10, 4).to("xla")
    f = torch.compile(lambda w, i: F.embedding(i, w) * 2, backend="openxla")
    xm.mark_step()
    met.clear_all()
    got = f(w, I([1, 9], device="xla"))
    xm.mark_step()
    torch.testing.assert_close(got.cpu(), F.embedding(I([1, 9]), w.cpu()) * 2)
    assert met.counter_value("ChecksOnHost") == 1 and met.counter_value("CheckRowsRead") is None
    with pytest.raises(IndexError, match="index out of range"):
        f(w, I([1, 12], device="xla")).cpu()
    assert met.counter_value("ChecksOnHost") == 1 and met.counter_value("CheckRowsRead") == 1


def test_a_compiled_graphs_check_on_a_value_it_computes_stays_on_the_device(monkeypatch):
    """An index the compiled graph computes itself (``i + 1``) is not the host's: the step runs
    checked, and the host computes no check at all, not even the ops.yaml check of a lazily
    traced op beside it (a generation step's mask indexing beside its compiled forward)."""
    from xlatorch.runtime.plan import prechecks

    w = torch.randn(10, 4).to("xla")
    f = torch.compile(lambda w, i: F.embedding(i + 1, w) * 2, backend="openxla")
    ids = I([1, 8], device="xla")
    xm.mark_step()
    computed = []
    real = prechecks._bads
    monkeypatch.setattr(prechecks, "_bads", lambda *a: computed.append(a[0].name) or real(*a))
    alone = F.embedding(ids, w)  # checked over ids the host holds: decided on the host by itself
    xm.mark_step()
    assert computed == ["embedding.default"]
    computed.clear()
    met.clear_all()
    got = f(w, ids)
    alone = F.embedding(ids, w)
    xm.mark_step()
    assert computed == [] and met.counter_value("ChecksOnHost") is None
    torch.testing.assert_close(got.cpu(), F.embedding(I([2, 9]), w.cpu()) * 2)
    torch.testing.assert_close(alone.cpu(), F.embedding(I([1, 8]), w.cpu()))
    with pytest.raises(IndexError, match="index out of range"):
        f(w, I([1, 9], device="xla")).cpu()


def test_a_losss_backward_is_not_checked_again_on_the_targets_its_forward_checked(monkeypatch):
    """``nll_loss_backward``'s check is its forward's expression over the same targets: decided
    once on the host per step (``prechecks._same``). A backward given other targets than the
    forward's is checked apart, and raises CPU's error for them."""
    from xlatorch.runtime.plan import prechecks

    computed = []
    real = prechecks._bads
    monkeypatch.setattr(prechecks, "_bads", lambda *a: computed.append(a[0].name) or real(*a))
    w = torch.randn(3, 5, requires_grad=True)
    x, y = torch.randn(4, 3), I([0, 4, 2, 1])
    wd = w.detach().to("xla").requires_grad_()
    xd, yd = x.to("xla"), y.to("xla")
    xm.mark_step()
    met.clear_all()
    F.cross_entropy(xd @ wd, yd).backward()
    xm.mark_step()
    assert set(computed) == {"nll_loss_forward.default"}  # (a step may be prepared twice: births)
    assert met.counter_value("ChecksOnHost") >= 1 and met.counter_value("CheckRowsRead") is None
    F.cross_entropy(x @ w, y).backward()
    torch.testing.assert_close(wd.grad.cpu(), w.grad, rtol=1e-5, atol=1e-6)

    bad = I([0, 4, 7, 1], device="xla")  # 7: not one of the 5 classes
    one = torch.ones(()).to("xla")
    logp = F.log_softmax(xd @ wd.detach(), 1)
    xm.mark_step()
    computed.clear()
    loss, total = torch.ops.aten.nll_loss_forward(logp, yd, None, 1, -100)  # the good targets
    grad = torch.ops.aten.nll_loss_backward(one, logp, bad, None, 1, -100, total)  # in the same step
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        grad.cpu()
    assert set(computed) == {"nll_loss_forward.default", "nll_loss_backward.default"}


def test_a_host_check_over_values_in_range_takes_two_reductions_and_one_out_of_range_names_it():
    """``in_range`` and ``targets`` on host arrays (checks decided before the step): values all in
    range answer from their minimum and maximum; one out of range gives the full result, the
    first offending value and its position, as on the device."""
    import numpy as np

    from xlatorch.lowering import checks as C

    idx = np.array([[3, 0], [4, 1]])
    assert C.in_range(idx, 0, 5, IndexError, "{0}")[0] is False
    bad, value, pos, exc, _ = C.in_range(idx, 0, 4, IndexError, "{0}")
    assert bool(bad) and int(value) == 4 and int(pos) == 2 and exc is IndexError
    bad, value, pos, _, _ = C.in_range(np.array([2, -1, 9]), 0, 5, IndexError, "{0}")
    assert bool(bad) and int(value) == -1 and int(pos) == 1
    logits = np.zeros((3, 5), np.float32)
    assert C.targets(logits, np.array([0, 4, 2]), -100)[0] is False
    assert not bool(C.targets(logits, np.array([0, -100, 2]), -100)[0])  # ignore_index: the full condition
    bad, value, pos, _, _ = C.targets(logits, np.array([0, -100, 5]), -100)
    assert bool(bad) and int(value) == 5 and int(pos) == 2
