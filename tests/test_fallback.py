"""Ops without a lowering run on CPU, correctly, and are counted."""

import torch

import xlatorch.debug.metrics as met


def test_nonzero_falls_back_with_counter():
    cpu = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    x = cpu.to("xla") * 2
    got = torch.nonzero(x)
    assert got.device.type == "xla" and got.dtype == torch.int64
    assert torch.equal(got.cpu(), torch.nonzero(cpu * 2))
    assert met.counter_value("aten::nonzero") == 1
    assert met.executed_fallback_ops() == ["aten::nonzero"]
    assert "Counter: aten::nonzero\n  Value: 1" in met.metrics_report()
    # The result keeps working on the device.
    assert torch.equal((got + 1).cpu(), torch.nonzero(cpu) + 1)


def test_inplace_fallback_writes_back():
    cpu = torch.tensor([3.0, 1.0, 2.0])
    x = cpu.to("xla")
    torch.ops.aten.cumsum_(x, 0)
    assert torch.equal(x.cpu(), cpu.cumsum(0))
    assert met.counter_value("aten::cumsum_") == 1
