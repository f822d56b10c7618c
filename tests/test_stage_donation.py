"""A staged step (a growing loop: ``runtime/execute/staged.py``) donates the buffers it updates
in place once its checks are decided on the host from the values its host stages made (also
those of the ops inside a ``torch.compile`` graph), and a check that fires still raises CPU's
error with the state from before the step intact. Every
op here is exact in float32 (powers of two, sums of a few of them, relu): the device's values
must equal CPU's bit for bit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met

ROWS = 16


def _count(name: str) -> int:
    return met.counter_value(name) or 0


def _counts() -> dict:
    return {k: _count(k) for k in ("StagedSync", "StagedDonation", "ChecksOnHost", "CheckRowsRead")}


def _since(before: dict) -> dict:
    return {k: _count(k) - v for k, v in before.items()}


def _put(cache, pos, row):
    cache.index_copy_(0, pos, row)


def _writer(how):
    """How the loop writes the cache: ``index_copy_`` traced lazily, or inside a graph of
    ``torch.compile`` (one node holding the checked op; on CPU always the plain call)."""
    return _put if how == "lazy" else torch.compile(_put, backend="openxla")


def _loop(steps, cache, bad_at=None, from_device=False, put=_put):
    """A generation loop's shape: ``ids`` gains a column per step (host bookkeeping), a row of
    ``cache`` is computed by enough unchanged nodes for the step to run in stages and written
    at a position taken from ``ids`` (``index_copy_``: a checked op), and the host reads a value
    each step. ``bad_at``: the step whose position is out of range. ``from_device``: the
    position comes from a device value (a float comparison), which the host does not hold."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=cache.device)
    w = torch.full((8, 8), 0.5, device=cache.device)
    for t in range(steps):
        h = cache[:1] @ w
        for _ in range(12):
            h = torch.relu(h - 1.0) * 0.5
        if from_device:
            pos = (h.sum(1) >= 0).long() + ids[0, -1:] % (ROWS - 1)
        else:
            pos = ids[0, -1:] % ROWS if t != bad_at else ids[0, -1:] + 100
        (put if cache.device.type == "xla" else _put)(cache, pos, h + ids[0, -1].float())
        ids = torch.cat([ids, ids[:, -1:] + 1], dim=1)
        # The host reads a value of the step, as a stop check reads the new token: one sync per step
        # (a read of ``ids`` alone would run on the host, leaving the step pending)
        assert not bool(h[0, 0] > 1e30) and int(ids[0, -1]) == t + 1
    return ids


def _start():
    cpu = torch.arange(ROWS * 8, dtype=torch.float32).reshape(ROWS, 8) / 8
    dev = cpu.to("xla")
    xm.mark_step()
    return cpu, dev


@pytest.mark.parametrize("how", ["lazy", "compiled"])
def test_a_staged_step_whose_checks_the_host_decides_donates_what_it_updates_in_place(how, fresh_dynamo):
    cpu, dev = _start()
    put = _writer(how)
    before = _counts()
    for _ in range(2):  # the first steps compile; the loop again reuses them
        _loop(5, cpu)
        _loop(5, dev, put=put)
    got = _since(before)
    assert torch.equal(dev.cpu(), cpu)
    assert got["StagedSync"] >= 6, got  # each step but the first of a loop runs in stages
    # index_copy_'s check, decided on the host at every step (the unstaged first ones too: their
    # position is arithmetic on ids the host made), so no rows are read ...
    assert got["ChecksOnHost"] >= got["StagedSync"] and got["CheckRowsRead"] == 0, got
    assert got["StagedDonation"] == got["StagedSync"], got  # ... and the cache's old buffer is reused


@pytest.mark.parametrize("how", ["lazy", "compiled"])
def test_a_check_that_fires_in_a_staged_step_raises_cpus_error_with_the_state_from_before(how, fresh_dynamo):
    cpu, dev = _start()
    put = _writer(how)
    _loop(4, cpu)
    _loop(4, dev, put=put)
    assert torch.equal(dev.cpu(), cpu)
    with pytest.raises(IndexError, match="index 106 is out of bounds") as cpu_error:
        _loop(7, cpu, bad_at=6)
    before = _counts()
    with pytest.raises(IndexError) as dev_error:
        _loop(7, dev, bad_at=6, put=put)
    assert str(dev_error.value).startswith(str(cpu_error.value))
    # The steps before it ran in stages and donated; the failing one donated nothing (its check
    # fires on the host too, so it runs checked) and undid itself
    assert torch.equal(dev.cpu(), cpu)
    got = _since(before)
    assert got["StagedDonation"] == got["StagedSync"] >= 2 and got["ChecksOnHost"] >= got["StagedSync"], got
    _loop(3, dev, put=put)  # and the loop goes on from there
    _loop(3, cpu)
    assert torch.equal(dev.cpu(), cpu)


def test_a_check_on_a_value_the_device_computed_is_read_and_donates_nothing():
    cpu, dev = _start()
    _loop(6, cpu, from_device=True)
    before = _counts()
    _loop(6, dev, from_device=True)
    got = _since(before)
    assert torch.equal(dev.cpu(), cpu)
    assert got["StagedSync"] >= 4 and got["StagedDonation"] == 0 and got["ChecksOnHost"] == 0, got


@pytest.mark.parametrize("how", ["lazy", "compiled"])
def test_a_staged_step_runs_each_host_op_once(how, fresh_dynamo, monkeypatch):
    """The host computes a position once a step: deciding the checks (``prechecks``) takes it
    from the ids the host holds, and the host stage that makes it takes that value, not
    computing it again; nor are the step's results' host values computed apart."""
    from xlatorch.runtime.execute import host
    from xlatorch.runtime.plan import prechecks

    runs = []  # every node run on the host, kept alive so that no two share an id

    def counted(real):
        def run(n, conv):
            runs.append(n)
            return real(n, conv)

        return run

    monkeypatch.setattr(host, "run_node_on_cpu", counted(host.run_node_on_cpu))
    monkeypatch.setattr(prechecks, "run_node_on_cpu", counted(prechecks.run_node_on_cpu))
    cpu, dev = _start()
    put = _writer(how)
    _loop(3, dev, put=put)
    runs.clear()
    before = _counts()
    ids = _loop(5, dev, put=put)
    _loop(5, cpu)
    got = _since(before)
    assert torch.equal(dev.cpu(), cpu) and got["StagedSync"] >= 2 and got["ChecksOnHost"] >= got["StagedSync"], got
    assert ids.tolist() == [list(range(6))]
    assert runs, "no op ran on the host"
    times = Counter(map(id, runs))
    twice = sorted({n.spec.name for n in runs if times[id(n)] > 1})
    assert not twice, f"ran on the host more than once in a step: {twice}"
