"""xlatorch.debug.compare: the first op whose device result diverges from CPU's, on training steps.

Ops are made wrong on purpose by swapping their lowering (``OpSpec.emit``) for one that is off
by a relative 1e-3 (far beyond float32 rounding, far below anything a loss would show), and
the executable cache is emptied around it so no other test meets the wrong program.
"""

import os
import sys

import jax.numpy as jnp
import pytest
import torch
import torch.nn as nn

import xlatorch.core.xla_model as xm
import xlatorch.debug as xd
from tests import warm
from xlatorch.backends import get_mat_mul_precision, set_mat_mul_precision
from xlatorch.runtime.ir.ops import SPECS
from xlatorch.runtime.lower import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.basename(__file__)
DEV = xm.xla_device()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 48)
        self.fc2 = nn.Linear(48, 32)
        self.fc3 = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.tanh(self.fc2(h))  # the op made wrong
        return self.fc3(h)


TANH_LINE = next(i for i, line in enumerate(open(__file__), 1) if line.strip().endswith("# the op made wrong"))


def _setup(opt_cls=torch.optim.SGD, seed=0):
    torch.manual_seed(seed)
    model = MLP().to(DEV)
    opt = opt_cls(model.parameters(), lr=0.05)
    x = torch.randn(6, 12).to(DEV)
    y = torch.randint(0, 5, (6,)).to(DEV)
    xm.mark_step()

    def step(autocast=False):
        opt.zero_grad()
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


@pytest.fixture
def off_by(request):
    """``off_by(name, rel, dtype=None)``: op ``name``'s lowering multiplies its result by
    ``1 + rel`` (only results of ``dtype``, if given); restored after the test."""
    saved = []

    def patch(name, rel, dtype=None):
        spec = SPECS[name]
        orig = spec.emit

        def wrong(out, *args):
            r = orig(out, *args)
            if dtype is not None and out.dtype != dtype:  # out: the result's expected aval
                return r
            return (r.astype(jnp.float32) * (1 + rel)).astype(r.dtype)

        saved.append((spec, orig))
        spec.emit = wrong
        cache.CACHE.clear()

    yield patch
    for spec, orig in saved:
        spec.emit = orig
    cache.CACHE.clear()


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_a_correct_training_step_has_no_divergence(opt_cls):
    _, _, step = _setup(opt_cls)
    report = xd.compare(step)
    assert report.first is None, str(report)
    assert report.diverged == [] and report.growth == []
    assert report.checked > 20
    assert "no divergence" in str(report)
    assert isinstance(report.result, torch.Tensor)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_a_wrong_op_in_the_middle_is_the_first_divergence(off_by, opt_cls):
    off_by("tanh.default", 1e-3)
    _, _, step = _setup(opt_cls)
    report = xd.compare(step)
    first = report.first
    assert first is not None, str(report)
    assert first.op == "aten::tanh" and first.kind == "diverged"
    assert os.path.basename(first.src[0]) == HERE and first.src[1] == TANH_LINE
    assert first.inputs == ["f32[6,32]"] and first.outputs == ["f32[6,32]"]
    assert 5e-4 < first.max_rel < 2e-3 and first.max_abs > 100 * first.allowed
    # the ops after it use the device's (wrong) inputs in the local check: only tanh is flagged
    assert [d.op for d in report.diverged] == ["aten::tanh"]
    # growth: from the culprit through the rest of the step to the loss and the updated parameters
    assert report.growth[0].index == first.index
    labels = {g.label: g for g in report.growth}
    assert labels["result"].max_abs > 0
    assert labels["grad of fc2.weight"].max_rel > 1e-5
    assert labels["parameter fc1.weight"].max_abs > 0
    text = str(report)
    assert f"first divergence: #{first.index} aten::tanh at " in text
    assert f"{HERE}:{TANH_LINE}" in text
    assert "growth of the difference" in text and "parameter fc3.weight" in text


def test_a_wrong_backward_op_carries_the_backward_line(off_by):
    off_by("tanh_backward.default", 1e-3)
    _, _, step = _setup()
    report = xd.compare(step)
    assert report.first is not None and report.first.op == "aten::tanh_backward", str(report)
    assert report.first.src[2:] == ("backward",)


def test_autocast_bf16_differences_are_rounding_not_divergence():
    _, _, step = _setup(torch.optim.Adam)
    report = xd.compare(step, autocast=True)
    assert report.first is None, str(report)
    assert all(d.mode == "autocast" and d.kind == "rounding" for d in report.rounding)
    if report.rounding:
        assert "bf16 rounding (autocast)" in str(report)


def test_a_bf16_ulp_under_autocast_is_rounding_but_the_same_in_float32_diverges(off_by):
    # About one bfloat16 ulp (2**-8 relative rounds to 0 or 1 ulp): bf16 rounding. The same
    # nudge of a float32 result is 2**15 float32 ulps: a divergence.
    off_by("addmm.default", 2.0**-8, dtype=jnp.bfloat16)
    _, _, step = _setup()
    report = xd.compare(step, autocast=True)
    assert report.first is None, str(report)
    assert any(d.op == "aten::addmm" and d.mode == "autocast" for d in report.rounding), str(report)
    assert "bf16 rounding (autocast)" in str(report) and "aten::addmm" in str(report)


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_a_bf16_ulp_of_a_float32_matmul_is_rounding_only_at_default_precision(off_by, precision):
    # 'default' allows one bfloat16 pass (TPU; TF32 on GPU): a float32 matmul off by a bf16
    # ulp is that rounding. At 'highest' it is a divergence.
    off_by("addmm.default", 2.0**-8)
    prev = get_mat_mul_precision()
    set_mat_mul_precision(precision)
    try:
        _, _, step = _setup()
        report = xd.compare(step)
    finally:
        set_mat_mul_precision(prev)
    if precision == "default":
        assert report.first is None, str(report)
        assert {d.op for d in report.rounding} == {"aten::addmm"}, str(report)
        assert "bf16 rounding (mat_mul_precision 'default')" in str(report)
    else:
        assert report.first is not None and report.first.op == "aten::addmm", str(report)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_compare_advances_the_state_exactly_once(opt_cls):
    model, opt, step = _setup(opt_cls)
    report = xd.compare(step)
    assert report.first is None, str(report)
    ref_model, ref_opt, ref_step = _setup(opt_cls)
    loss = ref_step()
    xm.mark_step()
    assert torch.allclose(report.result.cpu(), loss.cpu(), rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p.cpu(), q.cpu(), rtol=1e-6, atol=1e-7), name
        assert torch.allclose(p.grad.cpu(), q.grad.cpu(), rtol=1e-6, atol=1e-7), name
    if opt_cls is torch.optim.Adam:
        for p in model.parameters():
            assert int(opt.state[p]["step"].cpu()) == 1
    # and a second step goes on from there, on the device
    step()
    xm.mark_step()
    ref_step()
    xm.mark_step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p.cpu(), q.cpu(), rtol=1e-5, atol=1e-6)


_SCRIPT = """\
import jax.numpy as jnp
import torch, torch.nn as nn
import xlatorch.core.xla_model as xm
from xlatorch.runtime.ir.ops import SPECS

spec = SPECS["gelu.default"]
orig = spec.emit
spec.emit = lambda out, *a: orig(out, *a) * (1 + 1e-3)
torch.manual_seed(0)
dev = xm.xla_device()
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(4, 8).to(dev), torch.randn(4, 3).to(dev)
before = model[0].weight.cpu().clone()
for _ in range(2):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    xm.mark_step()
print("changed", not torch.equal(before, model[0].weight.cpu()))
"""


@pytest.mark.parametrize("on", [False, True])
def test_the_environment_switch_logs_the_culprit_at_each_step(tmp_path, on):
    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in ("XLATORCH_DEBUG", "PT_XLA_DEBUG", "XLATORCH_COMPARE")}
    env = dict(base, PYTHONPATH=ROOT, XLATORCH_COMPARE="1" if on else "0")
    res = warm.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                   timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "changed True" in res.stdout
    assert (res.stderr.count("first divergence: ") == 2) == on, res.stderr
    if on:
        assert "aten::gelu at prog.py:17" in res.stderr, res.stderr
