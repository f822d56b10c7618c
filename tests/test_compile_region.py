"""``xlatorch.compile`` (``torch_xla.compile``): a region traced lazily and run as one graph at its end.

Values are compared with PyTorch eager on CPU; graphs, compiles and cuts are counted through
the metrics API.
"""

import logging
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests import warm
from xlatorch.debug import explain, knob
from xlatorch.runtime.base import regions
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.trace import tensor as T


def _executions() -> int:
    xm.wait_device_ops()
    data = met.metric_data("ExecuteTime")
    return 0 if data is None else data[0]


def _compiles() -> int:
    return met.counter_value("UncachedCompile") or 0


def _is_data(t) -> bool:
    return type(T.value_of(t)) is Data


def sin_cos(x):
    return torch.sin(x) + torch.cos(x)


@pytest.mark.parametrize("form", ["decorator", "decorator()", "wrapper", "context"])
def test_every_form_runs_one_graph_equal_to_cpu(form):
    cpu = torch.randn(4, 4)
    x = cpu.to("xla")
    if form == "decorator":
        f = xlatorch.compile(sin_cos)
    elif form == "decorator()":
        f = xlatorch.compile()(sin_cos)
    elif form == "wrapper":
        f = xlatorch.compile(sin_cos, name="wrapped")
    else:

        def f(t):
            with xlatorch.compile():
                return sin_cos(t)

    met.clear_all()
    for _ in range(3):
        got = f(x)
        assert _is_data(got)  # the region's end ran its graph
    assert _executions() == 3
    assert _compiles() <= 1  # the same graph each call (compiled by an earlier test, or now)
    torch.testing.assert_close(got.cpu(), sin_cos(cpu))
    assert not regions.ACTIVE


def test_pending_work_runs_apart_before_the_region():
    cpu = torch.randn(3)
    x = cpu.to("xla")
    before = x * 2  # pending when the region starts: it runs first, as a graph of its own
    f = xlatorch.compile(sin_cos)
    met.clear_all()
    got = f(before)
    assert _executions() == 2
    torch.testing.assert_close(got.cpu(), sin_cos(cpu * 2))
    # The region's graph does not hold the earlier work: a second call with data compiles nothing.
    compiles = _compiles()
    f(before)
    assert _compiles() == compiles


def test_a_compiled_method_and_a_module():
    class Holder:
        @xlatorch.compile
        def step(self, x):
            return x.relu() * 3

    cpu = torch.randn(5)
    torch.testing.assert_close(Holder().step(cpu.to("xla")).cpu(), cpu.relu() * 3)
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    want = lin(x)
    got = xlatorch.compile(lin.to("xla"))(x.to("xla"))
    torch.testing.assert_close(got.cpu(), want)


def test_nested_regions_are_one_graph():
    cpu = torch.randn(4)
    inner = xlatorch.compile(sin_cos)

    @xlatorch.compile
    def outer(x):
        return inner(x) * inner(x + 1)

    met.clear_all()
    got = outer(cpu.to("xla"))
    assert _executions() == 1
    torch.testing.assert_close(got.cpu(), sin_cos(cpu) * sin_cos(cpu + 1))


def test_an_inner_full_graph_region_holds_inside_it_only():
    cpu = torch.randn(4)
    x = cpu.to("xla")
    with xlatorch.compile():
        y = x * 2
        y.sum().item()  # the outer region runs in pieces
        with pytest.raises(RuntimeError, match="Unexpected execution"):
            with xlatorch.compile(full_graph=True, name="inner"):
                (y + 1).sum().item()
        z = y + 3
    torch.testing.assert_close(z.cpu(), cpu * 2 + 3)
    assert not regions.ACTIVE


def test_a_region_that_raises_still_runs_its_work_and_leaves():
    x = torch.ones(3, device="xla")
    kept = []

    @xlatorch.compile
    def boom(t):
        kept.append(t + 1)
        raise ValueError("from the body")

    with pytest.raises(ValueError, match="from the body"):
        boom(x)
    assert not regions.ACTIVE
    assert _is_data(kept[0])
    torch.testing.assert_close(kept[0].cpu(), torch.full((3,), 2.0))


def _read(t):
    return t.sum().item()


def _print(t):
    print(t)


def _fallback(t):
    return torch.special.bessel_j0(t)


def _mark(t):
    xm.mark_step()


@pytest.mark.parametrize(
    "cut, cause",
    [(_read, r"\.item\(\)"), (_print, "print"), (_fallback, "CPU fallback aten::special_bessel_j0"),
     (_mark, "mark_step")],
)  # fmt: skip
def test_full_graph_raises_at_a_cut_naming_the_line_and_the_cause(cut, cause):
    x = torch.randn(4, device="xla")

    def f(t):
        y = t * 2 + 1
        cut(y)
        return y

    line = cut.__code__.co_firstlineno + 1  # the body line of the cut
    before = torch._C._dispatch_tls_local_exclude_set()
    with pytest.raises(RuntimeError, match="Unexpected execution happens inside the compiled function") as info:
        xlatorch.compile(f, full_graph=True)(x)
    msg = str(info.value)
    assert f"test_compile_region.py:{line}" in msg, msg
    assert "full_graph=True" in msg and "'f'" in msg
    assert re.search(cause, msg), msg
    assert not regions.ACTIVE
    # The error, alive, holds nothing that changes how ops dispatch (print: PyTorch's printing
    # turns functorch off in a local the traceback would keep): vmap works with it.
    assert torch._C._dispatch_tls_local_exclude_set() == before
    torch.testing.assert_close(torch.vmap(torch.mul)(x.cpu(), x.cpu()), x.cpu() * x.cpu())
    # Without full_graph the region runs in pieces, with the right values.
    got = xlatorch.compile(f)(x)
    torch.testing.assert_close(got.cpu(), x.cpu() * 2 + 1)


def test_full_graph_only_reads_ready_data():
    cpu = torch.randn(4)
    x = cpu.to("xla")
    with xlatorch.compile(full_graph=True):
        y = sin_cos(x)
        v = x.cpu()  # device data: no graph runs for it
    torch.testing.assert_close(v, cpu)
    torch.testing.assert_close(y.cpu(), sin_cos(cpu))


def test_max_different_graphs_counts_over_calls_and_names_what_changed():
    def foo(t):
        return t + t

    for _ in range(2):  # the same graph again: still one
        xlatorch.compile(foo, max_different_graphs=1)(torch.rand(10, device="xla"))
    with pytest.raises(RuntimeError, match="Maximum number of different graphs allowed per function exceeded: 1") as e:
        xlatorch.compile(foo, max_different_graphs=1)(torch.rand(5, device="xla"))
    assert "input 0 changed shape: f32[10] -> f32[5]" in str(e.value)
    assert "'foo'" in str(e.value)
    xm.mark_step()  # the refused graph was left pending: it runs outside the region


def test_max_different_graphs_names_a_changed_op_and_allows_n():
    def bar(t, step):
        return t + t if step == 0 else t * 5 if step == 1 else t - 1

    f = xlatorch.compile(bar, max_different_graphs=2, name="bar_step")
    x = torch.rand(10, device="xla")
    f(x, 0)
    f(x, 1)
    f(x, 0)
    with pytest.raises(RuntimeError, match="exceeded: 2") as e:
        f(x, 2)
    assert "op sequence diverges at node 0: aten::" in str(e.value)
    assert "'bar_step'" in str(e.value)
    xm.mark_step()


def test_max_different_graphs_is_validated():
    with pytest.raises(ValueError, match="max_different_graphs"):
        xlatorch.compile(sin_cos, max_different_graphs=0)
    with pytest.raises(TypeError, match="custom_compile_options"):
        xlatorch.compile(sin_cos, custom_compile_options=["xla_foo"])


def test_the_name_is_in_the_debug_output(caplog):
    x = torch.randn(3, device="xla")
    xm.mark_step()
    explain.clear()

    @xlatorch.compile(name="my_forward")
    def f(t):
        y = t.sin() * 3.5  # a graph no earlier test compiled
        print(y)
        return y.cos()

    with knob.level(1), caplog.at_level(logging.INFO, logger="xlatorch"):
        knob.LOG.propagate = True
        try:
            f(x)
        finally:
            knob.LOG.propagate = False
    text = caplog.text
    assert "cut the graph 'my_forward'" in text, text
    assert "graph 'my_forward'" in text
    assert all(r.name == "my_forward" for r in explain.compile_reasons())


def test_custom_compile_options_reach_xla_and_name_the_dump(tmp_path):
    cpu = torch.randn(6)
    x = cpu.to("xla")

    def double_step(t):
        return t * 4.25 - 1

    got = xlatorch.compile(double_step, name="dump me", custom_compile_options={"xla_dump_to": str(tmp_path)})(x)
    torch.testing.assert_close(got.cpu(), cpu * 4.25 - 1)
    names = os.listdir(tmp_path)  # XLA wrote its dump there, under the region's name
    assert any("jit_dump_me" in n for n in names), names
    # An option XLA does not know is refused by XLA, with a note naming where it came from.
    with pytest.raises(Exception, match="xla_no_such_option") as info:
        xlatorch.compile(double_step, custom_compile_options={"xla_no_such_option": True})(x)
    assert any("custom_compile_options" in n for n in getattr(info.value, "__notes__", []))
    xm.mark_step()


def test_custom_compile_options_are_part_of_the_cache_key():
    x = torch.randn(6, device="xla")
    xm.mark_step()

    def step(t):
        return t * 3.75 + 2

    opts = {"xla_cpu_enable_fast_math": False}
    base = _compiles()
    xlatorch.compile(step)(x)
    xlatorch.compile(step, custom_compile_options=opts)(x)  # other options: another executable
    assert _compiles() == base + 2
    xlatorch.compile(step, custom_compile_options=dict(opts))(x)  # the same options: cached
    xlatorch.compile(step)(x)
    assert _compiles() == base + 2


def test_a_compiled_training_step_matches_cpu():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model.load_state_dict(ref.state_dict())
    model.to("xla")
    batches = [(torch.randn(5, 8), torch.randint(0, 3, (5,))) for _ in range(3)]

    def step_fn(model, data, target, opt):
        opt.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        opt.step()
        return loss

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = [step_fn(ref, x, y, ref_opt).detach() for x, y in batches]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = xlatorch.compile(step_fn, full_graph=True)
    got = [compiled(model, x.to("xla"), y.to("xla"), opt) for x, y in batches]
    # Plain SGD passes the gradients' rounding on unamplified (tests/tolerances.py).
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def test_a_region_used_from_another_thread_is_that_threads_own():
    import threading

    x = torch.randn(3, device="xla")
    seen = []

    def other():
        seen.append(regions.current())

    with xlatorch.compile(full_graph=True):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert regions.current() is not None
    assert seen == [None]
    del x


# torch_xla's guide to eager mode and torch_xla.compile (docs/source/learn/eager.md), with a small
# model in place of torchvision's ResNet, run unmodified by the compat runner.
GUIDE = """
import sys
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.core.xla_model as xm

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
state = {k: v.clone() for k, v in net.state_dict().items()}
data = torch.randn(6, 8)
target = torch.randint(0, 4, (6,))

# Run ops eagerly by default
torch_xla.experimental.eager_mode(True)
assert torch_xla.experimental.is_eager_mode()

device = torch_xla.device()
model = net.to(device)

# Mark the function to be compiled
compiled_model = torch_xla.compile(model)
input = data.to(device)

# Compilation and execution happens right away.
res = compiled_model(input)
xm.wait_device_ops()
executions = met.metric_data("ExecuteTime")[0]

def step_fn(model, data, target, loss_fn, optimizer):
    optimizer.zero_grad()
    logits = model(data)
    loss = loss_fn(logits, target)
    loss.backward()
    optimizer.step()
    return loss

step_fn = torch_xla.compile(step_fn)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
losses = [step_fn(model, data.to(device), target.to(device), torch.nn.CrossEntropyLoss(), optimizer).cpu()
          for _ in range(3)]

with torch_xla.experimental.eager_mode_context(False):
    assert not torch_xla.experimental.is_eager_mode()
torch.save({"res": res.cpu(), "losses": losses, "state": state, "executions": executions,
            "params": {k: v.cpu() for k, v in model.state_dict().items()},
            "eager_ops": met.metric_data("EagerOpExecuteTime")[0]}, sys.argv[1])
"""


def test_the_guide_runs_under_torch_xla_names(tmp_path):
    (tmp_path / "guide.py").write_text(GUIDE)
    p = warm.run([sys.executable, "-m", "xlatorch.compat", "guide.py", "guide.out"], cwd=tmp_path,
                 capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    out = torch.load(tmp_path / "guide.out", weights_only=False)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    net.load_state_dict(out["state"])
    data = torch.randn(6, 8)
    target = torch.randint(0, 4, (6,))
    torch.testing.assert_close(out["res"], net(data), rtol=1e-4, atol=1e-5)
    assert out["executions"] == 1  # the compiled model: one graph
    assert out["eager_ops"] > 0  # the transfers' and the loss's reads ran eagerly around it
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for got in out["losses"]:
        opt.zero_grad()
        loss = F.cross_entropy(net(data), target)
        loss.backward()
        opt.step()
        # Plain SGD passes the gradients' rounding on unamplified (tests/tolerances.py).
        torch.testing.assert_close(got, loss.detach(), rtol=1e-4, atol=1e-5)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(out["params"][k], v, rtol=1e-4, atol=1e-5)
