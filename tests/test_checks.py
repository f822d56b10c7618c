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
from tests import warm
from tests.cpu_twin import refused_as_on_cpu
from xlatorch.runtime.ir.failed import FailedValueError

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


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
    "pow_negative_scalar": lambda x, d: I([2, 3], device=d) ** -1,
    "pow_negative_scalar_int8": lambda x, d: I([2], dtype=torch.int8, device=d).pow(-2),
    "pow_negative_scalar_inplace": lambda x, d: I([2, 4], device=d).pow_(-1),
    "pow_negative_scalar_empty": lambda x, d: _zeros(d, 0, dtype=torch.long) ** -1,
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
    # F.one_hot: PyTorch's composite for an accelerator compares with arange and checked nothing
    # (a class out of range gave a row of zeros)
    "one_hot_class_too_large": lambda x, d: F.one_hot(torch.tensor([0, 5], device=d), 3),
    "one_hot_negative_class": lambda x, d: F.one_hot(torch.tensor([2, -1], device=d), 3),
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
    "pow_negative_tensor_exponent": lambda x, d: I([2, 3, 1, -1, 0, -2], device=d).pow(
        I([-1, -2, -3, -3, 2, -1], device=d)
    ),
    "pow_int_by_negative_float": lambda x, d: I([2, 4], device=d) ** -0.5,
    "pow_int_by_zero_and_positive": lambda x, d: I([2, -3], device=d) ** 0 + I([2, -3], device=d) ** 3,
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
    "one_hot": lambda x, d: F.one_hot(torch.tensor([0, 2, 1], device=d), 3),
    "one_hot_classes_read": lambda x, d: F.one_hot(torch.tensor([1, 4], device=d)),
    "one_hot_nothing": lambda x, d: F.one_hot(torch.zeros(0, 2, dtype=torch.long, device=d), 3),
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
        # Indices computed on the device (through a float; integer arithmetic on the host's ids is the
        # host's too): checked there (the host's own are checked before the step).
        w.add_(F.embedding(I([i, 9], device="xla").float().long(), w).sum())
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
    w.add_(F.embedding(I([1, 2], device="xla").float().long(), w).sum())  # checked on the device
    xm.mark_step()
    met.clear_all()
    xm.mark_step()  # one thread so far: the rows of the step before are read now, not at its own sync
    assert met.counter_value("CheckRowsRead") == 1
    errors = []

    def other():
        try:
            v = torch.randn(10, 4, device="xla")
            v.add_(F.embedding(I([3, 9], device="xla").float().long(), v).sum())
            xm.mark_step()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors == [] and met.counter_value("CheckRowsRead") == 2  # read by its own sync
    w.add_(F.embedding(I([4, 12], device="xla").float().long(), w).sum())  # 12: out of range
    with pytest.raises(IndexError, match="index out of range|out of bounds"):
        xm.mark_step()  # the step's own sync raises


def _script(code: str, checks: str, run=warm.run):
    env = dict(os.environ, XLATORCH_CHECKS=checks)
    return run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


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
    out = _script(code, "1", run=subprocess.run)  # a fresh interpreter: no file on the stack below the code
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


_SPD = torch.tensor([[4.0, 2.0, 0.0], [2.0, 5.0, 1.0], [0.0, 1.0, 3.0]])
_NOT_PD = torch.tensor([[4.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])  # leading minor of order 2: 0

# Factorizations CPU refuses on the data (LAPACK's info): the device returned NaNs or infinities.
_LINALG = {
    "cholesky, minor 2": lambda d: torch.linalg.cholesky(_NOT_PD.to(d)),
    "cholesky, minor 1": lambda d: torch.linalg.cholesky(-torch.eye(2, device=d)),
    "cholesky of a batch": lambda d: torch.linalg.cholesky(torch.stack([_SPD, _NOT_PD]).to(d)),
    "cholesky(upper=True)": lambda d: torch.linalg.cholesky(_NOT_PD.to(d), upper=True),
    "inv of ones": lambda d: torch.linalg.inv(torch.ones(2, 2, device=d)),
    "inv, zero row": lambda d: torch.linalg.inv(torch.tensor([[1.0, 2, 3], [4, 5, 6], [0, 0, 0]], device=d)),
    "inverse of a batch": lambda d: torch.stack([torch.eye(2), torch.ones(2, 2)]).to(d).inverse(),
    "inv of complex ones": lambda d: torch.linalg.inv(torch.ones(2, 2, dtype=torch.cfloat, device=d)),
    "solve": lambda d: torch.linalg.solve(torch.ones(2, 2, device=d), torch.ones(2, device=d)),
    "lu_factor": lambda d: torch.linalg.lu_factor(torch.zeros(2, 2, device=d)),
}


@pytest.mark.parametrize("name", sorted(_LINALG))
def test_a_factorization_cpu_refuses_raises_cpus_error(name):
    """``linalg.cholesky`` / ``inv`` / ``solve`` / ``lu_factor`` read their factorization's info,
    as on CUDA (the ``_ex`` variants do not), and raise CPU's LinAlgError word for word."""
    refused_as_on_cpu(_LINALG[name], at_call=True)


def test_the_ex_variants_report_cpus_info_without_raising():
    for a in (_SPD, _NOT_PD, -torch.eye(3), torch.stack([_SPD, _NOT_PD])):
        assert torch.equal(torch.linalg.cholesky_ex(a.to("xla")).info.cpu(), torch.linalg.cholesky_ex(a).info)
    for a in (torch.ones(2, 2), torch.tensor([[1.0, 2, 3], [4, 5, 6], [0, 0, 0]]), _SPD):
        assert torch.equal(torch.linalg.inv_ex(a.to("xla")).info.cpu(), torch.linalg.inv_ex(a).info)
        assert torch.equal(torch.linalg.lu_factor_ex(a.to("xla")).info.cpu(), torch.linalg.lu_factor_ex(a).info)
    torch.testing.assert_close(torch.linalg.inv(_SPD.to("xla")).cpu(), torch.linalg.inv(_SPD))
    torch.testing.assert_close(torch.linalg.cholesky(_SPD.to("xla")).cpu(), torch.linalg.cholesky(_SPD))


def test_a_compiled_factorization_is_checked_on_the_device():
    """Under ``torch.compile``, ``_linalg_check_errors`` (an op with side effects in the AOT graph:
    ``with_effects``) is an on-device check of the one compiled graph, with CPU's message; the
    function failed to run at all before."""

    def f(a):
        return torch.linalg.cholesky(a).sum() + torch.linalg.inv(a).sum()

    g = torch.compile(f, backend="openxla")
    torch.testing.assert_close(g(_SPD.to("xla")).cpu(), f(_SPD))
    with pytest.raises(torch.linalg.LinAlgError) as cpu:
        f(_NOT_PD)
    with pytest.raises(torch.linalg.LinAlgError) as xla:
        g(_NOT_PD.to("xla")).cpu()
    assert str(xla.value).startswith(str(cpu.value))
    assert met.counter_value("CompiledGraphOpByOp") in (None, 0)
