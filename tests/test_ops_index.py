"""Data-dependent shapes and resize_: exact results vs CPU, declared graph cuts counted, no fallbacks.
Index tensors of a dtype CPU rejects: CPU's error, at the call."""

import pytest
import torch
import torch.nn.functional as F

import xlatorch.debug.metrics as met
from tests.cpu_twin import refused_as_on_cpu, runs_as_on_cpu

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


def _z(d, *s):
    return torch.zeros(s, device=d)


def _i(d, dtype, *s):
    return torch.zeros(s, dtype=dtype, device=d)


aten = torch.ops.aten
F32, I16, I32, U8 = torch.float32, torch.int16, torch.int32, torch.uint8
# name -> (op over (device, index dtype), the index dtypes to try): every one raises on CPU, at
# the call, with an error naming the dtype CPU accepts for the op's index argument.
INDEX_DTYPES = {
    "index_select": (lambda d, t: _z(d, 3, 3).index_select(0, _i(d, t, 2)), [F32, I16, U8, torch.bool]),
    "gather": (lambda d, t: _z(d, 3, 3).gather(0, _i(d, t, 2, 2)), [F32, I16]),
    "scatter_src": (lambda d, t: _z(d, 3, 3).scatter(0, _i(d, t, 2, 2), _z(d, 2, 2)), [F32, U8]),
    "scatter_value": (lambda d, t: _z(d, 3, 3).scatter(0, _i(d, t, 2, 2), 1.0), [F32]),
    "scatter_reduce_legacy": (lambda d, t: _z(d, 3, 3).scatter(0, _i(d, t, 2, 2), _z(d, 2, 2), reduce="add"), [F32]),
    "scatter_value_reduce": (lambda d, t: _z(d, 3, 3).scatter(0, _i(d, t, 2, 2), 1.0, reduce="add"), [F32]),
    "scatter_": (lambda d, t: _z(d, 3, 3).scatter_(0, _i(d, t, 2, 2), 1.0), [F32]),
    "scatter_add": (lambda d, t: _z(d, 3, 3).scatter_add(0, _i(d, t, 2, 2), _z(d, 2, 2)), [F32]),
    "scatter_reduce": (lambda d, t: _z(d, 3, 3).scatter_reduce(0, _i(d, t, 2, 2), _z(d, 2, 2), "amax"), [F32]),
    "getitem": (lambda d, t: _z(d, 3, 3)[:, _i(d, t, 2)], [F32, I16]),
    "index_put_": (lambda d, t: _z(d, 3, 3).index_put_((_i(d, t, 2),), _z(d), accumulate=True), [F32]),
    "_index_put_impl_": (lambda d, t: aten._index_put_impl_(_z(d, 3, 3), [_i(d, t, 2)], _z(d)), [F32, I16]),
    "embedding": (lambda d, t: F.embedding(_i(d, t, 2), _z(d, 3, 3)), [F32, torch.bool]),
    "embedding_dense_backward": (
        lambda d, t: aten.embedding_dense_backward(_z(d, 2, 3), _i(d, t, 2), 3, -1, False),
        [F32, I16],
    ),
    "embedding_bag": (lambda d, t: F.embedding_bag(_i(d, t, 1, 2), _z(d, 3, 3)), [F32, I16]),
    "embedding_bag_offsets": (lambda d, t: F.embedding_bag(_i(d, torch.long, 2), _z(d, 3, 3), _i(d, t, 1)), [F32]),
    "embedding_renorm_": (lambda d, t: aten.embedding_renorm_(_z(d, 3, 3), _i(d, t, 2), 1.0, 2.0), [F32]),
    "take": (lambda d, t: _z(d, 3, 3).take(_i(d, t, 2)), [F32, I32]),
    "put": (lambda d, t: _z(d, 3, 3).put(_i(d, t, 2), _z(d, 2)), [F32, I32]),
    "put_": (lambda d, t: _z(d, 3, 3).put_(_i(d, t, 2), _z(d, 2), accumulate=True), [F32]),
    "index_add": (lambda d, t: _z(d, 3, 3).index_add(0, _i(d, t, 2), _z(d, 2, 3)), [F32, U8]),
    "index_add_": (lambda d, t: _z(d, 3, 3).index_add_(0, _i(d, t, 2), _z(d, 2, 3)), [F32]),
    "index_copy": (lambda d, t: _z(d, 3, 3).index_copy(0, _i(d, t, 2), _z(d, 2, 3)), [F32, I32]),
    "index_fill": (lambda d, t: _z(d, 3, 3).index_fill(0, _i(d, t, 2), 1.0), [F32, I32]),
    "index_fill_tensor_": (lambda d, t: _z(d, 3, 3).index_fill_(0, _i(d, t, 2), _z(d)), [F32]),
    "index_reduce": (lambda d, t: _z(d, 3, 3).index_reduce(0, _i(d, t, 2), _z(d, 2, 3), "amax"), [F32, torch.bool]),
    "nll_loss": (lambda d, t: F.nll_loss(_z(d, 2, 3), _i(d, t, 2)), [F32, I32]),
    "cross_entropy_2d": (lambda d, t: F.cross_entropy(_z(d, 2, 3, 2, 2), _i(d, t, 2, 2, 2)), [F32, U8]),
    "nll_loss_backward": (
        lambda d, t: aten.nll_loss_backward(_z(d), _z(d, 2, 3), _i(d, t, 2), None, 1, -100, _z(d)),
        [F32, I32],
    ),
    "max_pool2d_backward": (
        lambda d, t: aten.max_pool2d_with_indices_backward(
            _z(d, 1, 1, 2, 2), _z(d, 1, 1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False, _i(d, t, 1, 1, 2, 2)
        ),
        [F32, I32],
    ),
    "adaptive_max_pool2d_backward": (
        lambda d, t: aten.adaptive_max_pool2d_backward(_z(d, 1, 1, 2, 2), _z(d, 1, 1, 4, 4), _i(d, t, 1, 1, 2, 2)),
        [F32],
    ),
    "max_unpool2d": (lambda d, t: F.max_unpool2d(_z(d, 1, 1, 2, 2), _i(d, t, 1, 1, 2, 2), 2), [F32, I32]),
    "segment_reduce_lengths": (lambda d, t: torch.segment_reduce(_z(d, 4), "sum", lengths=_i(d, t, 2) + 2), [F32]),
    "segment_reduce_offsets": (
        lambda d, t: torch.segment_reduce(_z(d, 4), "sum", offsets=torch.tensor([0, 2, 4], dtype=t, device=d)),
        [F32],
    ),
}


def _error(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("name, dtype", [(n, t) for n, (_, ts) in INDEX_DTYPES.items() for t in ts],
                         ids=lambda v: str(v).removeprefix("torch."))  # fmt: skip
def test_an_index_of_a_dtype_cpu_rejects_raises_at_the_call(name, dtype):
    """The dtype is known when the op is traced: CPU's exception, CPU's message, at the call
    (not at the next sync, with JAX's message)."""
    fn = INDEX_DTYPES[name][0]
    expected = _error(fn, "cpu", dtype)
    got = _error(fn, "xla", dtype)  # no sync
    assert type(got) is type(expected)
    assert str(got) == str(expected)


# Index dtypes CPU accepts: the same results on the device.
ACCEPTED = {
    "index_select_int32": lambda d: _z(d, 3, 3).index_select(0, _i(d, I32, 2)),
    "embedding_int32": lambda d: F.embedding(_i(d, I32, 2), _z(d, 3, 3)),
    "index_add_int32": lambda d: _z(d, 3, 3).index_add(0, _i(d, I32, 2), _z(d, 2, 3)),
    "nll_loss_int64": lambda d: F.nll_loss(_z(d, 2, 3), _i(d, torch.long, 2)),
    "gather_empty_float": lambda d: _z(d, 3).gather(0, _i(d, F32, 0)),  # no element to check
    "scatter_add_empty_float": lambda d: _z(d, 3).scatter_add(0, _i(d, F32, 0), _z(d, 0)),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_index_dtypes_cpu_accepts_are_accepted(name):
    torch.testing.assert_close(ACCEPTED[name]("xla").cpu(), ACCEPTED[name]("cpu"))
    assert met.executed_fallback_ops() == []


def test_index_dtypes_are_checked_once_per_signature(monkeypatch):
    """The check runs when a signature is first seen (with PyTorch's meta kernel), never again."""
    from xlatorch.runtime.ir.ops import SPECS
    from xlatorch.runtime.trace import nodes

    calls = []
    check = nodes._check_index_dtype
    monkeypatch.setattr(nodes, "_check_index_dtype", lambda *a: calls.append(1) or check(*a))
    monkeypatch.setattr(SPECS["index_select.default"], "cache", {})
    x = torch.zeros(7, 5, device="xla")
    for _ in range(3):
        x.index_select(1, torch.tensor([4, 0], device="xla"))
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="Expected dtype int32 or int64 for index"):
        x.index_select(1, torch.tensor([4.0], device="xla"))
    assert len(calls) == 2


def _grid(dev):
    return torch.arange(12.0, device=dev).reshape(3, 4)


def _put(dev, index, values, **kw):
    x = _grid(dev)
    x[index(dev) if callable(index) else index] = values(dev)
    return x


def _rows(dev):
    return torch.tensor([0, 2], device=dev)


def _mask(dev):
    return torch.arange(12.0, device=dev).reshape(3, 4) > 5


def _ones(*shape, dtype=torch.float32):
    return lambda dev: torch.ones(*shape, dtype=dtype, device=dev)


# Assignments CPU refuses, which PyTorch's meta kernels (the device's avals) take: values of
# another dtype (the device cast them), values that do not broadcast to the indexing result
# (a lone boolean mask's count is data: the device wrote what it had).
_REFUSED_PUTS = {
    "x[mask] = 2 values for 6": lambda d: _put(d, _mask, lambda d: torch.tensor([1.0, 2.0], device=d)),
    "x[mask] = 0 values for 6": lambda d: _put(d, _mask, _ones(0)),
    "x[row mask] = [3, 4] for 2 rows": lambda d: _put(
        d, lambda d: torch.tensor([True, False, True], device=d), _ones(3, 4)
    ),
    "x[row mask] = [2, 3]": lambda d: _put(d, lambda d: torch.tensor([True, False, True], device=d), _ones(2, 3)),
    "x[:, col mask] = [3, 3] for 2 cols": lambda d: _put(
        d, (slice(None), torch.tensor([True, False, True, False], device=d)), _ones(3, 3)
    ),
    "x[rows] = long values": lambda d: _put(d, _rows, _ones(2, 4, dtype=torch.long)),
    "x[rows] = long 0-d": lambda d: _put(d, _rows, lambda d: torch.tensor(5, device=d)),
    "x[mask] = double values": lambda d: _put(d, _mask, _ones(6, dtype=torch.float64)),
    "x[rows] = [3, 4]": lambda d: _put(d, _rows, _ones(3, 4)),
    "index_put_(accumulate) long values": lambda d: _grid(d).index_put_(
        (_rows(d),), _ones(4, dtype=torch.long)(d), accumulate=True
    ),
    "index_put_ [1, 2, 4]": lambda d: _grid(d).index_put_((_rows(d),), _ones(1, 2, 4)(d)),
    "index_copy_ long source": lambda d: _grid(d).index_copy_(0, _rows(d), _ones(2, 4, dtype=torch.long)(d)),
    "put_ long source": lambda d: _grid(d).put_(_rows(d), _ones(2, dtype=torch.long)(d)),
    "put_ 3 values for 2": lambda d: _grid(d).put_(_rows(d), _ones(3)(d)),
    "int index_add_ float source": lambda d: _grid(d).long().index_add_(0, _rows(d), _ones(2, 4)(d)),
    "index_add_ source [2, 1]": lambda d: _grid(d).index_add_(0, _rows(d), _ones(2, 1)(d)),
    "index_add_ source [2, 4, 1]": lambda d: _grid(d).index_add_(0, _rows(d), _ones(2, 4, 1)(d)),
    "0-d index_add_ source [1]": lambda d: torch.zeros((), device=d).index_add_(
        0, torch.tensor([0], device=d), _ones(1)(d)
    ),
}

# ... and the assignments CPU takes, which must still run, with CPU's values
_TAKEN_PUTS = {
    "x[mask] = 6 values": lambda d: _put(d, _mask, lambda d: torch.arange(6.0, device=d)),
    "x[mask] = 1 value": lambda d: _put(d, _mask, _ones(1)),
    "x[mask] = 0-d": lambda d: _put(d, _mask, lambda d: torch.tensor(7.0, device=d)),
    "x[row mask] = [4]": lambda d: _put(
        d, lambda d: torch.tensor([True, False, True], device=d), lambda d: torch.arange(4.0, device=d)
    ),
    "x[row mask] = [2, 1]": lambda d: _put(
        d, lambda d: torch.tensor([True, False, True], device=d), lambda d: torch.tensor([[1.0], [2.0]], device=d)
    ),
    "x[:, col mask] = [3, 2]": lambda d: _put(
        d,
        (slice(None), torch.tensor([True, False, True, False], device=d)),
        lambda d: torch.arange(6.0, device=d).reshape(3, 2),
    ),
    "x[empty mask] = [0]": lambda d: _put(d, lambda d: torch.zeros(3, 4, dtype=torch.bool, device=d), _ones(0)),
    "x[rows] = [4]": lambda d: _put(d, _rows, lambda d: torch.arange(4.0, device=d)),
    "x[rows] = [1, 2, 4] (setitem drops leading 1s)": lambda d: _put(d, _rows, _ones(1, 2, 4)),
    "x[rows, rows] = 2 values": lambda d: _put(d, (_rows(d), _rows(d)), lambda d: torch.tensor([5.0, 6.0], device=d)),
    "x[rows] = 7": lambda d: _put(d, _rows, lambda d: 7),
    "index_put_(accumulate) [4]": lambda d: _grid(d).index_put_(
        (_rows(d),), torch.arange(4.0, device=d), accumulate=True
    ),
    "index_add_ [2, 4]": lambda d: _grid(d).index_add_(0, _rows(d), torch.arange(8.0, device=d).reshape(2, 4)),
    "index_add_ 0-d into 0-d": lambda d: torch.zeros((), device=d).index_add_(
        0, torch.tensor([0], device=d), torch.tensor(2.0, device=d)
    ),
    "put_ [2, 1] values": lambda d: _grid(d).put_(_rows(d), _ones(2, 1)(d)),
    "index_copy_ [2, 4]": lambda d: _grid(d).index_copy_(0, _rows(d), _ones(2, 4)(d)),
}


@pytest.mark.parametrize("name", sorted(_REFUSED_PUTS))
def test_an_assignment_cpu_refuses_raises_on_the_device(name):
    """CPU's exception, and its message word for word (a mask's count read on the device)."""
    refused_as_on_cpu(_REFUSED_PUTS[name])


@pytest.mark.parametrize("name", sorted(_TAKEN_PUTS))
def test_an_assignment_cpu_takes_runs_on_the_device_as_on_cpu(name):
    runs_as_on_cpu(_TAKEN_PUTS[name])
    assert met.executed_fallback_ops() == []
