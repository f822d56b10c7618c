"""Ops without a lowering run on CPU, correctly, and are counted."""

import pytest
import torch
import torch.nn.functional as F

import xlatorch.debug.metrics as met


def test_unlisted_op_falls_back_with_counter():
    cpu = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    x = cpu.to("xla") * 2
    got = torch.special.bessel_j0(x)
    assert got.device.type == "xla" and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), torch.special.bessel_j0(cpu * 2))
    assert met.counter_value("aten::special_bessel_j0") == 1
    assert met.executed_fallback_ops() == ["aten::special_bessel_j0"]
    assert "Counter: aten::special_bessel_j0\n  Value: 1" in met.metrics_report()
    # The result keeps working on the device.
    torch.testing.assert_close((got + 1).cpu(), torch.special.bessel_j0(cpu * 2) + 1)


def test_declared_fallback_is_counted():
    cpu = torch.tensor([3, 1, 3, 2, 1])
    got = torch.unique(cpu.to("xla"))
    assert torch.equal(got.cpu(), torch.unique(cpu))
    assert met.counter_value("aten::_unique2") == 1


def test_inplace_fallback_writes_back():
    cpu = torch.tensor([3.0, 1.0, 2.0])
    x = cpu.to("xla")
    out = torch.empty(3, device="xla")
    res = torch.special.bessel_j0(x, out=out)  # an out= fallback writes its result back to the device
    assert res is out
    torch.testing.assert_close(out.cpu(), torch.special.bessel_j0(cpu))
    assert met.counter_value("aten::special_bessel_j0") == 1


def test_a_packed_sequence_keeps_its_batch_sizes_on_the_host_and_runs_as_on_cpu():
    """``_pack_padded_sequence`` falls back; its ``batch_sizes`` stay on the CPU, where PyTorch
    keeps them on every device (nn.utils.rnn rejects them elsewhere)."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    gru = torch.nn.GRU(3, 4, batch_first=True, bidirectional=True)
    x = torch.randn(3, 5, 3)
    got, want = [], []
    for dev, out in (("cpu", want), ("xla", got)):
        g = gru.to(dev)
        packed = pack_padded_sequence(x.to(dev), torch.tensor([5, 3, 2]), batch_first=True)
        assert packed.batch_sizes.device.type == "cpu" and packed.data.device.type == dev
        o, h = g(packed)
        padded, lengths = pad_packed_sequence(o, batch_first=True)
        out += [padded.detach().cpu(), lengths, h.detach().cpu()]
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lengths", ["cpu tensors", "device tensors", "tuples"])
def test_ctc_loss_takes_its_lengths_as_cpu_tensors_as_cuda_does(reduction, lengths):
    """``F.ctc_loss`` with the lengths as CPU tensors (what CUDA accepts, and the usual
    DataLoader output): PyTorch's composite kept them as tensors for a subclass and divided
    the device loss by them, which raised the mixed-device error where CPU and CUDA run.
    Loss and gradient against CPU."""
    torch.manual_seed(0)
    t, n, c = 12, 3, 6
    lp = torch.randn(t, n, c).log_softmax(2)
    targets = torch.randint(1, c, (n, 4))
    il, tl = torch.full((n,), t, dtype=torch.long), torch.tensor([4, 3, 2])
    res = {}
    for dev in ("cpu", "xla"):
        x = lp.to(dev).requires_grad_()
        if lengths == "cpu tensors":
            lens = (il, tl)
        elif lengths == "device tensors":
            lens = (il.to(dev), tl.to(dev))
        else:
            lens = (tuple(il.tolist()), tuple(tl.tolist()))
        loss = F.ctc_loss(x, targets.to(dev), *lens, reduction=reduction)
        (g,) = torch.autograd.grad(loss.sum(), x)
        res[dev] = loss.detach().cpu(), g.cpu()
    for got, want in zip(res["xla"], res["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ctc_loss_lengths_of_a_float_dtype_raise_pytorchs_error():
    lp = torch.randn(5, 2, 4, device="xla").log_softmax(2)
    with pytest.raises(RuntimeError, match="input_lengths must be integral"):
        F.ctc_loss(lp, torch.ones(2, 2, dtype=torch.long), torch.tensor([5.0, 5.0]), torch.tensor([2, 2]))
