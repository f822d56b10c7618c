"""A program run on CPU and on the xla device: CPU's refusal must be the device's, CPU's values
the device's. Each program is a function of the device (``"cpu"`` or ``"xla"``)."""

from __future__ import annotations

import pytest
import torch


def refused_as_on_cpu(program, *, at_call: bool = False, word_for_word: bool = True) -> None:
    """CPU raises for ``program``; the device raises the same exception type (when called, or
    when its result is read; ``at_call``: when called), with CPU's message (followed by where
    the device checked it)."""
    with pytest.raises(Exception) as cpu:  # noqa: PT011 - whatever CPU raises
        program("cpu")
    with pytest.raises(type(cpu.value)) as xla:
        res = program("xla")
        if not at_call and isinstance(res, torch.Tensor):
            res.cpu()
    if word_for_word:
        assert str(xla.value).split(" (aten::")[0] == str(cpu.value)


def runs_as_on_cpu(program, atol: float = 0, rtol: float = 0) -> None:
    """``program`` gives the device CPU's result: dtype, shape and values."""
    want, got = program("cpu"), program("xla")
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
