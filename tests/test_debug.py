"""xlatorch.debug: compile reasons, graph-cut report, the debug knob, graph dumps.

Shapes are unique to each test, so every test's first graph compiles in this process.
"""

import inspect
import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import xlatorch.core.xla_model as xm
import xlatorch.debug as xd
import xlatorch.debug.metrics as met
from tests import warm
from xlatorch.runtime.base import record
from xlatorch.runtime.ir import values as ir
from xlatorch.runtime.ir.values import Out
from xlatorch.runtime.trace.tensor import value_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def _fresh_records(debug_level_0):
    # Level 0 and no source flags, so each test sets what it checks (conftest.debug_level_0).
    yield


def _next_line() -> int:
    """The line number after the caller's line (where the statement under test is)."""
    return inspect.currentframe().f_back.f_lineno + 1


def _train(batch_sizes, features=13, classes=7, item=False):
    """A small SGD loop; returns the source lines of the model call and of ``loss.item()``."""
    torch.manual_seed(0)
    model = nn.Linear(features, classes).to("xla")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xm.mark_step()
    lines = {}
    for bs in batch_sizes:
        x = torch.randn(bs, features).to("xla")
        opt.zero_grad()
        lines["model"] = _next_line()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if item:
            lines["item"] = _next_line()
            loss.item()
        xm.mark_step()
    return lines


def test_batch_size_change_is_the_recompile_reason():
    with xd.level(1):
        _train([11, 11, 11])
        before = len(xd.compile_reasons())
        assert before >= 1 and xd.compile_reasons()[0].reason.startswith("first compile")
        lines = _train([5, 5, 5])
    new = xd.compile_reasons()[before:]
    # The second loop's first step also differs from the first loop's steady state only by
    # the batch: one compile, whose reason names the input and the line that reads it.
    assert len(new) == 1, [str(r) for r in new]
    rec = new[0]
    assert re.search(r"input \d+ changed shape: f32\[11,13\] -> f32\[5,13\]", rec.reason), rec.reason
    assert f"{HERE}:{lines['model']}" in rec.reason
    assert rec.source.endswith(f"{HERE}:{lines['model']}")
    assert rec.graph_nodes > 5 and rec.compile_ms > 0 and rec.sync == "mark_step"
    assert rec.memory is not None and rec.memory["argument"] >= 5 * 13 * 4


def test_item_in_loop_reported_with_its_line():
    steps = 4
    lines = _train([3] * steps, features=9, item=True)
    src = f"{HERE}:{lines['item']}"
    rows = {k: n for k, n in xd.sync_counts().items() if k[0] == ".item()"}
    assert len(rows) == 1, rows
    (((cause, where), n),) = rows.items()
    assert where.endswith(src) and n == steps
    assert xd.sync_counts(step=True) == {}  # the last step ended with mark_step
    report = xd.sync_report()
    assert re.search(rf"\b{steps}\s+\.item\(\)\s+\S*{re.escape(src)}", report), report


def test_print_and_cpu_are_named():
    x = torch.ones(6, 5).to("xla") * 3
    line = _next_line()
    print(x + 1)
    (x * 2).cpu()
    counts = xd.sync_counts(step=True)
    assert any(k[0] == "print" and k[1].endswith(f"{HERE}:{line}") for k in counts), counts
    assert any(k[0] == ".cpu()" and k[1].endswith(f"{HERE}:{line + 1}") for k in counts), counts


def test_cpu_fallback_reported_as_such():
    x = torch.rand(7, 3).to("xla") + 1  # pending: the fallback must cut the graph
    line = _next_line()
    torch.special.bessel_j0(x)
    assert met.counter_value("aten::special_bessel_j0") == 1
    keys = [k for k in xd.sync_counts() if k[0] == "CPU fallback aten::special_bessel_j0"]
    assert len(keys) == 1 and keys[0][1].endswith(f"{HERE}:{line}"), xd.sync_counts()


def test_data_dependent_ops_reported_as_such():
    # Over values the device computes (over values the host holds, their counts are read on the
    # host without waiting for the device: no cut)
    x = torch.tanh(torch.arange(10.0).to("xla") - 4)
    line = _next_line()
    nz = torch.nonzero(x)
    x2 = torch.tanh(torch.arange(11.0).to("xla") - 4)
    x2[x2 > 0]
    counts = xd.sync_counts()
    assert any(k == "data-dependent aten::nonzero" and s.endswith(f"{HERE}:{line}") for k, s in counts), counts
    assert any(k == "data-dependent boolean-mask indexing" and s.endswith(f"{HERE}:{line + 2}")
               for k, s in counts), counts  # fmt: skip
    assert nz.shape == (9, 1)


def test_data_dependent_size_change_is_named():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 0.0]).to("xla")
    for k in (0.5, 1.5):
        # (float work on the result: a changing graph of integer bookkeeping alone would run
        # on the host, compiling nothing; runtime/plan/stages.py)
        y = torch.nonzero(x > k) * 0.5  # noqa: F841
        xm.mark_step()
    rec = xd.compile_reasons()[-1]
    assert "data-dependent output of aten::nonzero changed: i64[3,1] -> i64[2,1]" in rec.reason, rec.reason


def test_constant_change_is_named():
    x = torch.rand(6, 6).to("xla")
    for d in (0, 1):
        y = torch.sum(x * 2, dim=d)  # noqa: F841  (alive at the cut: an output of the graph)
        xm.mark_step()
    rec = xd.compile_reasons()[-1]
    assert "constant dim of aten::sum.dim_IntList changed: (0,) -> (1,)" in rec.reason, rec.reason
    assert len(xd.compile_reasons()) == 2


def test_op_divergence_is_named_with_source_line():
    x = torch.rand(4, 9).to("xla")
    with xd.level(1):
        y = (x * 2).add(1)
        xm.mark_step()
        line = _next_line()
        y = (x * 2).sub(1)  # noqa: F841
        xm.mark_step()
    rec = xd.compile_reasons()[-1]
    assert "op sequence diverges at node 1: aten::add.Tensor" in rec.reason, rec.reason
    assert f"aten::sub.Tensor ({HERE}:{line})" in rec.reason


def test_scalar_kind_change_is_named():
    x = torch.rand(5, 8).to("xla")
    y = x * 2.5
    xm.mark_step()
    y = x * torch.tensor(2.5)  # noqa: F841  (a 0-d CPU tensor promotes as a tensor, not as a number)
    xm.mark_step()
    rec = xd.compile_reasons()[-1]
    assert "changed type: a Python number (f64) -> a 0-d CPU tensor (f32)" in rec.reason, rec.reason


def test_level_knob_and_context_manager():
    assert xd.get_level() == 0 and not ir.DEBUG_SOURCE
    with xd.level(2):
        assert xd.get_level() == 2 and ir.DEBUG_SOURCE
        y = torch.ones(3).to("xla") * 2
    assert xd.get_level() == 0 and not ir.DEBUG_SOURCE
    assert value_of(y).node.src is not None
    z = torch.ones(3).to("xla") * 2
    assert getattr(value_of(z).node, "src", None) is None  # level 0 records nothing per op


def test_level_2_and_3_log_memory_step_table_and_ir(capsys):
    with xd.level(3):
        x = torch.rand(3, 17).to("xla")
        (x * 4).sum().item()
        xm.mark_step()
    err = capsys.readouterr().err
    assert "xlatorch: Compilation Analysis: first compile" in err
    assert "memory: arguments" in err and "IR {" in err and "aten::sum" in err
    assert "graph cuts in step" in err and "xlatorch: Execution Analysis: .item() at" in err


_SCRIPT = """
import torch, xlatorch
import xlatorch.core.xla_model as xm
x = torch.ones(4, 4).to("xla")
(x @ x).sum().item()
xm.mark_step()
"""


@pytest.mark.parametrize("env,logs", [({}, False), ({"XLATORCH_DEBUG": "1"}, True), ({"PT_XLA_DEBUG": "1"}, True)])
def test_environment_knob_logs(tmp_path, env, logs):
    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in ("XLATORCH_DEBUG", "PT_XLA_DEBUG", "PT_XLA_DEBUG_LEVEL")}
    res = warm.run([sys.executable, str(script)], env=dict(base, PYTHONPATH=ROOT, **env), cwd=tmp_path,
                   capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert ("xlatorch: Compilation Analysis: first compile" in res.stderr) == logs, res.stderr
    assert ("xlatorch: Execution Analysis: .item() at prog.py:5" in res.stderr) == logs, res.stderr
    summary = "xlatorch: Run summary: 1 compile(s) "
    assert (summary in res.stderr and "1  .item()  prog.py:5" in res.stderr) == logs, res.stderr


def _pending(m=6, k=10, n=3):
    a = torch.rand(m, k).to("xla")
    b = torch.rand(k, n).to("xla")
    line = _next_line()
    y = torch.relu(a @ b + 1)
    return y, (y.sum(0) * 0.5), line


def test_ir_text_lists_every_node_with_source():
    with xd.level(1):
        y, s, line = _pending()
    text = xd.ir_text([y, s])
    nodes = [ln for ln in text.splitlines() if re.match(r"\s+%\d+ = ", ln)]
    assert text.startswith("IR {") and text.endswith("}") and len(nodes) >= 4
    mm = [ln for ln in nodes if "aten::mm(" in ln]
    assert len(mm) == 1 and ": f32[6,3]" in mm[0] and f"# {HERE}:{line}" in mm[0]
    assert re.search(r"ROOT \(%\d+, %\d+\)", text)


def test_backward_ops_point_at_the_backward_call():
    w = torch.rand(5, 3).to("xla").requires_grad_()
    with xd.level(1):
        fwd = _next_line()
        loss = (w * 3).sum()
        bwd = _next_line()
        loss.backward()
    text = xd.ir_text(w.grad)
    # Built on autograd's thread: attributed to the line waiting in backward(), and marked.
    assert re.search(rf"aten::mul\.Tensor\(.*# {HERE}:{bwd}, backward$", text, re.M), text
    assert re.search(rf"aten::sum\(.*# {HERE}:{fwd}$", text, re.M), text


def test_hlo_text_parses():
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir as mlir_ir

    y, s, _ = _pending()
    text = xd.hlo_text([y, s])
    assert "stablehlo.dot_general" in text
    with mlir.make_ir_context():
        module = mlir_ir.Module.parse(text)
    assert "func.func" in str(module)
    hlo = xd.hlo_text([y, s], dialect="hlo")
    assert hlo.startswith("HloModule") and "ENTRY" in hlo and " dot(" in hlo
    assert hlo.count("{") == hlo.count("}")


def test_hlo_debug_puts_source_lines_in_metadata(monkeypatch):
    monkeypatch.setattr(record, "HLO_DEBUG", True)
    monkeypatch.setattr(ir, "DEBUG_SOURCE", True)
    y, _, line = _pending()
    hlo = xd.hlo_text(y, dialect="hlo")
    assert f'op_name="jit(fn)/aten::mm({HERE}:{line})/dot_general' in hlo, hlo


def test_dot_text_structure():
    y, s, _ = _pending()
    dot = xd.dot_text([y, s])
    assert dot.startswith("digraph") and dot.count("{") == dot.count("}")
    ir_nodes = len(re.findall(r"^\s+%\d+ = ", xd.ir_text([y, s]), re.M))
    declared = set(re.findall(r"^\s+(n\d+|i\d+) \[label=", dot, re.M))
    assert len([d for d in declared if d.startswith("n")]) == ir_nodes
    edges = re.findall(r"^\s+(\w+) -> (\w+);", dot, re.M)
    assert edges and all(a in declared and b in declared for a, b in edges)
    assert dot.count("peripheries=2") == 2  # the two outputs


def test_dumps_do_not_sync_or_change_the_next_step():
    y, s, _ = _pending(5, 12, 2)
    xd.ir_text([y, s]), xd.hlo_text([y, s]), xd.dot_text([y, s])
    assert type(value_of(y)) is Out and type(value_of(s)) is Out
    assert met.counter_value("UncachedCompile") is None
    xm.mark_step()
    assert met.counter_value("UncachedCompile") == 1
    assert xd.compile_reasons()[-1].reason.startswith("first compile")
    y2, s2, _ = _pending(5, 12, 2)
    xm.mark_step()
    assert met.counter_value("UncachedCompile") == 1 and met.counter_value("CachedCompile") == 1
    expected = torch.relu(y2.cpu()).sum(0) * 0.5
    assert torch.allclose(s2.cpu(), expected)
