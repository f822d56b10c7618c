"""StableHLO export (issue 15 §3): torch.export programs lowered by the ops.yaml emitters."""

import pytest
import torch
import torch.nn as nn
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch.stablehlo import StableHLOExportOptions, exported_program_to_stablehlo


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


def _parses(text: str) -> None:
    with mlir.make_ir_context():
        ir.Module.parse(text)


@pytest.mark.parametrize("make, args", [
    (_cnn, lambda g: (torch.randn(2, 3, 8, 8, generator=g),)),
    (_Attention, lambda g: (torch.randint(0, 11, (2, 5), generator=g),)),
])  # fmt: skip
def test_export_round_trips_against_eager(make, args):
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
    kinds = [s.kind for s in shlo.meta.input_signature]
    assert [tuple(s.shape) for s in shlo.meta.input_signature if s.kind == "input"] == [tuple(example[0].shape)]
    n_state = len(list(model.parameters())) + len([b for b in model.buffers() if b.is_floating_point()])
    assert kinds.count("parameter") + kinds.count("buffer") >= n_state - 1  # num_batches_tracked is unused
    with torch.no_grad():
        want = model(*example)
        fresh = args(g)  # other values, same shapes: the same program
        got = shlo(*example)
        got2 = shlo(*fresh)
        want2 = model(*fresh)
    assert got.device.type == "xla"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2.cpu(), want2, rtol=1e-5, atol=1e-5)


def test_export_text_carries_op_names_with_debug_info():
    model = nn.Linear(4, 3).eval()
    ep = torch.export.export(model, (torch.randn(2, 4),))
    text = exported_program_to_stablehlo(ep, StableHLOExportOptions(include_debug_info=True)).get_stablehlo_text()
    assert "aten::addmm" in text or "aten::linear" in text


def test_export_with_overridden_arguments_and_bad_input():
    model = nn.Linear(4, 3).eval()
    ep = torch.export.export(model, (torch.randn(2, 4),))
    opts = StableHLOExportOptions(override_tracing_arguments=((torch.randn(2, 4),), {}))
    shlo = exported_program_to_stablehlo(ep, opts)
    assert "tensor<2x4xf32>" in shlo.get_stablehlo_text()
    with pytest.raises(TypeError, match="ExportedProgram"):
        exported_program_to_stablehlo(model)
    with pytest.raises(ValueError, match="no method 'backward'"):
        shlo.get_stablehlo_text("backward")
