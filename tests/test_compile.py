"""torch.compile(backend="openxla" | "xlatorch") on the xla device (issue 15 §2)."""

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _pair(make, seed=0):
    torch.manual_seed(seed)
    cpu = make()
    dev = make()
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to("xla")


def _compiled_nodes() -> int:
    return sum(v for k, v in met.COUNTERS.items() if k.startswith("xlatorch::compiled_"))


@pytest.mark.parametrize("backend", ["openxla", "xlatorch"])
def test_training_equals_eager_with_whole_graphs_and_flat_compiles(backend):
    cpu, dev = _pair(_mlp)
    step = torch.compile(dev, backend=backend)
    opt_c = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    compiles = []
    met.clear_counters()
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss_c = nn.functional.cross_entropy(cpu(x), y)
        loss_c.backward()
        opt_c.step()
        opt_c.zero_grad()
        loss_d = nn.functional.cross_entropy(step(x.to("xla")), y.to("xla"))
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        xm.mark_step()
        torch.testing.assert_close(loss_d.item(), loss_c.item(), rtol=1e-5, atol=1e-6)
        compiles.append(met.counter_value("UncachedCompile"))
    for (k, v), w in zip(dev.state_dict().items(), cpu.state_dict().values()):
        torch.testing.assert_close(v.cpu(), w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch._dynamo.utils.counters["graph_break"]  # one whole graph, no breaks
    assert met.counter_value("DynamoCompile") == 2  # its forward and its backward, once
    assert met.counter_value("CompiledGraphOpByOp") is None
    assert _compiled_nodes() == 10  # one node per forward and per backward, per step
    assert compiles[-1] == compiles[1], compiles  # nothing compiles after the first steps


def test_compiled_autograd_captures_the_backward_of_xla_tensors():
    """With ``compiled_autograd`` on, Dynamo's compiled autograd makes fake tensors of the
    backward's inputs itself (outside Dynamo's tracing context): xla tensors, whose storage is
    otherwise an error, give it the wrapper's. It used to fail ("Found tensor of type XlaTensor,
    which is not supported by FakeTensorMode"). Dynamo's breaks of the whole step are PyTorch's
    only: it used to trace into xlatorch's shims from ``backward()`` (seven breaks, now four)."""
    cpu, dev = _pair(_mlp)
    opt_c = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(dev.parameters(), lr=1e-2)

    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    g = torch.Generator().manual_seed(1)
    with torch._dynamo.config.patch(compiled_autograd=True):  # read when torch.compile wraps the function
        step = torch.compile(train_step, backend="openxla")
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss_c = train_step(cpu, opt_c, x, y)
            loss_d = step(dev, opt_d, x.to("xla"), y.to("xla"))
            xm.mark_step()
            torch.testing.assert_close(loss_d.item(), loss_c.item(), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1
    # Dynamo breaks the step where PyTorch makes it (zero_grad, the optimizer), never in
    # xlatorch's own code: its generated shims and the fused ones made at run time included.
    import os
    import sys

    import xlatorch

    ours = [os.path.dirname(xlatorch.__file__), *sys.modules["xlatorch._generated"].__path__, "<string>"]
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and not [k for k in breaks if any(d in k for d in ours)], list(breaks)
    for (k, v), w in zip(dev.state_dict().items(), cpu.state_dict().values()):
        torch.testing.assert_close(v.cpu(), w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    with pytest.raises(RuntimeError, match="no storage"):  # outside a fake conversion, as before
        dev[0].weight.untyped_storage()


def test_inference_recompiles_for_a_new_shape_and_uses_the_emitters():
    cpu, dev = _pair(_mlp)
    dev.eval()
    cpu.eval()
    fn = torch.compile(dev, backend="openxla")
    met.clear_counters()
    with torch.no_grad():
        for n in (3, 3, 5, 5):
            x = torch.randn(n, 6)
            torch.testing.assert_close(fn(x.to("xla")).cpu(), cpu(x), rtol=1e-5, atol=1e-6)
    assert met.counter_value("DynamoCompile") == 2  # one graph per batch size Dynamo saw
    assert met.counter_value("xla::addmm") is None  # no per-op dispatch: one node per call
    assert _compiled_nodes() == 4


def test_a_graph_with_an_op_without_lowering_runs_op_by_op():
    def f(x):
        return torch.special.airy_ai(x) * 2 + 1

    x = torch.rand(5) * 3
    met.clear_counters()
    got = torch.compile(f, backend="openxla")(x.to("xla"))
    torch.testing.assert_close(got.cpu(), f(x), rtol=1e-5, atol=1e-6)
    assert met.counter_value("CompiledGraphOpByOp") == 1
    assert met.counter_value("aten::special_airy_ai") == 1  # the CPU fallback, counted as always


def test_ops_without_lowering_but_with_a_decomposition_are_composed():
    def f(x):
        return (x[:, 1] * 3).square().sum()  # its backward holds aten::select_backward: no lowering, a decomposition

    x = torch.randn(4, 3)
    xd = x.to("xla").requires_grad_()
    met.clear_counters()
    torch.compile(f, backend="openxla")(xd).backward()
    xc = x.clone().requires_grad_()
    f(xc).backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-6)
    assert met.counter_value("CompiledGraphOpByOp") is None and met.executed_fallback_ops() == []


def test_dropout_draws_new_masks_without_recompiling():
    torch.manual_seed(0)
    layer = nn.Dropout(0.5).to("xla").train()
    fn = torch.compile(layer, backend="openxla")
    x = torch.ones(64, device="xla")
    a, b = fn(x).cpu(), fn(x).cpu()
    assert set(a.unique().tolist()) <= {0.0, 2.0} and not torch.equal(a, b)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_index_checks_still_raise_inside_a_compiled_graph():
    emb = nn.Embedding(10, 3).to("xla")
    fn = torch.compile(emb, backend="openxla")
    bad = torch.tensor([1, 12]).to("xla")
    with pytest.raises(IndexError, match="out of range"):
        fn(bad).cpu()


def test_the_gpt_program_compiled_equals_the_lazy_path():
    from examples.models import programs

    p = programs(small=True)["gpt"]

    def run(compiled):
        torch.manual_seed(0)
        model = p.make_model().to("xla")
        opt = p.make_opt(model.parameters())
        fwd = torch.compile(model, backend="openxla") if compiled else model
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = (t.to("xla") for t in p.make_batch(gen))
            opt.zero_grad()
            loss = p.loss_fn(fwd(x), y)
            loss.backward()
            opt.step()
            xm.mark_step()
            losses.append(loss.item())
        return losses

    lazy = run(False)
    met.clear_counters()
    assert run(True) == lazy  # the same emitters, the same program: bit for bit
    assert met.counter_value("CompiledGraphOpByOp") is None and _compiled_nodes() == 6
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_python_float_argument_is_an_input_of_one_program():
    # A learning-rate schedule: a new Python float every call. dynamic=False (these backends'
    # default) made Dynamo bake each value into a new graph: 5 values, 5 XLA programs.
    def f(x, lr):
        return x * lr + lr

    fn = torch.compile(f, backend="openxla")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    met.clear_counters()
    for lr in (0.1, 0.05, 0.025, 0.0125, 3.0):
        got = fn(x.to("xla"), lr)
        xm.mark_step()
        torch.testing.assert_close(got.cpu(), f(x, lr), rtol=1e-6, atol=0)
    assert met.counter_value("DynamoCompile") == 1 and met.counter_value("UncachedCompile") == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert met.counter_value("CompiledGraphOpByOp") is None and met.executed_fallback_ops() == []


def test_training_with_a_changing_float_argument_compiles_once():
    cpu, dev = _pair(_mlp)

    def loss_fn(model, x, y, temperature):
        return nn.functional.cross_entropy(model(x) / temperature, y)

    step = torch.compile(loss_fn, backend="openxla")
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    compiles = []
    met.clear_counters()
    for i in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        temperature = 1.0 + 0.25 * i  # a new float, in the forward and the backward graph
        loss_c = loss_fn(cpu, x, y, temperature)
        loss_c.backward()
        opt_c.step()
        opt_c.zero_grad()
        loss_d = step(dev, x.to("xla"), y.to("xla"), temperature)
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        xm.mark_step()
        torch.testing.assert_close(loss_d.item(), loss_c.item(), rtol=1e-5, atol=1e-6)
        compiles.append(met.counter_value("UncachedCompile"))
    for (k, v), w in zip(dev.state_dict().items(), cpu.state_dict().values()):
        torch.testing.assert_close(v.cpu(), w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert met.counter_value("DynamoCompile") == 2  # its forward and its backward, once
    assert _compiled_nodes() == 10 and met.counter_value("CompiledGraphOpByOp") is None
    assert compiles[-1] == compiles[1], compiles  # nothing compiles after the first steps


def test_a_0d_cpu_tensor_argument_enters_as_a_scalar_and_cpu_results_stay_on_the_cpu():
    def f(x, s):
        return x * s, s + 1  # s + 1 is computed from a CPU input alone: a CPU tensor, as in eager

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    fn = torch.compile(f, backend="openxla")
    met.clear_counters()
    for s in (0.5, 0.25):
        got = fn(x.to("xla"), torch.tensor(s))
        want = f(x, torch.tensor(s))
        assert got[0].device.type == "xla" and got[1].device.type == "cpu"
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-6, atol=0)
        assert torch.equal(got[1], want[1])
    assert met.counter_value("CompiledGraphOpByOp") is None and met.counter_value("UncachedCompile") == 1
