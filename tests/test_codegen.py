"""ops.yaml validation and the generated/ staleness check."""

import sys

import pytest

from codegen import registry, schema
from codegen.gen import ROOT
from tests import warm


def _load(tmp_path, text):
    p = tmp_path / "ops.yaml"
    p.write_text(text)
    return registry.load(str(p), schema.load()[0])


@pytest.mark.parametrize(
    "text, msg",
    [
        ("add.Nope: self + other\n", "entry 'add.Nope': no ATen overload"),
        ("add.Tensor: self + othr\n", "entry 'add.Tensor': unknown name 'othr'"),
        ("add.Tensor:\n  lower: self\n  colour: red\n", "entry 'add.Tensor': unknown field"),
        ("mul.Tensor: self\nmul.Tensor: other\n", "entry 'mul.Tensor' appears twice"),
        ("add.Tensor:\n  lower: self\n  promote: sideways\n", "promote must be one of"),
        ("add.Tensor:\n  lower: self\n  static: [beta]\n", "static names unknown argument 'beta'"),
        ("mul.Tensor:\n  lower: self\n  scatter: src\n", "'scatter' is only for view ops"),
        ("clone:\n  lower: self\n  copies: yes please\n", "copies is true or false"),
        ("t:\n  lower: self.T\n  copies: true\n", "copies is true or false, and only for a non-view op"),
        ("add.Tensor:\n  lower: self\n  validate: V.mm(self, alpha)\n", r"validate reads the traced number\(s\)"),
        ("abs:\n  lower: self\n  refuse_dtypes: {dtypes: [bool], error: 'Oops: no'}\n", "refuse_dtypes: error is"),
        ("abs:\n  lower: self\n  refuse_dtypes: {dtypes: [boolean], error: 'RuntimeError: x'}\n", "'boolean' is not a"),
        ("mul.Tensor:\n  lower: self\n  keeps_scalar: [divisor]\n", "keeps_scalar names unknown argument 'divisor'"),
        ("mul.Tensor:\n  lower: self\n  lower_inplace: othr\n", r"\(lower_inplace\): unknown name 'othr'"),
        ("mul.Tensor:\n  lower: self\n  variants: false\n  lower_inplace: self\n", "lower_inplace needs a lower and"),
    ],
)
def test_bad_entries_are_rejected_by_name(tmp_path, text, msg):
    with pytest.raises(registry.RegistryError, match=msg):
        _load(tmp_path, text)


def test_good_entry(tmp_path):
    (e,) = _load(tmp_path, "add.Tensor:\n  lower: self + other * alpha\n  promote: default\n")
    assert e.schema.name == "add.Tensor" and [a.kind for a in e.schema.args[:3]] == ["TENSOR", "TENSOR", "SCALAR"]


def test_generated_is_fresh():
    r = warm.run([sys.executable, "tools/gen_ops.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_check_fails_when_stale(tmp_path):
    out = tmp_path / "gen"
    out.mkdir()
    r = warm.run([sys.executable, "tools/gen_ops.py", "--check", "--out", str(out)], cwd=ROOT,
                 capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1 and "stale" in r.stderr


def test_cli_reports_bad_entry(tmp_path):
    bad = tmp_path / "ops.yaml"
    bad.write_text("add.Tensor: self + bogus\n")
    r = warm.run([sys.executable, "tools/gen_ops.py", "--ops", str(bad), "--out", str(tmp_path)], cwd=ROOT,
                 capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "add.Tensor" in r.stderr and "bogus" in r.stderr


def test_an_entry_duplicating_a_generated_variant_is_rejected(tmp_path):
    from codegen.gen import build

    entries = _load(tmp_path, "add.Tensor: self + other * alpha\nadd_.Tensor: self + other * alpha\n")
    with pytest.raises(registry.RegistryError, match=r"aten.add_.Tensor would get two shims"):
        build(entries)


def test_keyword_overload_names_generate(tmp_path):
    from codegen.gen import build

    text = "random_.from:\n  lower: L.pointwise.random_int(out, seed, from_, to)\n  random: true\n"
    ctx = build(_load(tmp_path, text))
    assert ctx["shims"][0]["aten"] == 'getattr(aten.random_, "from")'


def test_an_in_place_op_writing_several_arguments(tmp_path):
    """``_amp_update_scale_`` writes ``self`` and ``growth_tracker``: its spec lists both and takes
    its avals from the functional op; an op returning nothing is accepted only in that case."""
    from codegen.gen import build

    ctx = build(_load(tmp_path, "_amp_update_scale_:\n  helper: amp.update_scale\n"))
    (spec,) = ctx["specs"]
    assert spec.mutates == (0, 1) and spec.meta == "aten._amp_update_scale.default"
    with pytest.raises(registry.RegistryError, match="returns NONE"):
        _load(tmp_path, "_foreach_zero_:\n  lower: '[a * 0 for a in self]'\n")
