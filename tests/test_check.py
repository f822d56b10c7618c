"""``python -m xlatorch.check``: a dry run predicts the fallbacks, graph cuts, recompiles and
errors of a real run, with the user's lines, without uploading, compiling or running anything."""

import os
import sys

import check_models as cm
import pytest

import xlatorch.debug.metrics as met
from tests import warm
from xlatorch.check import check
from xlatorch.runtime.lower import cache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _device_work() -> tuple:
    """What a dry run must not do: compiles, executions, uploads."""

    def count(name):
        d = met.metric_data(name)
        return d[0] if d else 0

    return count("CompileTime"), count("ExecuteTime"), met.counter_value("TensorToData") or 0


def _both(name):
    factory = getattr(cm, name)
    before = _device_work()
    dry = check(factory)
    assert _device_work() == before, "the dry run compiled, ran or uploaded something"
    cache.CACHE.clear()  # the real run compiles every graph it needs, as in a fresh process
    fallbacks0 = {op: met.counter_value(op) or 0 for op, _ in dry.fallbacks}
    real = check(factory, dry_run=False)
    for op, n0 in fallbacks0.items():  # the real run's own metrics count the fallbacks predicted
        assert (met.counter_value(op) or 0) - n0 == sum(n for (o, _), n in dry.fallbacks.items() if o == op)
    return dry, real


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", ["mlp", "cnn", "with_read", "with_branch", "with_fallback", "with_mask", "growing",
                                  "wrong_device", "unsupported_dtype", "bert"])  # fmt: skip
def test_a_dry_run_predicts_what_a_real_run_counts(name):
    if name == "bert":
        pytest.importorskip("transformers")
    dry, real = _both(name)
    assert dry.fallbacks == real.fallbacks
    assert dry.cuts == real.cuts
    assert [r.source for r in dry.recompiles] == [r.source for r in real.recompiles]
    assert type(dry.error) is type(real.error)
    assert [(f.kind, f.what, f.source, f.count) for f in dry.findings if f.kind != "recompile"] == [
        (f.kind, f.what, f.source, f.count) for f in real.findings if f.kind != "recompile"
    ]


def test_a_model_that_lowers_everything_has_no_findings():
    for name in ("mlp", "cnn"):
        r = check(getattr(cm, name))
        assert r.findings == [], str(r)
        assert r.graphs >= 1


def test_a_fallback_is_named_with_its_line_and_a_fix():
    r = check(cm.with_fallback)
    assert r.fallbacks == {("aten::_unique2", cm.line("fallback")): 3}
    (f,) = [f for f in r.findings if f.kind == "fallback"]
    assert f.what == "aten::_unique2" and f.source == cm.line("fallback") and f.count == 3
    assert "ops.yaml" in f.fix
    assert "aten::_unique2" in str(r) and cm.line("fallback") in str(r)


def test_a_host_read_is_a_graph_cut_with_its_line():
    r = check(cm.with_read)
    assert r.cuts == {(".item()", cm.line("host read")): 3}
    assert [f.kind for f in r.findings] == ["graph cut"]
    assert "on the device" in r.findings[0].fix


def test_a_branch_on_a_value_read_on_the_host_goes_the_way_of_the_real_data():
    # The second read is True for these inputs; zeros would have said False and hidden the fallback.
    r = check(cm.with_branch)
    assert r.fallbacks == {("aten::_unique2", cm.line("fallback behind a branch")): 3}


def test_a_data_dependent_shape_is_a_graph_cut():
    r = check(cm.with_mask)
    ((cause, src),) = r.cuts
    assert "boolean-mask" in cause and src == cm.line("data-dependent")
    assert "fixed-shape" in r.findings[0].fix


def test_a_python_number_baked_into_the_graph_is_a_steady_state_recompile():
    r = check(cm.growing)
    (rec,) = r.recompiles
    assert rec.source == cm.line("baked-in number")
    assert "constant" in rec.reason and "aten::slice" in rec.reason
    (f,) = r.findings
    assert f.kind == "recompile" and "pad or bucket" in f.fix


def test_an_error_is_reported_with_the_users_line():
    r = check(cm.wrong_device)
    assert isinstance(r.error, RuntimeError) and "not an XLA tensor" in str(r.error)
    (f,) = r.findings
    assert f.kind == "error" and f.source == cm.line("CPU tensor")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_an_unsupported_dtype_is_an_error_at_its_line():
    r = check(cm.unsupported_dtype)
    assert isinstance(r.error, TypeError) and "unsupported dtype torch.complex32" in str(r.error)
    (f,) = r.findings
    assert f.kind == "error" and f.source == cm.line("unsupported dtype")


def test_a_cut_inside_a_library_names_the_librarys_line_and_the_phase():
    r = check(cm.mlp_adafactor)
    cuts = [s for (c, s), n in r.cuts.items() if c == ".item()" and n >= 3]
    assert any(s.startswith("torch/optim/") and s.endswith("(in the optimizer's step (Adafactor))") for s in cuts), (
        r.cuts
    )


def test_a_models_checks_on_its_inputs_are_no_cuts():
    """Hugging Face's BERT checks its inputs on the host in every forward (``pad_token_id in
    input_ids[:, [-1, 0]]``, ``torch.all(mask == 1)``): tiny graphs over values the host holds,
    run there without waiting for the device, so no cut is reported (each was one before)."""
    pytest.importorskip("transformers")
    r = check(cm.bert)
    assert not r.cuts, r.cuts


def test_the_command_line_prints_the_findings_and_exits_1(tmp_path):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    target = os.path.join(HERE, "check_models.py")
    p = warm.run([sys.executable, "-m", "xlatorch.check", f"{target}:with_fallback"], cwd=ROOT, env=env,
                 capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "aten::_unique2" in p.stdout and "check_models.py:" in p.stdout
    p = warm.run([sys.executable, os.path.join(ROOT, "tools", "coverage_report"), "--static", "check_models:mlp"],
                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "No CPU fallbacks" in p.stdout
    p = warm.run([sys.executable, "-m", "xlatorch.check", "no_such_module:f"], cwd=ROOT, env=env,
                 capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2 and "no_such_module" in p.stderr


def test_an_op_whose_lowering_fails_is_an_error_at_its_line():
    from xlatorch.runtime.ir.ops import SPECS

    spec = SPECS["relu.default"]
    orig = spec.emit

    def broken(*args):
        raise TypeError("this lowering does not take these arguments")

    spec.emit = broken
    cache.CACHE.clear()
    try:
        r = check(cm.mlp)
        assert isinstance(r.error, TypeError), r.error
        (f,) = r.findings
        assert f.kind == "error" and f.source == cm.line("relu")
        assert check(cm.mlp, lower=False).findings == []  # without tracing the lowering, it is not seen
    finally:
        spec.emit = orig
        cache.CACHE.clear()


def test_a_host_read_through_an_in_place_op_leaves_the_inputs_as_they_were():
    import torch

    x = torch.randn(8, 16)
    before = x.clone()

    class InPlace(cm.Mlp):
        def forward(self, x):
            h = x.mul_(2).add_(1)  # in place on the device input; the dry run computes it on CPU
            if h.sum().item() > 1e9:
                h = h * 0
            return self.b(torch.relu(self.a(h)))

    r = check(lambda: (InPlace(), (x,), cm._loss), steps=1)
    assert r.error is None and len(r.cuts) == 1
    assert torch.equal(x, before)
