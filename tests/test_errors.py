"""Errors keep their cause and never take unrelated work (or the process) down with them."""

import threading

import pytest
import torch
from xlatorch._generated import dispatch as table

import xlatorch.core.xla_model as xm
from xlatorch.runtime.ir.failed import FailedValueError
from xlatorch.runtime.trace import dispatch as D
from xlatorch.runtime.trace import tensor as T


def test_a_failed_sync_poisons_only_its_tensors(monkeypatch, no_cached_executables):
    a = torch.ones(3, device="xla")
    xm.mark_step()

    def broken(out, self):
        raise ZeroDivisionError("lowering exploded")

    monkeypatch.setattr(table.S_sin, "emit", broken)
    b = a.sin()
    with pytest.raises(ZeroDivisionError, match="lowering exploded"):
        xm.mark_step()
    monkeypatch.undo()
    c = a * 3  # later, unrelated work runs
    xm.mark_step()
    torch.testing.assert_close(c.cpu(), torch.full((3,), 3.0))
    with pytest.raises(FailedValueError, match="lowering exploded"):
        b.cpu()
    d = b + 1  # work that reads the failed tensor fails with the same cause...
    e = a + 1  # ...while work traced alongside it still runs
    with pytest.raises(FailedValueError, match="lowering exploded"):
        xm.mark_step()
    torch.testing.assert_close(e.cpu(), torch.full((3,), 2.0))
    with pytest.raises(FailedValueError, match="lowering exploded"):
        d.cpu()


def test_an_error_in_backward_is_raised_at_the_next_sync(monkeypatch):
    # On autograd's device thread an exception cannot propagate (torch aborts); it must
    # surface on the main thread instead, naming the op.
    orig = D.dispatch

    def flaky(func, args, kwargs):
        if func is torch.ops.aten.mul.Tensor and threading.current_thread() is not threading.main_thread():
            raise ValueError("backward kernel failed")
        return orig(func, args, kwargs)

    x = torch.randn(3).to("xla").requires_grad_()
    monkeypatch.setattr(T, "DISPATCH", flaky)
    (x * x).sum().backward()
    monkeypatch.undo()
    with pytest.raises(FailedValueError, match=r"aten::mul failed in a backward pass: ValueError: backward kernel"):
        x.grad.cpu()
    y = x * 2
    torch.testing.assert_close(y.cpu(), x.detach().cpu() * 2)


class _ItemInBackward(torch.autograd.Function):
    """A backward that reads a device value on the host (as data-dependent backwards do)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (scale,) = ctx.saved_tensors
        return g * scale.item(), None


def test_a_sync_in_backward_neither_aborts_nor_raises_an_older_error(monkeypatch):
    # A failed value left over from an earlier backward pass, then a backward pass whose
    # own sync (on autograd's device thread) meets it: the process must survive, and the
    # old error belongs to the thread that made it, not to this backward pass.
    test_an_error_in_backward_is_raised_at_the_next_sync(monkeypatch)
    x = torch.randn(3).to("xla").requires_grad_()
    scale = torch.tensor(3.0).to("xla")
    _ItemInBackward.apply(x, scale).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 3.0))


def test_a_failed_read_in_backward_raises_from_backward(monkeypatch, no_cached_executables):
    # .item() of a failed value on autograd's device thread: nothing may raise there (the
    # process would abort), so backward() raises it in the thread that called it.
    from xlatorch._generated import dispatch as table

    def broken(out, self):
        raise ZeroDivisionError("lowering exploded")

    x = torch.randn(3).to("xla").requires_grad_()
    xm.mark_step()
    monkeypatch.setattr(table.S_sin, "emit", broken)
    scale = torch.ones((), device="xla").sin()
    with pytest.raises(ZeroDivisionError):
        xm.mark_step()
    monkeypatch.undo()
    with pytest.raises(FailedValueError, match="lowering exploded"):
        _ItemInBackward.apply(x, scale).sum().backward()
    y = x * 2  # the thread carries on
    torch.testing.assert_close(y.cpu(), x.detach().cpu() * 2)
