"""Random numbers on the device: in the graph, reproducible from a seed, fresh each step."""

import os
import sys

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

N = 20000
_ones = lambda: torch.ones(N, device="xla")  # noqa: E731

# name -> (draw on the device, check on CPU of the drawn values)
OPS = {
    "rand": (
        lambda: torch.rand(N, device="xla"),
        lambda r: 0 <= r.min() and r.max() < 1 and abs(r.mean() - 0.5) < 0.02,
    ),
    "randn": (lambda: torch.randn(N, device="xla"), lambda r: abs(r.mean()) < 0.05 and abs(r.std() - 1) < 0.05),
    "randint": (
        lambda: torch.randint(3, 9, (N,), device="xla"),
        lambda r: r.dtype == torch.int64 and set(r.unique().tolist()) == set(range(3, 9)),
    ),
    "randperm": (
        lambda: torch.randperm(1000, device="xla"),
        lambda r: torch.equal(r.sort().values, torch.arange(1000)),
    ),
    "bernoulli": (lambda: torch.bernoulli(_ones() * 0.3), lambda r: abs(r.mean() - 0.3) < 0.02),
    "bernoulli_": (lambda: _ones().bernoulli_(0.7), lambda r: abs(r.mean() - 0.7) < 0.02),
    "dropout": (
        lambda: torch.nn.functional.dropout(_ones(), 0.25),
        lambda r: r.unique().tolist() == [0.0, torch.tensor(4 / 3).item()]
        and abs((r == 0).float().mean() - 0.25) < 0.02,
    ),
    "normal_": (lambda: _ones().normal_(2.0, 3.0), lambda r: abs(r.mean() - 2) < 0.1 and abs(r.std() - 3) < 0.1),
    "normal": (
        lambda: torch.normal(_ones() * 5, 0.5),
        lambda r: abs(r.mean() - 5) < 0.05 and abs(r.std() - 0.5) < 0.05,
    ),
    "uniform_": (lambda: _ones().uniform_(-2, 4), lambda r: -2 <= r.min() and r.max() < 4 and abs(r.mean() - 1) < 0.1),
    "exponential_": (lambda: _ones().exponential_(2.0), lambda r: r.min() >= 0 and abs(r.mean() - 0.5) < 0.02),
    "multinomial": (
        lambda: torch.multinomial(torch.arange(1.0, 11.0, device="xla"), 5),
        lambda r: len(set(r.tolist())) == 5 and 0 <= r.min() and r.max() < 10,
    ),
    "multinomial_replacement": (
        lambda: torch.multinomial(torch.tensor([1.0, 3.0], device="xla"), N, True),
        lambda r: abs(r.float().mean() - 0.75) < 0.02,
    ),
}


@pytest.mark.parametrize("name", list(OPS))
def test_random_op_runs_in_the_graph_fresh_each_step(name):
    draw, check = OPS[name]
    seen = []
    for _ in range(3):
        seen.append(draw())
        xm.mark_step()
    vals = [s.cpu() for s in seen]
    for v in vals:
        assert check(v), v
    assert not torch.equal(vals[0], vals[1]) and not torch.equal(vals[1], vals[2])
    assert met.counter_value("UncachedCompile") == 1  # the seed is a parameter, never a constant
    assert not [k for k in met.counter_names() if k.startswith("aten::")], met.counter_names()


_SCRIPT = """
import torch, xlatorch, xlatorch.core.xla_model as xm
torch.manual_seed(7)
a = torch.rand(4, device="xla")
b = torch.nn.functional.dropout(torch.ones(6, device="xla"), 0.5)
xm.mark_step()
xm.set_rng_state(7)
c = torch.rand(4, device="xla")
state = xm.get_rng_state()
d = torch.randn(3, device="xla")
xm.set_rng_state(state)
e = torch.randn(3, device="xla")
print(repr([a.tolist(), b.tolist(), c.tolist(), d.tolist(), e.tolist()]))
"""


def test_a_random_op_draws_its_bits_from_xlas_generator_not_a_hash_in_the_graph():
    # lowering/rng.py: JAX's default Threefry writes its 20 rounds into the graph, a loop and
    # its kernels per random op (2-layer BERT: 9.8 s of XLA compile against 6.5 s).
    x = torch.ones(64, 64, device="xla")
    text = xm.get_stablehlo([torch.nn.functional.dropout(x, 0.1, training=True), torch.randn(8, device="xla")])
    assert text.count("stablehlo.rng_bit_generator") == 2
    assert "threefry" not in text.lower() and "stablehlo.while" not in text


def test_seed_reproduces_in_a_fresh_process():
    runs = [warm.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120)
            for _ in range(2)]  # fmt: skip
    for r in runs:
        assert r.returncode == 0, r.stderr
    a, b = (eval(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert a == b  # the same seed, the same numbers in a new process
    assert a[0] == a[2]  # torch.manual_seed and xm.set_rng_state agree
    assert a[3] == a[4]  # get_rng_state / set_rng_state replays


def test_manual_seed_in_process():
    torch.manual_seed(1234)
    a = torch.rand(8, device="xla").cpu()
    xm.mark_step()
    b = torch.rand(8, device="xla").cpu()
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(8, device="xla").cpu(), a)
    assert torch.equal(torch.rand(8, device="xla").cpu(), b)
    assert not torch.equal(a, b)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.drop(self.fc1(x).relu())
        h[:, :4] = h[:, 4:8] * 0.5  # a slice assignment inside the forward
        return self.fc2(h)


def test_training_with_dropout_and_slice_assignment_compiles_at_most_twice():
    torch.manual_seed(0)
    model = _Net().to("xla")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=gen)
    y = torch.randint(0, 4, (64,), generator=gen)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to("xla")), y.to("xla"))
        loss.backward()
        opt.step()
        xm.mark_step()
        losses.append(loss)
    losses = [l.item() for l in losses]  # noqa: E741
    assert met.counter_value("UncachedCompile") <= 2, met.metrics_report()
    assert not [k for k in met.counter_names() if k.startswith("aten::")], met.counter_names()
    assert losses[-1] < losses[0]
    # The dropout masks differ per step: the eval-mode loss of the final model is not any training loss.
    model.eval()
    with torch.no_grad():
        ev = torch.nn.functional.cross_entropy(model(x.to("xla")), y.to("xla")).item()
    assert all(abs(ev - v) > 1e-6 for v in losses)
