"""Loops that compile once (``scan``, ``scan_layers``, ``fori_loop``, ``while_loop``, ``torch.cond``,
``gradient_accumulation``) and ``assume_pure``: values and gradients against the same Python
code on CPU, the program's size against the number of iterations, compile counts, and the
errors of a body that does what a body cannot.

Tolerance: the device and CPU add in different orders; each compared value is a short chain
of float32 ops whose sums have at most a few hundred terms, so they differ by a few ulps of
the largest value involved (``NOISE`` of it, tests/tolerances.py).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from tolerances import NOISE
from torch._higher_order_ops.while_loop import while_loop

import xlatorch
import xlatorch.debug.metrics as met
from tests import warm
from xlatorch.debug.dump import hlo_text
from xlatorch.experimental.assume_pure import assume_pure
from xlatorch.experimental.fori_loop import fori_loop
from xlatorch.experimental.gradient_accumulation import gradient_accumulation
from xlatorch.experimental.scan import scan
from xlatorch.experimental.scan_layers import scan_layers
from xlatorch.runtime.trace.bodies import BodyError

DEV = xlatorch.device()


def _close(got, want, scale=None):
    got = got.detach().cpu()
    want = want.detach()
    tol = NOISE * max(1.0, float(want.abs().max()) if scale is None else scale)
    diff = float((got - want).abs().max())
    assert diff <= tol, f"differs by {diff} > {tol}"


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _rnn(W):
    def fn(h, x):
        h = torch.tanh(h @ W + x["in"])
        return h, {"sum": h.sum(-1), "none": None}

    return fn


@pytest.mark.parametrize("partition", ["default_partition", "min_cut_rematerialization_partition"])
def test_scan_values_and_gradients_equal_the_python_loop(partition):
    from functorch import compile as fc

    torch.manual_seed(0)
    W, xs, h0 = torch.randn(4, 4) * 0.5, torch.randn(6, 3, 4), torch.randn(3, 4)
    Wc, xc, hc = (t.clone().requires_grad_() for t in (W, xs, h0))
    h, ys = hc, []
    for i in range(6):
        h, y = _rnn(Wc)(h, {"in": xc[i]})
        ys.append(y["sum"])
    ys = torch.stack(ys)
    (h.sum() + (ys * ys).sum()).backward()

    Wd, xd, hd = (t.to(DEV).requires_grad_() for t in (W, xs, h0))
    hf, yd = scan(_rnn(Wd), hd, {"in": xd}, partition_fn=getattr(fc, partition))
    assert yd["none"] is None
    (hf.sum() + (yd["sum"] * yd["sum"]).sum()).backward()
    _close(hf, h)
    _close(yd["sum"], ys)
    for dev, cpu in ((Wd, Wc), (xd, xc), (hd, hc)):  # the closure's weight too
        _close(dev.grad, cpu.grad)


def test_scan_is_one_loop_compiled_once():
    torch.manual_seed(1)
    W = torch.randn(4, 4, device=DEV) * 0.5
    sizes = {}
    for n in (4, 32):
        xs = torch.randn(n, 3, 4, device=DEV)
        xlatorch.sync()
        h, _ = scan(_rnn(W), torch.zeros(3, 4, device=DEV), {"in": xs})
        sizes[n] = len(hlo_text(h).splitlines())
        xlatorch.sync()
    assert sizes[32] == sizes[4]  # the body once, whatever the number of iterations
    xs = torch.randn(32, 3, 4, device=DEV)
    xlatorch.sync()
    before = _compiles()
    h, _ = scan(_rnn(W), torch.zeros(3, 4, device=DEV), {"in": xs})  # same shapes again: traced, not compiled
    xlatorch.sync()
    assert _compiles() == before


def _layers(n):
    torch.manual_seed(2)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)) for _ in range(n)]


@pytest.mark.parametrize("partition", ["default_partition", "min_cut_rematerialization_partition"])
def test_scan_layers_equals_the_plain_loop_values_and_every_gradient(partition):
    from functorch import compile as fc

    layers = _layers(5)
    x = torch.randn(4, 8)
    ref = copy.deepcopy(layers)
    out = x
    for m in ref:
        out = m(out)
    out.pow(2).sum().backward()
    dl = [copy.deepcopy(m).to(DEV) for m in layers]
    got = scan_layers(dl, x.to(DEV), partition_fn=getattr(fc, partition))
    got.pow(2).sum().backward()
    _close(got, out)
    # A layer's gradient can be a difference of much larger terms (LayerNorm's backward
    # subtracts means): its rounding scales with the largest gradient of the model.
    scale = max(float(q.grad.abs().max()) for c in ref for q in c.parameters())
    for d, c in zip(dl, ref):
        for p, q in zip(d.parameters(), c.parameters()):
            _close(p.grad, q.grad, scale=scale)


def test_scan_layers_program_does_not_grow_with_depth():
    lines = {}
    for n in (2, 8):
        dl = [m.to(DEV) for m in _layers(n)]
        x = torch.randn(4, 8, device=DEV)
        xlatorch.sync()
        plain = x
        for m in dl:
            plain = m(plain)
        lines[n] = (len(hlo_text(scan_layers(dl, x)).splitlines()), len(hlo_text(plain).splitlines()))
        xlatorch.sync()
    # Stacking n layers' weights adds a few lines per layer; the layers' ops are there once.
    assert lines[8][0] < lines[2][0] + 6 * 6 * 2
    assert lines[8][1] > 3 * lines[2][1]


@pytest.mark.parametrize("partition", ["default_partition", "min_cut_rematerialization_partition"])
def test_random_ops_draw_new_numbers_each_iteration_and_the_backward_sees_them(partition):
    from functorch import compile as fc

    x = torch.rand(6, 64, device=DEV) + 0.5  # no zeros: a zero output means dropped
    w = torch.randn(64, device=DEV, requires_grad=True)

    def fn(c, xi):
        y = torch.nn.functional.dropout(xi, 0.5, training=True) * w
        return c + y.sum(), y

    total, ys = scan(fn, torch.zeros((), device=DEV), x, partition_fn=getattr(fc, partition))
    total.backward()
    kept = (ys != 0).cpu()
    assert not all(torch.equal(kept[0], kept[i]) for i in range(1, 6))  # a new mask per iteration
    # d total / d w = sum over iterations of the mask * 2 * x: the forward's masks, not others.
    want = (kept * x.cpu() * 2).sum(0)
    _close(w.grad, want)


def test_a_random_op_that_reads_no_input_draws_new_numbers_each_iteration():
    # torch.rand in a body reads none of the body's inputs: it was computed once, outside the
    # loop (as a weight's transpose is), and every iteration got the same numbers.
    def fn(c, xi):
        return c + xi, xi + torch.rand(3, device=DEV)

    _, ys = scan(fn, torch.zeros(3, device=DEV), torch.zeros(4, 3, device=DEV))
    ys = ys.cpu()
    assert all(not torch.equal(ys[0], ys[i]) for i in range(1, 4))

    def body(last, changes):  # counts the iterations whose draw differs from the one before
        d = torch.rand((), device=DEV)
        return d, changes + (d != last).long()

    _, _, changes = fori_loop(
        0, 4, body, torch.full((), -1.0, device=DEV), torch.zeros((), dtype=torch.long, device=DEV)
    )
    assert int(changes.cpu()) == 4  # the same draw every iteration: 1


def test_value_and_grad_partitioned_is_one_iteration_of_scan_differentiated():
    from xlatorch.experimental.scan import tree_flatten_none, value_and_grad_partitioned

    def fn(carry, x):
        new = {"a": torch.sin(carry["a"] @ x["w"] + x["b"]), "n": carry["n"] + 1}
        return new, torch.sigmoid(new["a"]).sum(-1)

    init = {"a": torch.randn(2, 3), "n": torch.zeros(2, dtype=torch.long)}
    x = {"w": torch.randn(3, 3), "b": torch.randn(2, 3)}
    dev = lambda tree: {k: v.to(DEV) for k, v in tree.items()}  # noqa: E731
    forward, alias_input, backward = value_and_grad_partitioned(fn, dev(init), {k: v[None] for k, v in dev(x).items()})
    carry, (y, partial) = forward(dev(init), dev(x))
    activations = alias_input(partial, dev(x))
    ca = init["a"].clone().requires_grad_(True)
    xw, xb = x["w"].clone().requires_grad_(True), x["b"].clone().requires_grad_(True)
    want_carry, want_y = fn({"a": ca, "n": init["n"]}, {"w": xw, "b": xb})
    _close(carry["a"], want_carry["a"].detach())
    assert torch.equal(carry["n"].cpu(), want_carry["n"])
    _close(y, want_y.detach())
    g_carry = {"a": torch.ones(2, 3), "n": None}
    (want_carry["a"].sum() + want_y.sum()).backward()
    got_carry, got_x = backward({"a": g_carry["a"].to(DEV), "n": None}, (torch.ones(2, device=DEV), activations))
    _close(got_carry["a"], ca.grad)
    _close(got_x["w"], xw.grad)
    _close(got_x["b"], xb.grad)
    assert torch.equal(got_carry["n"].cpu(), torch.zeros(2, dtype=torch.long))  # an integer leaf: no gradient
    flat, unflatten = tree_flatten_none(((1, 2), (None, 3), None))
    assert flat == [1, 2, 3] and unflatten(flat) == ((1, 2), (None, 3), None)
    with pytest.raises(ValueError, match="callable"):
        scan(1000, init["a"].to(DEV), x["w"].to(DEV))


def test_fori_loop_and_torchs_while_loop():
    i, v = fori_loop(0, 7, lambda v: v * 2 + 1, torch.tensor(1.0, device=DEV))
    assert int(i) == 0 and float(v) == 255.0
    lin = torch.nn.Linear(3, 3).to(DEV)
    x = torch.randn(2, 3, device=DEV)
    with torch.no_grad():
        n, y = while_loop(lambda n, x: n > 0, lambda n, x: (n - 1, lin(x)), (torch.tensor(10, device=DEV), x))
        ref = x.cpu()
        lc = copy.deepcopy(lin).cpu()
        for _ in range(10):
            ref = lc(ref)
    assert int(n) == 0
    _close(y, ref)


def test_torch_cond_on_xla_tensors():
    x = torch.randn(5, device=DEV)
    for p in (True, False):
        got = torch.cond(torch.tensor(p, device=DEV), lambda t: t.sin() * 2, lambda t: t.cos(), (x,))
        want = x.cpu().sin() * 2 if p else x.cpu().cos()
        _close(got, want)


def test_gradient_accumulation_equals_a_python_loop_on_cpu():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    cpu = copy.deepcopy(model)
    model.to(DEV)
    data, labels = torch.randn(4, 5, 8), torch.randn(4, 5, 2)

    def step(d, lab, count):
        return torch.nn.functional.mse_loss(model(d), lab), count + 1

    loss, count = gradient_accumulation(step, (data.to(DEV), labels.to(DEV)), model, torch.tensor(0, device=DEV))
    total = 0.0
    for i in range(4):
        li = torch.nn.functional.mse_loss(cpu(data[i]), labels[i]) / 4
        li.backward()
        total += li.item()
    assert int(count) == 4
    assert abs(float(loss) - total) <= NOISE * total
    for p, q in zip(model.parameters(), cpu.parameters()):
        _close(p.grad, q.grad)


def test_gradient_accumulation_may_not_write_the_users_tensors():
    model = torch.nn.Linear(4, 1).to(DEV)
    counter = torch.tensor(0, device=DEV)

    def step(x, c):
        c += 1  # eagerly this would change the caller's counter
        return model(x).sum(), c

    with pytest.raises(AssertionError, match="writes its input"):
        gradient_accumulation(step, (torch.randn(3, 2, 4, device=DEV),), model, counter)
    assert int(counter) == 0


def test_assume_pure_replays_without_tracing():
    calls = []

    @assume_pure
    def f(a, b):
        calls.append(1)
        return ((a @ b) * 0.5 - 0.25).relu().sum(0)  # numbers are literals of the replayed program

    a = torch.randn(3, 4, device=DEV, requires_grad=True)
    b = torch.randn(4, 5, device=DEV)
    f(a, b).sum().backward()
    traced = len(calls)
    mm = met.counter_value("xla::mm") or 0
    for _ in range(3):
        y = f(a, b)
        y.sum().backward()
    assert len(calls) == traced  # the Python function ran for the first call only
    assert (met.counter_value("xla::mm") or 0) == mm  # and no mm was traced since
    ac = a.detach().cpu().requires_grad_()
    yc = ((ac @ b.cpu()) * 0.5 - 0.25).relu().sum(0)
    assert y.dtype == yc.dtype
    yc.sum().backward()
    _close(y, yc)
    _close(a.grad / 4, ac.grad)


def test_assume_pure_rejects_a_closure_over_device_data():
    w = torch.randn(3, device=DEV)
    xlatorch.sync()
    with pytest.raises(BodyError, match="not one of its arguments"):
        assume_pure(lambda x: x * w)(torch.randn(3, device=DEV))


def test_a_body_cannot_read_values_on_the_host():
    xs = torch.randn(3, 2, device=DEV)
    with pytest.raises(BodyError, match=r"the body of scan needs a value on the host .*test_loops.py"):
        scan(lambda c, x: (c + x.sum().item(), None), torch.zeros(2, device=DEV), xs)


def test_a_body_cannot_write_outside_and_the_outside_keeps_its_value():
    outside = torch.ones(2, device=DEV)
    xlatorch.sync()
    pending = outside * 3

    def fn(c, x):
        outside.add_(x)
        pending.mul_(2)
        return c + x, None

    with pytest.raises(BodyError, match="wrote tensors made outside it"):
        scan(fn, torch.zeros(2, device=DEV), torch.randn(3, 2, device=DEV))
    assert outside.cpu().tolist() == [1.0, 1.0]
    assert pending.cpu().tolist() == [3.0, 3.0]


def test_scan_layers_refuses_layers_that_update_their_buffers():
    # BatchNorm in training mode updates its running statistics: a loop traced once cannot
    # give each layer its own update, so it says so rather than dropping them.
    layers = [torch.nn.BatchNorm1d(4).to(DEV) for _ in range(3)]
    with pytest.raises(AssertionError, match="writes its input"):
        scan_layers(layers, torch.randn(5, 4, device=DEV))
    assert all(float(m.running_mean.abs().sum()) == 0.0 for m in layers)
    for m in layers:
        m.eval()
    x = torch.randn(5, 4)
    want = x
    for m in layers:
        want = copy.deepcopy(m).cpu()(want)
    _close(scan_layers(layers, x.to(DEV)), want)  # eval mode: a pure function


def test_a_body_temporary_has_no_value_outside():
    leaked = []

    def fn(c, x):
        leaked.append(c * 2)
        return c + x, None

    scan(fn, torch.zeros(2, device=DEV), torch.randn(3, 2, device=DEV))
    with pytest.raises(RuntimeError, match="made inside the body of scan"):
        leaked[0].cpu()


def test_a_carry_keeps_its_shape_and_dtype():
    with pytest.raises(BodyError, match="changed carry leaf 0"):
        scan(lambda c, x: (c.double(), None), torch.zeros(2, device=DEV), torch.randn(3, 2, device=DEV))


def test_an_index_out_of_range_in_a_body_raises_like_cpu():
    table = torch.randn(5, 2, device=DEV)
    idx = torch.tensor([1, 2, 7, 0], device=DEV)

    def fn(c, i):
        return c + table[i.reshape(1)][0], None

    h, _ = scan(fn, torch.zeros(2, device=DEV), idx)
    with pytest.raises(IndexError, match=r"index 7 is out of bounds.*in the body of scan"):
        h.cpu()


GUIDE = """
import torch
import torch_xla
import torch.nn as nn
from torch_xla.experimental.scan import scan
from torch_xla.experimental.scan_layers import scan_layers

with torch_xla.device():
    layers = [nn.Linear(16, 16) for i in range(10)]
    input = torch.randn(16)
output = scan_layers(layers, input)
assert output.shape == (16,)

def cumsum(accumulated, element):
    accumulated += element
    return accumulated, accumulated

with torch_xla.device():
    init = torch.tensor([0.0, 0.0])
    xs = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
final, ys = scan(cumsum, init, xs)
torch_xla.sync()
print(final.tolist(), ys.tolist())
"""


def test_torch_xla_guide_programs_run_through_the_compat_runner(tmp_path):
    (tmp_path / "guide.py").write_text(GUIDE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = warm.run([sys.executable, "-m", "xlatorch.compat", "guide.py"], cwd=tmp_path, env=env,
                   capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[9.0, 12.0] [[1.0, 2.0], [4.0, 6.0], [9.0, 12.0]]"


def test_loops_in_eager_mode_trace_their_body_lazily():
    from xlatorch.experimental import eager_mode

    W = torch.randn(4, 4) * 0.5
    xs, h0 = torch.randn(5, 2, 4), torch.randn(2, 4)
    h = h0
    for i in range(5):
        h, _ = _rnn(W)(h, {"in": xs[i]})
    eager_mode(True)
    try:
        got, _ = scan(_rnn(W.to(DEV)), h0.to(DEV), {"in": xs.to(DEV)})
        _close(got, h)
    finally:
        eager_mode(False)


def test_an_index_out_of_range_in_a_while_body_raises_like_cpu():
    table = torch.randn(5, device=DEV)

    def body(i, a):
        return i + 1, a + table.index_select(0, i.reshape(1))[0]

    n, a = while_loop(lambda i, a: i < 8, body, (torch.tensor(0, device=DEV), torch.zeros((), device=DEV)))
    with pytest.raises(
        IndexError, match=r"out of range.*\(in the body of while_loop: aten::index_select at test_loops.py:\d+\)"
    ):
        a.cpu()
    # the same loop within bounds
    n, a = while_loop(lambda i, a: i < 5, body, (torch.tensor(0, device=DEV), torch.zeros((), device=DEV)))
    _close(a, table.cpu().sum())


def test_collectives_inside_loops_run_on_every_replica(tmp_path):
    import mp_workers

    import xlatorch.distributed.xla_multiprocessing as xmp

    n = 2
    xmp.spawn(mp_workers.loop_collectives, args=(str(tmp_path),), nprocs=n, start_method="forkserver")
    xs = [torch.arange(12.0).reshape(4, 3) + 100 * r for r in range(n)]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    for r in range(n):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        torch.testing.assert_close(got["total"], sum(xs).sum(0))
        torch.testing.assert_close(got["ys"], torch.maximum(*xs))
        torch.testing.assert_close(got["seen"], sum(x.sum() for x in xs))
        cpu = copy.deepcopy(model)
        loss = sum(cpu(x.reshape(1, 3)).pow(2).mean() / 4 for x in xs[r])
        loss.backward()
        _close(got["loss"], loss)
        _close(got["grad"], cpu.weight.grad)
