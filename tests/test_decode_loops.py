"""A decode loop written by hand (a fixed-shape step per token, ``xm.mark_step()`` after each):
its position tensor is small integer arithmetic on values the host holds (``pos + 1``,
``pos += 1``), so the host keeps it too (``prechecks.carried``), the cache write's check at that
position is decided on the host at every step, and the step runs unchecked and donates the
cache it updates in place. A position that runs past the cache still raises CPU's error with
the state from before the step. Every op here is exact in float32 (powers of two, sums of a
few of them, relu): the device's values must equal CPU's bit for bit."""

from __future__ import annotations

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met

ROWS = 16


def _count(name: str) -> int:
    return met.counter_value(name) or 0


def _step(cache, pos, x, w):
    """One token: a row computed from ``x``, written at ``pos``, and the next ``x``."""
    h = torch.relu(x @ w - 1.0) * 0.5
    cache.index_copy_(0, pos, h)
    return h + cache.sum(0, keepdim=True) * 0.25


def _decode(cache, pos, steps, inplace=False, rows=None):
    """``steps`` tokens from ``pos``; each step synced on the device and its ``x`` read on the
    host (a decode loop reads its token). Returns ``pos`` and the values of ``x`` per step.
    ``rows``: the device arrays of the cache after each step."""
    dev = cache.device.type == "xla"
    w = torch.full((8, 8), 0.25, device=cache.device)
    x = torch.ones(1, 8, device=cache.device)
    xs = []
    for _ in range(steps):
        x = _step(cache, pos, x, w)
        if inplace:
            pos += 1
        else:
            pos = pos + 1
        if dev:
            xm.mark_step()
            if rows is not None:
                rows.append(cache._st.value.array)
        xs.append(x.cpu())
    return pos, xs


def _start(first=0):
    cpu = torch.arange(ROWS * 8, dtype=torch.float32).reshape(ROWS, 8) / 8
    pos = torch.tensor([first])
    return cpu, pos, cpu.to("xla"), pos.to("xla")


@pytest.mark.parametrize("inplace", [False, True], ids=["pos+1", "pos+=1"])
def test_a_decode_loops_position_stays_on_the_host_and_each_step_donates_the_cache(inplace):
    cpu, pos_c, dev, pos_d = _start()
    xm.mark_step()
    before = {k: _count(k) for k in ("ChecksOnHost", "CheckRowsRead")}
    arrays = []
    pos_c, want = _decode(cpu, pos_c, 10, inplace)
    pos_d, got = _decode(dev, pos_d, 10, inplace, rows=arrays)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(dev.cpu(), cpu) and torch.equal(pos_d.cpu(), pos_c)
    # every step's check (index_copy_'s position) decided on the host; no rows read
    assert _count("ChecksOnHost") - before["ChecksOnHost"] == 10
    assert _count("CheckRowsRead") == before["CheckRowsRead"]
    # the cache's buffer of each step was written in place by the next (donated)
    assert all(a.is_deleted() for a in arrays[:-1])


def test_a_position_past_the_cache_raises_cpus_error_with_the_state_from_before():
    cpu, pos_c, dev, pos_d = _start(first=ROWS - 3)
    xm.mark_step()
    with pytest.raises(IndexError) as cpu_error:
        _decode(cpu, pos_c, 5)
    with pytest.raises(IndexError) as dev_error:
        _decode(dev, pos_d, 5)
    assert str(dev_error.value).startswith(str(cpu_error.value))
    assert torch.equal(dev.cpu(), cpu)  # the three steps before it, as on CPU
    # and a loop from a position inside the cache goes on from there
    _, want = _decode(cpu, torch.tensor([2]), 3)
    _, got = _decode(dev, torch.tensor([2]).to("xla"), 3)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(dev.cpu(), cpu)


def test_a_position_the_device_computes_is_checked_on_the_device():
    """A position taken from a device value (an argmax) is not the host's: each step runs
    checked and reads its rows, with the same results."""
    cpu, _, dev, _ = _start()
    w = torch.full((8, 8), 0.25)
    xm.mark_step()
    before = _count("CheckRowsRead")
    for c in (cpu, dev):
        x = torch.ones(1, 8, device=c.device)
        for _ in range(4):
            pos = (c.sum(1).argmax() % ROWS).reshape(1)
            x = _step(c, pos, x, w.to(c.device))
            if c.device.type == "xla":
                xm.mark_step()
    assert torch.equal(dev.cpu(), cpu)
    assert _count("CheckRowsRead") - before >= 3
