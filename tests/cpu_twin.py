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


def bfloat16_sums_as_cpu(got, want, exact, magnitude, terms) -> None:
    """Each element a bfloat16 sum of products. ``got`` (the device: summed in float32, rounded
    once) is within a bfloat16 rounding of ``exact`` (the float64 sum of the same bfloat16
    values). CPU's kernel may sum in bfloat16 itself (oneDNN on a CPU without bfloat16
    instructions, such as an AMD EPYC), so ``want`` is held to the bound of such a sum: (terms
    + 1) roundings of the sum of the terms' magnitudes. ``magnitude`` and ``terms``: per
    element, that sum and the count of terms (the same computation on absolute values, on ones)."""
    u = 2.0**-8  # bfloat16's unit roundoff
    got, want = got.cpu().double(), want.double()
    assert ((got - exact).abs() <= u * exact.abs() + 2.0**-20 * terms * magnitude).all()
    assert ((want - exact).abs() <= (terms + 1) * u * magnitude).all()
