"""Data-dependent shapes and resize_: exact results vs CPU, declared graph cuts counted, no fallbacks."""

import pytest
import torch

import xlatorch.debug.metrics as met

X = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])


def _transfers() -> int:
    data = met.metric_data("TransferFromDeviceTime")
    return data[0] if data else 0


def test_nonzero_is_lowered_with_one_cut():
    x = X.to("xla") * 2  # pending: the count needs a graph cut
    got = torch.nonzero(x)
    assert met.counter_value("xla::nonzero") == 1
    assert met.executed_fallback_ops() == []
    assert got.shape == (3, 2) and got.dtype == torch.int64
    assert torch.equal(got.cpu(), torch.nonzero(X * 2))
    assert torch.equal((got + 1).cpu(), torch.nonzero(X) + 1)


def test_nonzero_edge_cases():
    for cpu in (torch.zeros(4), torch.tensor(3.0), torch.tensor(0.0), torch.ones(2, 0, 3), torch.tensor([True, False])):
        assert torch.equal(torch.nonzero(cpu.to("xla")).cpu(), torch.nonzero(cpu))
    assert met.executed_fallback_ops() == []


def test_masked_select_and_backward():
    x = X.clone().requires_grad_()
    m = X > 0
    xx = X.to("xla").requires_grad_()
    got = torch.masked_select(xx, m.to("xla"))
    ref = torch.masked_select(x, m)
    assert torch.equal(got.cpu(), ref)
    (g,) = torch.autograd.grad(got, xx, torch.arange(2.0).to("xla"))
    (rg,) = torch.autograd.grad(ref, x, torch.arange(2.0))
    assert torch.equal(g.cpu(), rg)
    assert met.counter_value("xla::masked_select") == 1
    assert met.executed_fallback_ops() == []


def test_masked_select_broadcasts():
    m = torch.tensor([True, False, True])
    assert torch.equal(torch.masked_select(X.to("xla"), m.to("xla")).cpu(), torch.masked_select(X, m))


def test_boolean_mask_indexing():
    m = X != 0
    xx = X.to("xla")
    assert torch.equal(xx[m.to("xla")].cpu(), X[m])
    assert torch.equal(xx[:, torch.tensor([True, False, True]).to("xla")].cpu(), X[:, [True, False, True]])
    assert met.executed_fallback_ops() == []


def test_mask_assignment_needs_no_cut():
    xx = X.to("xla")
    m = (xx > 0).clone()
    before = _transfers()
    xx[m] = 7.0
    xx[m.logical_not()] = torch.tensor([1.0, 2.0, 3.0, 4.0]).to("xla")
    assert _transfers() == before  # a lone mask is lowered with static shapes
    ref = X.clone()
    ref[X > 0] = 7.0
    ref[~(X > 0)] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(xx.cpu(), ref)
    assert met.executed_fallback_ops() == []


def test_index_put_accumulate_with_duplicates():
    idx = torch.tensor([0, 2, 0])
    v = torch.tensor([1.0, 2.0, 3.0])
    ref = torch.zeros(3).index_put((idx,), v, accumulate=True)
    got = torch.zeros(3).to("xla").index_put((idx.to("xla"),), v.to("xla"), accumulate=True)
    assert torch.equal(got.cpu(), ref)


def test_unique_is_a_declared_fallback():
    x = torch.tensor([3, 1, 3, 2])
    assert torch.equal(torch.unique(x.to("xla")).cpu(), torch.unique(x))
    assert met.executed_fallback_ops() == ["aten::_unique2"]


@pytest.mark.parametrize("size", [(3, 2), (2,), (8,), (0,)])
def test_resize_(size):
    cpu = torch.arange(6.0).reshape(2, 3)
    xx = cpu.to("xla")
    xx.resize_(size)
    assert tuple(xx.shape) == size
    n = min(cpu.numel(), xx.numel())
    assert torch.equal(xx.cpu().reshape(-1)[:n], cpu.reshape(-1)[:n])
    assert met.executed_fallback_ops() == []


def test_out_of_fresh_tensor_resizes():
    out = torch.empty(0, device="xla")
    torch.sort(torch.tensor([3.0, 1.0, 2.0]).to("xla"), out=(out, torch.empty(0, dtype=torch.long, device="xla")))
    assert torch.equal(out.cpu(), torch.tensor([1.0, 2.0, 3.0]))


def test_as_strided_gather_and_write():
    cpu = torch.arange(12.0)
    xx = cpu.to("xla")
    assert torch.equal(xx.as_strided((3, 3), (1, 3), 1).cpu(), cpu.as_strided((3, 3), (1, 3), 1))
    ref = cpu.clone()
    ref.as_strided((2, 2), (4, 1), 2).fill_(-1)
    xx.as_strided((2, 2), (4, 1), 2).fill_(-1)
    assert torch.equal(xx.cpu(), ref)


def test_fft_roundtrip_complex():
    x = torch.randn(4, 6)
    xx = x.to("xla")
    assert torch.allclose(torch.fft.rfft(xx, norm="ortho").cpu(), torch.fft.rfft(x, norm="ortho"), atol=1e-5)
    assert torch.allclose(torch.fft.irfft(torch.fft.rfft(xx), n=6).cpu(), x, atol=1e-5)
    c = torch.randn(5, dtype=torch.complex64)
    assert torch.allclose(
        torch.fft.ifft(c.to("xla"), norm="forward").cpu(), torch.fft.ifft(c, norm="forward"), atol=1e-5
    )
    assert met.executed_fallback_ops() == []


@pytest.mark.parametrize("invert", [False, True])
def test_isin_large_sorts_test_elements(invert):
    """Past the pairwise limit isin sorts the test elements: duplicates, NaN and signed zeros as on CPU."""
    g = torch.Generator().manual_seed(0)
    elements = torch.randint(-50, 50, (64, 40), generator=g).float() / 4
    elements[0, :3] = torch.tensor([float("nan"), -0.0, 0.0])
    test = torch.cat([torch.randint(-50, 50, (30000,), generator=g).float() / 8, torch.tensor([float("nan"), 0.0])])
    assert elements.numel() * test.numel() > 1 << 20  # the sort path (sort.py _ISIN_PAIRWISE_MAX)
    got = torch.isin(elements.to("xla"), test.to("xla"), invert=invert)
    assert torch.equal(got.cpu(), torch.isin(elements, test, invert=invert))
    assert met.executed_fallback_ops() == []


def test_copy_views_write_tensor_lists_out():
    """``unbind_copy`` / ``split_copy`` ``out=`` take a list of tensors, fill each, return None."""
    x = torch.arange(12.0).reshape(3, 4)
    aten = torch.ops.aten
    cases = [
        (aten.unbind_copy.int, aten.unbind_copy.int_out, (1,)),
        (aten.split_copy.Tensor, aten.split_copy.Tensor_out, (3, 1)),
        (aten.split_with_sizes_copy.default, aten.split_with_sizes_copy.out, ([1, 2], 0)),
    ]
    for fn, op, args in cases:
        want = [torch.full_like(t, -1) for t in fn(x, *args)]  # CPU needs out tensors of the right shapes
        op(x, *args, out=want)
        got = [torch.full(w.shape, -1.0, device="xla") for w in want]
        assert op(x.to("xla"), *args, out=got) is None
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)
    assert met.executed_fallback_ops() == []
