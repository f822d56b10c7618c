"""tools/coverage_report: a program's CPU fallbacks with counts and source lines; static coverage."""

import sys
import textwrap

from codegen.gen import ROOT
from tests import warm
from tools import coverage_report


def test_report_names_op_count_and_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""\
        import torch
        import xlatorch
        x = torch.randn(4, 5, device="xla")
        for _ in range(3):
            y = torch.special.bessel_j0(x) + 1
        print(float(y.sum()))
        """)
    )
    r = warm.run([sys.executable, "tools/coverage_report", str(script)], cwd=ROOT, capture_output=True,
                 text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("aten::")]
    assert rows == [["aten::special_bessel_j0", "3", f"{script}:5", "missing"]], r.stdout
    assert "1 ops fell back to CPU, 3 calls in all." in r.stdout


def test_report_of_a_clean_program(tmp_path):
    script = tmp_path / "clean.py"
    script.write_text("import torch, xlatorch\nprint((torch.ones(3, device='xla') * 2).sum().item())\n")
    rc, records = coverage_report.run([str(script)])
    assert rc == 0 and records == {}


def test_exit_code_of_a_failing_program_is_kept(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit(3)\n")
    rc, _ = coverage_report.run([str(script)])
    assert rc == 3


def test_static_statuses_match_the_registry():
    status = coverage_report.op_status()
    assert status["add.Tensor"] == status["add_.Tensor"] == status["add.out"] == "lowered"  # variants generated
    assert status["copy_.default"] == "lowered"  # a runtime handler
    assert status["special_bessel_j0.default"] == "unlisted"


def test_every_core_aten_overload_is_lowered_or_decomposed():
    covered, total, missing = coverage_report.core_coverage()
    assert total == 193
    assert not missing, f"{len(missing)} core overloads neither lowered nor decomposed: {missing}"
