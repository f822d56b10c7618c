"""Tiny graphs read by the host run there whole (``runtime/plan/stages.py``: ``Whole``), and a buffer
made from a shape and filled in part is a birth (``runtime/plan/births.py``): what a generation
loop's setup and its static KV cache need to compile nothing new on a second call. Values
equal CPU eager; compiles and counters are read through the metrics API."""

from __future__ import annotations

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch.runtime.ir.values import Out
from xlatorch.runtime.lower import cache
from xlatorch.runtime.plan import births, stages
from xlatorch.runtime.trace.tensor import value_of

DEV = "xla"


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Compile counts of a first run: no executables from earlier tests."""
    monkeypatch.setattr(cache, "CACHE", {})
    births._SPLIT.clear()
    stages.SEEN.clear()


def _counter(name: str) -> int:
    return met.counter_value(name) or 0


def _compiles() -> int:
    return _counter("UncachedCompile")


def _executions() -> int:
    """Device executions: ``ExecuteTime``'s sample count (a graph run on the host is none)."""
    return (met.metric_data("ExecuteTime") or (0,))[0]


# Host reads of tiny graphs: (program over a device, the host read). Each is new to the cache.
HOST_READS = {
    "isin_any": lambda d, ids: torch.isin(ids, torch.tensor([3, 7], device=d)).any().item(),
    "positions": lambda d, ids: (torch.ones_like(ids).cumsum(-1) - 1)[:, -1].tolist(),
    "mask_all": lambda d, ids: bool(torch.cat([ids > 0, torch.ones_like(ids, dtype=torch.bool)], -1).all()),
    "float_compare": lambda d, ids: (torch.ones(3, 4, device=d)[:, 1:] > 0.5).all(-1).tolist(),
    "zero_and_count": lambda d, ids: _zero_and_count(d, ids),
    "int_division": lambda d, ids: (ids // 3 + ids % 5).cpu().tolist(),
}


def _zero_and_count(d, ids):
    cache = torch.ones((1, 2, 6, 4), device=d)  # float state reset in place, as a cache's reset
    cache.zero_()
    n = (cache[0, 0].any(dim=-1)).sum() + ids.ne(0).sum()
    return n.item(), cache.cpu().tolist()


@pytest.mark.parametrize("name", list(HOST_READS))
def test_tiny_graph_read_by_the_host_compiles_nothing(name):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (1, 7), generator=gen)
    want = HOST_READS[name]("cpu", ids)
    d_ids = ids.to(DEV)
    xm.mark_step()
    c0, h0, e0 = _compiles(), _counter("GraphOnHost"), _executions()
    got = HOST_READS[name](DEV, d_ids)
    assert got == want
    assert _compiles() == c0, name
    assert _counter("GraphOnHost") > h0
    assert _executions() == e0, "a graph run on the host is counted as a device execution"


def test_what_the_host_computed_is_device_data_for_later_graphs():
    """The tiny graph's other live values (not the one read) are committed as device data: a
    later compiled graph reads them and matches CPU."""
    ids = torch.arange(12).reshape(2, 6)
    outs = []
    for d in ("cpu", DEV):
        x = ids.to(d)
        pos = x.cumsum(-1) - 1  # pending, read by the next graph
        flag = bool((pos[:, -1] > 3).all())
        y = torch.nn.functional.embedding(pos % 12, torch.linspace(-1, 1, 12 * 4, device=d).reshape(12, 4))
        if d != "cpu":
            xm.mark_step()
        outs.append((flag, y.cpu()))
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])


def test_float_arithmetic_still_compiles():
    """Float arithmetic rounds: the host may not give the device's bits, so it compiles."""
    x = torch.linspace(0, 1, 8).to(DEV)
    xm.mark_step()
    c0, h0, e0 = _compiles(), _counter("GraphOnHost"), _executions()
    (x * 3 + 1).sum().item()
    assert _compiles() == c0 + 1 and _counter("GraphOnHost") == h0
    assert _executions() == e0 + 1


def test_mark_step_keeps_compiling_tiny_graphs():
    """A tiny graph cut by mark_step stays on the device (on GPU/TPU the host would wait for
    it; a loop's next step reads it there)."""
    x = torch.arange(6).to(DEV)
    xm.mark_step()
    c0, h0 = _compiles(), _counter("GraphOnHost")
    y = x * 2 + 1
    xm.mark_step()
    assert torch.equal(y.cpu(), torch.arange(6) * 2 + 1)
    assert _compiles() == c0 + 1 and _counter("GraphOnHost") == h0


def test_an_error_on_the_host_is_raised_from_the_device():
    """An index out of range raises on the host: the graph runs on the device, whose check
    reports it as CPU PyTorch would, and nothing is committed from the host."""
    x = torch.arange(6).to(DEV)
    idx = torch.tensor([1, 9]).to(DEV)
    xm.mark_step()
    with pytest.raises(Exception, match="(?i)index"):
        x.index_select(0, idx).sum().item()


def _encoder_step(d, ids, read):
    """An encoder's step as Hugging Face writes it: the embeddings are computed (pending), then a
    check on the inputs is read on the host (``read``), then the rest of the step. Its loss and
    the read."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8).to(d)
    lin = torch.nn.Linear(8, 8).to(d)
    h = emb(ids)  # pending when the check is read
    mask = torch.ones(ids.shape, device=d)
    flag = read(ids, mask)
    loss = (lin(h) * mask[..., None]).sum()
    loss.backward()
    if d != "cpu":
        xm.mark_step()
    return flag, loss.detach().cpu(), lin.weight.grad.cpu()


STEP_READS = {
    "mask_all": lambda ids, mask: bool(torch.all(mask == 1)),
    "pad_in_ids": lambda ids, mask: 0 in ids[:, [-1, 0]],
    "additive_mask": lambda ids, mask: bool(((1.0 - mask) * torch.finfo(mask.dtype).min < 0).any()),
}


@pytest.mark.parametrize("name", list(STEP_READS))
def test_a_check_read_during_a_step_runs_alone_on_the_host(name):
    """The read's own graph (tiny, exact on the host) runs there alone: the embeddings pending
    before it stay pending, so the step is one execution, not the check's graph cutting the step
    in two (Hugging Face's encoders read ``torch.all(mask == 1)`` and ``pad_token_id in
    input_ids[:, [-1, 0]]`` each step). Values equal CPU's."""
    ids = torch.randint(1, 10, (2, 6), generator=torch.Generator().manual_seed(0))
    want = _encoder_step("cpu", ids, STEP_READS[name])
    d_ids = ids.to(DEV)
    xm.mark_step()
    _encoder_step(DEV, d_ids, STEP_READS[name])  # compiles the step
    e0, h0 = _executions(), _counter("GraphOnHost")
    got = _encoder_step(DEV, d_ids, STEP_READS[name])
    assert got[0] == want[0]
    torch.testing.assert_close(got[1:], want[1:], rtol=1e-5, atol=1e-5)
    assert _executions() - e0 == 1, "the check's read cut the step's graph"
    assert _counter("GraphOnHost") - h0 == 1


def test_a_host_read_leaves_a_pending_in_place_update_pending():
    """A tiny read of a value that an in-place update made: the update's storage keeps its pending
    value and gets it at the next sync, as CPU computes it."""
    x = torch.arange(6.0).to(DEV)
    y = torch.linspace(-1, 1, 6).to(DEV)
    xm.mark_step()
    x.add_(1)
    z = torch.tanh(y)  # pending, not exact on the host
    assert bool((x > 5).any()) is True
    assert type(value_of(z)) is Out
    xm.mark_step()
    assert torch.equal(x.cpu(), torch.arange(6.0) + 1)
    torch.testing.assert_close(z.cpu(), torch.tanh(torch.linspace(-1, 1, 6)))


def test_a_loop_without_mark_step_that_reads_only_tiny_values_still_syncs_its_graph():
    """Reads that run alone leave the rest pending; after ``MAX_ALONE`` of them the next read syncs
    every pending value, so a loop that never calls ``mark_step`` does not grow one graph for as
    long as it runs. Values equal CPU's."""
    from xlatorch.runtime.execute import sync

    n = 2 * (sync.MAX_ALONE + 1)
    x = torch.linspace(-1, 1, 8)
    ids = torch.arange(6)
    accs = []
    for d in ("cpu", DEV):
        acc, xd, idd = torch.zeros(8, device=d), x.to(d), ids.to(d)
        if d != "cpu":
            xm.mark_step()
            e0 = _executions()
        for t in range(n):
            acc = acc + torch.tanh(xd * t)  # pending, not exact on the host
            assert bool((idd >= 0).all())  # tiny: runs on the host alone
        accs.append(acc.cpu())
    assert _executions() - e0 == 2, "a full sync at every MAX_ALONE + 1-th read"
    torch.testing.assert_close(accs[1], accs[0])


def test_a_sum_of_products_read_compiles():
    """XLA fuses ``a * b + c`` into one multiply-add, which rounds once where the host's two ops
    round twice: such a read runs on the device, so it agrees with the device's own values."""
    x = torch.linspace(0, 1, 8).to(DEV)
    xm.mark_step()
    e0, h0 = _executions(), _counter("GraphOnHost")
    (x * 3 + 1 > 2).any().item()
    assert _executions() == e0 + 1 and _counter("GraphOnHost") == h0


def _fill(cache, pos, vals):
    return cache.index_copy_(2, pos, vals)


def _decode(device, prompts, steps=3, fresh=False):
    """A static-cache decoder loop: the cache is made from a shape in the first call's
    prefill and filled by index_copy_; later calls reset it with zero_ and read its length
    (as Hugging Face's StaticCache did before transformers 5), or with ``fresh`` make it anew
    in each call's prefill (as its StaticCache does since). Per call: compiles and results."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(device)
    cache = None
    res, compiles = [], []
    for p in prompts:
        c0 = _compiles()
        x = p.to(device)
        if fresh:
            cache = None
        if cache is not None:  # a reset, then a host read of how much is filled
            cache.zero_()
            assert cache[0, 0].any(dim=-1).sum().item() == 0
        n = x.shape[1]
        if cache is None:  # made lazily in the first prefill, like a static KV cache
            cache = torch.zeros(1, 2, n + steps, 8, device=device)
        for t in range(-1, steps):
            pos = torch.arange(n, device=device) if t < 0 else torch.tensor([n + t], device=device)
            k = torch.tanh(lin(x if t < 0 else x[:, -1:])).unsqueeze(0).expand(1, 2, -1, -1)
            _fill(cache, pos, k)
            att = torch.softmax(cache.sum(-1), -1)
            x = torch.cat([x, att[:, 0, : x.shape[1]].sum(-1, keepdim=True).unsqueeze(-1).expand(1, 1, 8)], 1)
            if device != "cpu":
                xm.mark_step()
        res.append(cache.cpu().clone())
        compiles.append(_compiles() - c0)
    return res, compiles


def test_a_buffer_filled_in_part_is_born_before_the_step():
    """``zeros(shape)`` then ``index_copy_``, kept: computed apart, so the first call's prefill
    is the second's (no compile on the second call); values equal CPU's."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, 4, 8, generator=gen) for _ in range(3)]
    want, _ = _decode("cpu", prompts)
    h0 = _counter("BirthsHoisted")
    got, compiles = _decode(DEV, prompts)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _counter("BirthsHoisted") - h0 == 1
    assert compiles[1] == 0 and compiles[2] == 0, compiles


def test_a_buffer_made_anew_in_each_call_is_born_apart_in_every_call():
    """The cache made anew in each call's prefill (transformers 5's StaticCache): its births
    are many syncs apart, not every step, so every call computes them apart and runs the
    cached prefill: no compile after the first call (it compiled the whole prefill in the
    third call before); values equal CPU's."""
    gen = torch.Generator().manual_seed(2)
    steps = births.RECENT + 1  # a call's syncs: more than RECENT between two calls' births
    prompts = [torch.randn(1, 4, 8, generator=gen) for _ in range(4)]
    want, _ = _decode("cpu", prompts, steps, fresh=True)
    h0 = _counter("BirthsHoisted")
    got, compiles = _decode(DEV, prompts, steps, fresh=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiles[0] > 0 and compiles[1:] == [0, 0, 0], compiles
    assert _counter("BirthsHoisted") - h0 == len(prompts)


def test_a_buffer_written_whole_is_not_a_birth():
    """``ones(n).bernoulli_()`` and an accumulator ``zeros(()) += x`` are made anew each step:
    never split off."""
    h0 = _counter("BirthsHoisted")
    kept = []
    for _ in range(3):
        m = torch.ones(16, device=DEV).bernoulli_(0.5)
        acc = torch.zeros((), device=DEV)
        acc += m.sum()
        kept.append((m, acc))
        xm.mark_step()
    assert _counter("BirthsHoisted") == h0
    for m, acc in kept:
        assert acc.item() == m.sum().item()
