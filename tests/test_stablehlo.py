"""StableHLO export (issue 15 §3): torch.export programs lowered by the ops.yaml emitters,
saved in torch_xla's layout and run from the saved bytecode."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests import warm
from xlatorch.stablehlo import (
    InputLocation,
    StableHLOExportOptions,
    StableHLOFunc,
    StableHLOFunctionMeta,
    StableHLOGraphModule,
    StableHLOJSONSerializer,
    StableHLOModelBundle,
    VariableSignature,
    VariableType,
    XLAExportInterpreter,
    exported_program_to_stablehlo,
    save_as_stablehlo,
    save_torch_model_as_stablehlo,
    stablehlo_obj_hook,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 11)

    def forward(self, tokens, scale: float = 1.0):
        h = self.emb(tokens)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.out(self.norm(h + a)).softmax(-1) * scale


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 5))  # fmt: skip


class _DictInTupleOut(nn.Module):
    """Pytree inputs and outputs, a buffer, a lifted tensor constant and a Python number."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.arange(4.0))

    def forward(self, inputs):
        y = self.lin(inputs["x"]) * 2.5 + self.shift
        return y / torch.tensor(3.0), {"prod": inputs["x"] * inputs["y"]}


CASES = [
    (_cnn, lambda g: (torch.randn(2, 3, 8, 8, generator=g),)),
    (_Attention, lambda g: (torch.randint(0, 11, (2, 5), generator=g),)),
    (_DictInTupleOut, lambda g: ({"x": torch.randn(3, 4, generator=g), "y": torch.randn(3, 4, generator=g)},)),
]


def _parses(text: str) -> None:
    with mlir.make_ir_context():
        ir.Module.parse(text)


def _cpu(tree):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), tree)


@pytest.mark.parametrize("make, args", CASES)
def test_export_runs_its_stablehlo_against_eager(make, args):
    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(1)
    example = args(g)
    xm.mark_step()
    met.clear_counters()
    shlo = exported_program_to_stablehlo(torch.export.export(model, example))
    # Exporting lowers but neither compiles nor runs.
    assert met.counter_value("UncachedCompile") is None and met.counter_value("CachedCompile") is None
    text = shlo.get_stablehlo_text()
    assert "func.func public @main" in text and "stablehlo." in text
    _parses(text)
    assert shlo.get_stablehlo_bytecode().startswith(b"ML\xefR")  # MLIR bytecode magic
    meta = shlo.meta
    kinds = [loc.type_ for loc in meta.input_locations]
    assert len(kinds) == len(meta.input_signature) and VariableType.INPUT_ARG in kinds
    # Every weight the program reads is an argument, named by its state dict key.
    names = {loc.name for loc in meta.input_locations if loc.type_ is VariableType.PARAMETER}
    assert names <= set(shlo._bundle.state_dict) and names
    with torch.no_grad():
        want = model(*example)
        fresh = args(g)  # other values, same shapes: the same program
        got = shlo(*example)
        got2 = shlo(*fresh)
        want2 = model(*fresh)
    assert torch.utils._pytree.tree_leaves(got)[0].device.type == "xla"
    torch.testing.assert_close(_cpu(got), want)
    torch.testing.assert_close(_cpu(got2), want2)
    # One program, compiled once, for both calls.
    assert met.counter_value("UncachedCompile") == 1


_CHILD = textwrap.dedent("""
    import sys, torch, numpy as np
    import xlatorch  # registers the device: nothing else of the parent process is here
    from xlatorch.stablehlo import StableHLOGraphModule
    from torch.utils import _pytree as pytree
    path, inputs, outputs = sys.argv[1:]
    spec, leaves = torch.load(inputs)
    module = StableHLOGraphModule.load(path)
    out = module(*pytree.tree_unflatten(leaves, pytree.treespec_loads(spec)))
    torch.save(pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), out), outputs)
""")


def test_saved_programs_load_and_run_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    expected = {}
    for i, (make, args) in enumerate(CASES):
        model, example = make().eval(), args(g)
        save_as_stablehlo(torch.export.export(model, example), tmp_path / f"m{i}")
        fresh = args(g)
        with torch.no_grad():
            expected[i] = model(*fresh)
        leaves, spec = torch.utils._pytree.tree_flatten(fresh)
        torch.save((torch.utils._pytree.treespec_dumps(spec), leaves), tmp_path / f"in{i}.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    for i in expected:
        warm.run([sys.executable, "-c", _CHILD, str(tmp_path / f"m{i}"), str(tmp_path / f"in{i}.pt"),
                        str(tmp_path / f"out{i}.pt")], check=True, env=env, timeout=300)  # fmt: skip
        torch.testing.assert_close(torch.load(tmp_path / f"out{i}.pt"), expected[i])


def test_saved_files_follow_torch_xla_layout(tmp_path):
    model = _cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    exported = torch.export.export(model, (x,))
    shlo = exported_program_to_stablehlo(exported)
    shlo.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["constants", "data", "functions", "version"]
    assert sorted(os.listdir(tmp_path / "functions")) == ["forward.bytecode", "forward.meta", "forward.mlir"]
    assert set(os.listdir(tmp_path / "data")) == set(model.state_dict())
    np.testing.assert_array_equal(np.load(tmp_path / "data" / "0.weight"), model[0].weight.detach().numpy())
    assert (tmp_path / "functions" / "forward.bytecode").read_bytes() == shlo.get_stablehlo_bytecode()
    assert (tmp_path / "functions" / "forward.mlir").read_text() == shlo.get_stablehlo_text()
    version = json.loads((tmp_path / "version").read_text())
    assert version["format_version"] == 1 and version["stablehlo_version"] == shlo.meta.stablehlo_version
    meta = json.loads((tmp_path / "functions" / "forward.meta").read_text(), object_hook=stablehlo_obj_hook)
    assert meta == shlo.meta  # JSON and the hook round-trip the dataclasses (VariableType included)
    assert isinstance(meta.input_locations[0], InputLocation) and isinstance(meta.input_signature[0], VariableSignature)
    raw = json.loads((tmp_path / "functions" / "forward.meta").read_text())
    assert raw["input_locations"][0] == {"type_": "input_arg", "position": 0, "name": ""}
    assert json.loads(json.dumps(VariableType.PARAMETER, cls=StableHLOJSONSerializer)) == "parameter"
    assert stablehlo_obj_hook({"other": 1}) == {"other": 1}
    loaded = StableHLOGraphModule.load(tmp_path)
    assert loaded.get_stablehlo_text() == shlo.get_stablehlo_text()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).cpu(), model(x))


def test_top_level_names_and_save_without_weights(tmp_path):
    model = nn.Linear(4, 3).eval()
    x = torch.randn(2, 4)
    xlatorch.save_torch_model_as_stablehlo(model, (x,), tmp_path / "a")
    xlatorch.save_as_stablehlo(torch.export.export(model, (x,)), tmp_path / "b")
    opts = StableHLOExportOptions(save_weights=False)
    save_torch_model_as_stablehlo(model, (x,), tmp_path / "c", opts)
    with torch.no_grad():
        want = model(x)
        for d in "ab":
            torch.testing.assert_close(StableHLOGraphModule.load(tmp_path / d)(x).cpu(), want)
        assert not (tmp_path / "c" / "data").exists()
        bare = StableHLOGraphModule.load(tmp_path / "c")
        assert bare._bundle.state_dict == {}
        with pytest.raises(KeyError, match="no weight 'weight'"):
            bare(x)
        bare._bundle.state_dict.update({k: v.numpy() for k, v in model.state_dict().items()})
        torch.testing.assert_close(bare(x).cpu(), want)
    no_weights = exported_program_to_stablehlo(torch.export.export(model, (x,)),
                                               StableHLOExportOptions(export_weights=False))  # fmt: skip
    assert no_weights._bundle.state_dict == {}


def test_numbers_as_arguments_and_constants(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            return torch.ops.aten.sub(torch.ops.aten.sub(x, 5.5), 1.0) * 0.0 + x * 3.25

    x = torch.randn(10, 10)
    ep = torch.export.export(M(), (x,))
    inline = exported_program_to_stablehlo(ep)
    assert "dense<5.500000e+00>" in inline.get_stablehlo_text() and not inline._bundle.additional_constants
    opts = StableHLOExportOptions(inline_all_constant=False)
    save_as_stablehlo(ep, tmp_path, opts)
    loaded = StableHLOGraphModule.load(tmp_path)
    consts = loaded._bundle.additional_constants
    assert sorted(float(c) for c in consts) == [3.25, 5.5]  # 0 and 1 stay in the program
    assert sorted(os.listdir(tmp_path / "constants")) == ["0", "1"]
    assert [loc.type_ for loc in loaded.meta.input_locations].count(VariableType.CONSTANT) == 2
    torch.testing.assert_close(loaded(x).cpu(), M()(x))


def test_bfloat16_weights_round_trip(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)).to(torch.bfloat16).eval()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    save_torch_model_as_stablehlo(model, (x,), tmp_path)
    loaded = StableHLOGraphModule.load(tmp_path)
    assert loaded._bundle.state_dict["0.weight"].dtype.name == "bfloat16"
    with torch.no_grad():
        got = loaded(x).cpu()
        want = model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bfloat16's own tolerance


def test_plain_mlir_bytecode_bundles_load_and_run(tmp_path):
    # A bundle whose bytecode is plain MLIR (as xm.get_stablehlo_bytecode gives), not a
    # portable artifact: converted on load.
    a = torch.randn(3, 4, device="xla")
    b = torch.randn(4, 2, device="xla")
    xm.mark_step()
    code = xm.get_stablehlo_bytecode([torch.tanh(a @ b)])
    assert code.startswith(b"ML\xefR") and b"StableHLO_v" not in code[:32]
    sig = lambda *s: VariableSignature(shape=list(s), dtype="float32")  # noqa: E731
    meta = StableHLOFunctionMeta("forward", "0.0.0", [sig(3, 4), sig(4, 2)], [sig(3, 2)],
                                 [InputLocation.input_arg(0), InputLocation.parameter("w")], [])  # fmt: skip
    w = torch.randn(4, 2)
    bundle = StableHLOModelBundle({"w": w.numpy()}, [], [StableHLOFunc(meta, code, None)])
    StableHLOGraphModule(bundle).save(tmp_path)
    assert not (tmp_path / "functions" / "forward.mlir").exists()
    x = torch.randn(3, 4)
    out = StableHLOGraphModule.load(tmp_path)(x)
    torch.testing.assert_close(out[0].cpu(), torch.tanh(x @ w))


def test_bad_directories_name_the_file(tmp_path):
    model = nn.Linear(4, 3).eval()
    x = torch.randn(2, 4)
    good = tmp_path / "good"
    save_torch_model_as_stablehlo(model, (x,), good)
    with pytest.raises(FileNotFoundError, match="missing"):
        StableHLOGraphModule.load(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="functions"):
        StableHLOGraphModule.load(good / "data")

    def broken(name):
        d = tmp_path / name
        subprocess.run(["cp", "-r", str(good), str(d)], check=True)
        return d

    d = broken("meta")
    (d / "functions" / "forward.meta").write_text('{"name": "forward", "input_sig')
    with pytest.raises(ValueError, match="forward.meta"):
        StableHLOGraphModule.load(d)
    d = broken("meta_fields")
    (d / "functions" / "forward.meta").write_text('{"name": "forward"}')
    with pytest.raises(ValueError, match="forward.meta"):
        StableHLOGraphModule.load(d)
    d = broken("weight")
    os.unlink(d / "data" / "bias")
    with pytest.raises(FileNotFoundError, match=os.path.join("data", "bias")):
        StableHLOGraphModule.load(d)
    d = broken("weight_bytes")
    (d / "data" / "weight").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match=os.path.join("data", "weight")):
        StableHLOGraphModule.load(d)
    d = broken("weight_shape")
    np.save(open(d / "data" / "weight", "wb"), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"data/weight holds an array of shape \[2, 2\]"):
        StableHLOGraphModule.load(d)
    d = broken("bytecode")
    (d / "functions" / "forward.bytecode").write_bytes(b"ML\xefR garbage")
    with pytest.raises(ValueError, match="forward.bytecode"):
        StableHLOGraphModule.load(d)
    d = broken("no_bytecode")
    os.unlink(d / "functions" / "forward.bytecode")
    with pytest.raises(FileNotFoundError, match="forward.bytecode"):
        StableHLOGraphModule.load(d)
    d = broken("version")
    (d / "version").write_text('{"format_version": 99}')
    with pytest.raises(ValueError, match="version"):
        StableHLOGraphModule.load(d)
    d = broken("torch_xla_like")  # torch_xla writes no version file
    os.unlink(d / "version")
    torch.testing.assert_close(StableHLOGraphModule.load(d)(x).cpu(), model(x).detach())
    loaded = StableHLOGraphModule.load(good)
    with pytest.raises(ValueError, match=r"exported for float32\[2, 4\]"):
        loaded(torch.randn(3, 4))
    with pytest.raises(ValueError, match="no method 'backward'"):
        loaded.get_stablehlo_text("backward")


def test_export_text_carries_op_names_with_debug_info():
    model = nn.Linear(4, 3).eval()
    ep = torch.export.export(model, (torch.randn(2, 4),))
    for opts in (StableHLOExportOptions(include_debug_info=True), StableHLOExportOptions(export_node_metadata=True)):
        text = exported_program_to_stablehlo(ep, opts).get_stablehlo_text()
        assert "aten::addmm" in text or "aten::linear" in text
    assert exported_program_to_stablehlo(ep, StableHLOExportOptions(include_human_readable_text=False)) \
        .get_stablehlo_text() is None  # fmt: skip


def test_export_with_overridden_arguments_and_bad_input():
    model = nn.Linear(4, 3).eval()
    ep = torch.export.export(model, (torch.randn(2, 4),))
    for opts in (StableHLOExportOptions(override_tracing_arguments=((torch.randn(2, 4),), {})),
                 StableHLOExportOptions(override_tracing_arguments=(torch.randn(2, 4),))):  # fmt: skip
        assert "tensor<2x4xf32>" in exported_program_to_stablehlo(ep, opts).get_stablehlo_text()
    with pytest.raises(TypeError, match="ExportedProgram"):
        exported_program_to_stablehlo(model)


def test_ops_with_no_lowering_are_refused():
    class M(nn.Module):
        def forward(self, x):
            return torch.special.airy_ai(x) + 1

    ep = torch.export.export(M(), (torch.randn(3),))
    with pytest.raises(RuntimeError, match="aten::special_airy_ai"):
        exported_program_to_stablehlo(ep)


def test_interpreter_wraps_floats_and_moves_factories():
    class M(nn.Module):
        def forward(self, x):
            return 1.0 - x + torch.ones(2, 3, device="cpu")

    ep = torch.export.export(M(), (torch.rand(2, 3),)).run_decompositions()
    x = torch.rand(2, 3)
    out = XLAExportInterpreter(ep.graph_module, torch.device("xla")).run(x.to("xla"))[0]
    assert out.device.type == "xla" and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), 2.0 - x)
    with pytest.raises(NotImplementedError, match="custom_call"):
        XLAExportInterpreter(ep.graph_module, torch.device("xla"), {"aten"}).run(x.to("xla"))


def test_keyword_inputs_and_assert_metadata_nodes(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).to(torch.bfloat16)

        def forward(self, x, *, bias, gain):
            # .float() / .to(dtype) leave aten._assert_tensor_metadata nodes in the exported graph.
            h = self.lin(x.to(torch.bfloat16)).float()
            return h * gain + bias

    model = M().eval()
    x, bias, gain = torch.randn(2, 4), torch.randn(4), torch.randn(2, 1)
    ep = torch.export.export(model, (x,), {"gain": gain, "bias": bias})
    assert any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in ep.graph.nodes)
    save_as_stablehlo(ep, tmp_path)
    loaded = StableHLOGraphModule.load(tmp_path)
    with torch.no_grad():
        x2, b2, g2 = torch.randn(2, 4), torch.randn(4), torch.randn(2, 1)
        got = loaded(x2, bias=b2, gain=g2).cpu()  # keywords in another order than exported
        torch.testing.assert_close(got, model(x2, bias=b2, gain=g2))
