"""Checks CPU PyTorch makes on data raise on the device too: same exception, when the step's
results are next needed (the next sync, a read by the host).

Each case runs on CPU (where PyTorch raises) and on the xla device, where the check is
computed inside the compiled graph and raised naming the ATen op and this file's line.
Valid inputs of the same ops give CPU's results.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests.tolerances import AdaptiveSteps
from xlatorch.runtime.ir.failed import FailedValueError

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


@pytest.fixture(params=["keep", "graph"])
def undo(request, monkeypatch):
    """Both ways a failed step is undone: the sync gives back the data it kept (CPU's way),
    or the graph selects it itself and the data is donated (accelerators')."""
    from xlatorch.runtime.lower import cache
    from xlatorch.runtime.plan import keep

    monkeypatch.setattr(keep, "UNDO_IN_GRAPH", [request.param == "graph"])
    monkeypatch.setattr(cache, "CACHE", {})
    return request.param


I = torch.tensor  # noqa: E741


def _ones(*s):
    return torch.ones(*s)


def _zeros(d, *s, dtype=torch.float32):
    return torch.zeros(s, dtype=dtype, device=d)


N = (1 << 16) + 1  # elements: integer ops this large run on the device (smaller ones may run on the host)


def _setitem(x, idx, v):
    y = x.clone()
    y[idx] = v
    return y


# name -> op over (x, device); every one raises on CPU.
BAD = {
    "index_select": lambda x, d: torch.index_select(x, 0, I([0, 5], device=d)),
    "index_select_negative": lambda x, d: torch.index_select(x, 0, I([-1], device=d)),
    "embedding": lambda x, d: F.embedding(I([[0, 3]], device=d), x),
    "embedding_negative": lambda x, d: F.embedding(I([-1], device=d), x),
    "gather": lambda x, d: torch.gather(x, 1, I([[0, 9]] * 3, device=d)),
    "gather_negative": lambda x, d: torch.gather(x, 1, I([[0, -1]] * 3, device=d)),
    "advanced_index": lambda x, d: x[I([0, 5], device=d)],
    "advanced_index_negative": lambda x, d: x[I([-4], device=d)],
    "advanced_index_dim1": lambda x, d: x[:, I([4], device=d)],
    "index_put_": lambda x, d: x.clone().index_put_((I([3], device=d),), I(1.0, device=d)),
    "setitem": lambda x, d: _setitem(x, I([0, 7], device=d), 1.0),
    "scatter_": lambda x, d: x.clone().scatter_(1, I([[7]], device=d), 1.0),
    "scatter_add_": lambda x, d: x.clone().scatter_add_(1, I([[4]], device=d), _ones(1, 1).to(d)),
    "scatter_reduce_": lambda x, d: x.clone().scatter_reduce_(1, I([[-1]], device=d), _ones(1, 1).to(d), "sum"),
    "index_add_": lambda x, d: x.clone().index_add_(0, I([3], device=d), _ones(1, 4).to(d)),
    "index_copy_": lambda x, d: x.clone().index_copy_(0, I([-1], device=d), _ones(1, 4).to(d)),
    "index_fill_": lambda x, d: x.clone().index_fill_(0, I([-4], device=d), 1.0),
    "take": lambda x, d: torch.take(x, I([12], device=d)),
    "put_": lambda x, d: x.clone().put_(I([-13], device=d), I([1.0], device=d)),
    "nll_loss": lambda x, d: F.nll_loss(x, I([0, 1, 4], device=d)),
    "nll_loss_negative": lambda x, d: F.nll_loss(x, I([0, -2, 1], device=d)),
    "cross_entropy": lambda x, d: F.cross_entropy(x, I([0, 1, 9], device=d)),
    "cross_entropy_2d": lambda x, d: F.cross_entropy(x.reshape(1, 3, 2, 2), I([[[0, 1], [3, 0]]], device=d)),
    "embedding_bag": lambda x, d: F.embedding_bag(I([[0, 3]], device=d), x),
    "floor_divide": lambda x, d: I([3, 4], device=d) // I([1, 0], device=d),
    "floor_divide_scalar": lambda x, d: I([3, 4], device=d) // 0,
    "div_trunc": lambda x, d: torch.div(I([3], device=d), I([0], device=d), rounding_mode="trunc"),
    "div_floor_scalar": lambda x, d: torch.div(I([3], device=d), 0, rounding_mode="floor"),
    "remainder": lambda x, d: I([3], device=d) % I([0], device=d),
    "remainder_scalar": lambda x, d: I([3], device=d) % 0,
    "remainder_scalar_tensor": lambda x, d: torch.remainder(3, I([0], device=d)),
    "fmod": lambda x, d: torch.fmod(I([3], device=d), I([0], device=d)),
    "fmod_scalar": lambda x, d: torch.fmod(I([3], device=d), 0),
    "floor_divide_int32": lambda x, d: I([3], dtype=torch.int32, device=d) // I([0], dtype=torch.int32, device=d),
    "float_index": lambda x, d: x[I([0.0], device=d)],
    "mask_shape": lambda x, d: x[I([True], device=d)],
    "mask_shape_dim1": lambda x, d: x[:, I([True, False], device=d)],
    "index_reduce_": lambda x, d: x.clone().index_reduce_(0, I([0, 3], device=d), _ones(2, 4).to(d), "amax"),
    "index_reduce_negative": lambda x, d: x.clone().index_reduce_(0, I([-1], device=d), _ones(1, 4).to(d), "prod"),
    "segment_reduce_sum": lambda x, d: torch.segment_reduce(x, "sum", lengths=I([1, 1], device=d)),
    "segment_reduce_negative": lambda x, d: torch.segment_reduce(x, "max", lengths=I([4, -1], device=d)),
    "segment_reduce_unsafe": lambda x, d: torch.segment_reduce(x, "sum", lengths=I([4, -1], device=d), unsafe=True),
    "lu_unpack": lambda x, d: torch.lu_unpack(x[:, :3].to(d), I([1, 4, 3], dtype=torch.int32, device=d)),
    "lu_unpack_zero": lambda x, d: torch.lu_unpack(x[:, :3].to(d), I([0, 2, 3], dtype=torch.int32, device=d)),
    "segment_reduce_offsets": lambda x, d: torch.segment_reduce(x, "sum", offsets=I([0, 2, 1, 3], device=d)),
    # Empty tensors: CPU raises all the same, with messages of its own.
    "advanced_index_empty_dim": lambda x, d: _zeros(d, 0)[I([0], device=d)],
    "index_put_empty_dim": lambda x, d: _zeros(d, 0, 3).index_put_((I([5], device=d),), I(1.0, device=d)),
    "index_select_empty_self": lambda x, d: _zeros(d, 0, 3).index_select(1, I([3], device=d)),
    "index_select_empty_dim": lambda x, d: _zeros(d, 3, 0).index_select(1, I([0], device=d)),
    "index_select_1d_empty": lambda x, d: _zeros(d, 0).index_select(0, I([0], device=d)),
    "embedding_empty_weight": lambda x, d: F.embedding(I([0], device=d), _zeros(d, 0, 3)),
    "gather_empty_dim": lambda x, d: _zeros(d, 0, 3).gather(0, I([[0, 0, 0]], device=d)),
    "index_add_1d": lambda x, d: _zeros(d, 3).index_add(0, I([5], device=d), _ones(1).to(d)),
    "put_empty": lambda x, d: _zeros(d, 0).put_(I([0], device=d), _ones(1).to(d)),
    "embedding_bag_empty_weight": lambda x, d: F.embedding_bag(I([[0]], device=d), _zeros(d, 0, 3)),
    "cross_entropy_2d_no_classes": lambda x, d: F.cross_entropy(_zeros(d, 1, 0, 2, 2), I([[[0, 0], [0, 0]]], device=d)),
}

# Valid inputs of the same ops: same results as CPU, no error.
GOOD = {
    "advanced_index_negative": lambda x, d: x[I([-1, -3], device=d)],
    "index_put_negative": lambda x, d: x.clone().index_put_((I([-3], device=d),), I(1.0, device=d)),
    "index_fill_negative": lambda x, d: x.clone().index_fill_(0, I([-1], device=d), 1.0),
    "take_negative": lambda x, d: torch.take(x, I([-12, 11], device=d)),
    "segment_reduce_unsafe": lambda x, d: torch.segment_reduce(x, "mean", lengths=I([1, 1], device=d), unsafe=True),
    "cross_entropy_ignore_index": lambda x, d: F.cross_entropy(x, I([0, 1, -100], device=d)),
    "nll_loss_ignore_index": lambda x, d: F.nll_loss(x, I([0, 7, 1], device=d), ignore_index=7),
    "true_division_by_zero": lambda x, d: I([3], device=d) / I([0], device=d),
    "float_floor_divide_by_zero": lambda x, d: x.to(d) // 0,
    "float_fmod_by_zero": lambda x, d: torch.fmod(x.to(d), 0.0),
    "div_no_rounding_by_zero": lambda x, d: torch.div(I([3], device=d), I([0], device=d), rounding_mode=None),
    # Indices that select nothing: CPU reads none of them, so none is checked.
    "advanced_index_broadcast_to_nothing": lambda x, d: _zeros(d, 0, 0, 10, 0)[
        :, _zeros(d, 5, 5, 0, dtype=torch.long), :, _zeros(d, 5, 5, 1, dtype=torch.long)
    ],
    "advanced_index_bad_index_broadcast_to_nothing": lambda x, d: x.to(d)[
        _zeros(d, 0, 1, dtype=torch.long), I([[7]], device=d)
    ],
    "advanced_index_empty_result": lambda x, d: _zeros(d, 3, 0)[I([5], device=d)],
    "advanced_index_empty_result_dim1": lambda x, d: _zeros(d, 0, 3)[:, I([5], device=d)],
    "index_put_broadcast_to_nothing": lambda x, d: _zeros(d, 3, 4).index_put_(
        (_zeros(d, 0, 1, dtype=torch.long), I([[7]], device=d)), I(1.0, device=d)
    ),
    "index_put_empty_slices": lambda x, d: _zeros(d, 3, 0).index_put_((I([5], device=d),), I(1.0, device=d), True),
    "index_add_empty_self": lambda x, d: _zeros(d, 0, 3).index_add(1, I([5], device=d), _zeros(d, 0, 1)),
    "index_copy_empty_slices": lambda x, d: _zeros(d, 3, 0).index_copy(0, I([5], device=d), _zeros(d, 1, 0)),
    "index_fill_empty_slices": lambda x, d: _zeros(d, 0, 3).index_fill(1, I([5], device=d), 1.0),
    "embedding_dense_backward_no_weights": lambda x, d: torch.ops.aten.embedding_dense_backward(
        _zeros(d, 1, 3), I([0], device=d), 0, -1, False
    ),
    "embedding_dense_backward_empty_rows": lambda x, d: torch.ops.aten.embedding_dense_backward(
        _zeros(d, 1, 0), I([5], device=d), 3, -1, False
    ),
    # A zero divisor of no element computed.
    "floor_divide_nothing": lambda x, d: _zeros(d, 0, N, dtype=torch.long) // _zeros(d, N, dtype=torch.long),
    "remainder_nothing": lambda x, d: _zeros(d, 0, N, dtype=torch.long) % _zeros(d, N, dtype=torch.long),
    "fmod_nothing": lambda x, d: torch.fmod(_zeros(d, 0, N, dtype=torch.long), _zeros(d, N, dtype=torch.long)),
    "div_trunc_nothing": lambda x, d: torch.div(
        _zeros(d, 0, N, dtype=torch.long), _zeros(d, N, dtype=torch.long), rounding_mode="trunc"
    ),
}


def _cpu_error(fn):
    with pytest.raises(Exception) as info:
        fn(X.clone(), "cpu")
    return info.value


def _run(fn, x, d):
    r = fn(x, d)
    xm.mark_step()
    return r


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_what_cpu_raises(name):
    fn = BAD[name]
    expected = _cpu_error(fn)
    with pytest.raises(type(expected)) as info:
        _run(fn, X.to("xla"), "xla")
        xm.mark_step()
    msg = str(info.value)
    # CPU's text, up to the dimension it names (CPU names dim 0 for x[:, idx]; the device names dim 1).
    assert str(expected).split(" for dimension")[0] in msg
    if "indices must be" not in msg and "mask" not in msg:  # raised at the call, not by a device check
        assert "(aten::" in msg and "at tests/test_checks.py:" in msg, msg
    xm.mark_step()  # nothing is left pending


@pytest.mark.parametrize("name", sorted(GOOD))
def test_valid_inputs_match_cpu(name):
    fn = GOOD[name]
    expected = fn(X.clone(), "cpu")
    got = _run(fn, X.to("xla"), "xla")
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True)


def test_a_failed_check_poisons_only_its_dependents():
    x = X.to("xla")
    good = x * 2
    bad = x[I([0, 5], device="xla")]
    worse = bad.sum() + good.sum()  # reads the bad op
    xm.mark_step()  # runs the step; its checks are read when its results are next needed
    with pytest.raises(IndexError, match="out of bounds for dimension 0 with size 3") as info:
        good.cpu()
    assert "XLATORCH_CHECKS=sync" in "".join(info.value.__notes__)
    torch.testing.assert_close(good.cpu(), X * 2)  # committed
    for t in (bad, worse):
        with pytest.raises(FailedValueError, match="index 5 is out of bounds"):
            t.cpu()
    torch.testing.assert_close((x + 1).cpu(), X + 1)  # later work runs


def test_item_of_a_bad_loss_raises_there_naming_the_line():
    logits = torch.randn(4, 5, device="xla")
    loss = F.cross_entropy(logits, I([0, 1, 2, 5], device="xla"))
    line = sys._getframe().f_lineno - 1
    where = rf"\(aten::nll_loss_forward at .*test_checks.py:{line},"
    with pytest.raises(IndexError, match=r"Target 5 is out of bounds\. " + where):
        loss.item()


def test_bad_targets_raise_in_backward_too():
    # The forward was synced on its own (with valid targets); the backward reads bad ones.
    logits = torch.randn(4, 5, device="xla", requires_grad=True)
    target = I([0, 1, 2, 3], device="xla")
    loss = F.cross_entropy(logits, target)
    xm.mark_step()
    target.fill_(7)
    with torch.no_grad():
        grad = torch.ops.aten.nll_loss_backward(torch.ones(()).to("xla"), logits.log_softmax(1), target, None, 1, -100,
                                                torch.tensor(4.0).to("xla"))  # fmt: skip
    xm.mark_step()
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        xm.mark_step()  # the next sync reads the rows first
    with pytest.raises(FailedValueError):
        grad.cpu()
    loss.cpu()  # the forward's value was committed before


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
            if record:
                record.before(model.parameters())
            opt.step()
            if record:
                record.after(model.parameters())
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
        F.cross_entropy(model(x), t * 1 if computed else t).backward()
        if record:
            record.before(model.parameters())
        opt.step()
        if record:
            record.after(model.parameters())
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


def test_checks_do_not_recompile_or_cut_graphs():
    w = torch.randn(10, 4, device="xla")
    xm.mark_step()
    met.clear_all()
    for i in range(4):
        idx = I([i, i + 1, 9], device="xla")
        y = F.embedding(idx, w) * 2 + torch.gather(w, 1, I([[1]] * 10, device="xla")).sum()
        xm.mark_step()
    assert met.metric_data("CompileTime")[0] == 1
    assert met.counter_value("UncachedCompile") == 1
    assert met.counter_value("CachedCompile") == 3
    torch.testing.assert_close(y.cpu(), F.embedding(I([3, 4, 9]), w.cpu()) * 2 + w.cpu()[:, 1].sum())


def test_mark_step_does_not_wait_to_read_the_checks():
    w = torch.randn(10, 4, device="xla")
    xm.mark_step()
    met.clear_all()
    for i in range(3):
        # Indices computed on the device: checked there (the host's own are checked before the step).
        w.add_(F.embedding(I([i, 9], device="xla") * 1, w).sum())
        xm.mark_step()  # reads the rows of the step before, if any (it has finished or is running)
        assert (met.counter_value("CheckRowsRead") or 0) == i
    w.cpu()
    assert met.counter_value("CheckRowsRead") == 3


def test_once_a_second_thread_uses_the_device_each_step_reads_its_own_checks():
    """Reading a step's rows from another thread would undo that step in the middle of its
    thread's tracing: from the first step of a second thread, every sync reads its own rows."""
    import threading

    w = torch.randn(10, 4, device="xla")
    xm.mark_step()
    w.add_(F.embedding(I([1, 2], device="xla") * 1, w).sum())  # checked on the device
    xm.mark_step()
    met.clear_all()
    xm.mark_step()  # one thread so far: the rows of the step before are read now, not at its own sync
    assert met.counter_value("CheckRowsRead") == 1
    errors = []

    def other():
        try:
            v = torch.randn(10, 4, device="xla")
            v.add_(F.embedding(I([3, 9], device="xla") * 1, v).sum())
            xm.mark_step()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors == [] and met.counter_value("CheckRowsRead") == 2  # read by its own sync
    w.add_(F.embedding(I([4, 12], device="xla") * 1, w).sum())  # 12: out of range
    with pytest.raises(IndexError, match="index out of range|out of bounds"):
        xm.mark_step()  # the step's own sync raises


def _script(code: str, checks: str):
    env = dict(os.environ, XLATORCH_CHECKS=checks)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_failed_check_names_the_line_of_code_with_no_file():
    """``python -c`` (or stdin, ``exec``, a notebook cell): its line, never ``?``."""
    code = (
        "import torch, xlatorch\n"
        "x = torch.zeros(3, device='xla')\n"
        "try:\n"
        "    x[torch.tensor([5], device='xla')].cpu()\n"
        "except IndexError as e:\n"
        "    print(e)\n"
    )
    out = _script(code, "1")
    assert out.returncode == 0, out.stderr
    assert "index 5 is out of bounds for dimension 0 with size 3 (aten::index.Tensor at <string>:4," in out.stdout


def test_checks_can_be_turned_off():
    code = (
        "import torch, xlatorch\n"
        "x = torch.arange(3.0, device='xla')\n"
        "print(torch.index_select(x, 0, torch.tensor([5], device='xla')).cpu().tolist())\n"
        "print((torch.tensor([3], device='xla') // 0).cpu().tolist())\n"
    )
    out = _script(code, "0")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert len(lines) == 2  # XLA's own behaviour (clamped index, a number), no error


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


def test_a_copy_of_ready_data_with_no_checked_op_pending_runs_nothing():
    buf = torch.zeros(3, device="xla")
    src = torch.ones(3, device="xla")
    y = torch.arange(3.0, device="xla")[I([0, 2], device="xla")]  # checked, but synced below
    xm.mark_step()
    met.clear_all()
    buf.copy_(src)  # the data itself: no graph
    xm.mark_step()
    assert not met.counter_value("CachedCompile") and not met.counter_value("UncachedCompile")
    torch.testing.assert_close(buf.cpu(), torch.ones(3))
    torch.testing.assert_close(y.cpu(), torch.tensor([0.0, 2.0]))


def test_sync_mode_raises_at_the_failed_steps_mark_step():
    code = (
        "import torch, xlatorch, xlatorch.core.xla_model as xm\n"
        "x = torch.arange(3.0, device='xla')\n"
        "y = x[torch.tensor([5], device='xla')]\n"
        "try:\n"
        "    xm.mark_step()\n"
        "except IndexError as e:\n"
        "    print('raised by mark_step:', e)\n"
    )
    out = _script(code, "sync")
    assert out.returncode == 0, out.stderr
    assert "raised by mark_step: index 5 is out of bounds" in out.stdout
    out = _script(code, "1")  # read late: this program never needs the results, so exit reports it
    assert "raised by mark_step" not in out.stdout
    assert out.returncode == 1
    assert "IndexError: index 5 is out of bounds" in out.stderr


def test_a_program_that_ends_after_a_failed_step_exits_with_its_error():
    code = (
        "import torch, xlatorch, xlatorch.core.xla_model as xm\n"
        "w = torch.zeros(3, device='xla')\n"
        "w.add_(torch.ones(3, device='xla')[torch.tensor([0, 9, 1], device='xla')])\n"
        "xm.mark_step()\n"
        "print('done')\n"
    )
    out = _script(code, "1")
    assert out.stdout.strip() == "done"
    assert out.returncode == 1
    assert "IndexError: index 9 is out of bounds" in out.stderr and "XLATORCH_CHECKS=sync" in out.stderr


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


def test_a_compiled_graphs_checks_stay_on_the_device():
    """A node holding a whole graph (torch.compile's, a loop's body) is checked on the device,
    even over indices the host holds: only ops.yaml's own checks are computed on the host."""
    w = torch.randn(10, 4).to("xla")
    f = torch.compile(lambda w, i: F.embedding(i, w) * 2, backend="openxla")
    xm.mark_step()
    met.clear_all()
    got = f(w, I([1, 9], device="xla"))
    xm.mark_step()
    torch.testing.assert_close(got.cpu(), F.embedding(I([1, 9]), w.cpu()) * 2)
    assert not met.counter_value("ChecksOnHost")
    with pytest.raises(IndexError, match="index out of range"):
        f(w, I([1, 12], device="xla")).cpu()
