"""``xlatorch.experimental.gru.GRU`` (torch_xla's scan-based GRU) against ``nn.GRU`` on CPU:
outputs, final states and every gradient, over layouts, depths, bias and unbatched input; the
program holds one loop per layer whatever the sequence length.

Tolerance: the device and CPU round the gate matmuls' sums in different orders; each value is a
chain of at most a few dozen float32 steps of sums with under a hundred terms, so they agree to
a few ulps of the largest magnitude involved (``NOISE``, tests/tolerances.py) compounded over
the time steps: 10x NOISE.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tolerances import NOISE

import xlatorch
import xlatorch.debug.metrics as met
from xlatorch.debug.dump import hlo_text
from xlatorch.experimental.gru import GRU

DEV = xlatorch.device()
TOL = 10 * NOISE


def _close(got, want):
    diff = float((got.detach().cpu() - want.detach()).abs().max())
    assert diff <= TOL * max(1.0, float(want.detach().abs().max())), f"differs by {diff}"


def _pair(input_size, hidden, layers, bias, batch_first):
    torch.manual_seed(0)
    ref = nn.GRU(input_size, hidden, num_layers=layers, bias=bias, batch_first=batch_first)
    gru = GRU(input_size, hidden, num_layers=layers, bias=bias, batch_first=batch_first)
    gru.load_state_dict(ref.state_dict(), strict=True)
    return ref, gru.to(DEV)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [False, True])
def test_gru_outputs_and_gradients_equal_nn_gru(layers, bias, batch_first):
    ref, gru = _pair(5, 7, layers, bias, batch_first)
    x = torch.randn((3, 6, 5) if batch_first else (6, 3, 5))
    h0 = torch.randn(layers, 3, 7)
    xc, hc = x.clone().requires_grad_(), h0.clone().requires_grad_()
    xd, hd = x.to(DEV).requires_grad_(), h0.to(DEV).requires_grad_()
    out_c, hn_c = ref(xc, hc)
    out_d, hn_d = gru(xd, hd)
    assert out_d.shape == out_c.shape and hn_d.shape == hn_c.shape
    _close(out_d, out_c)
    _close(hn_d, hn_c)
    ((out_c**2).sum() + hn_c.sum()).backward()
    ((out_d**2).sum() + hn_d.sum()).backward()
    _close(xd.grad, xc.grad)
    _close(hd.grad, hc.grad)
    for (name, p), q in zip(ref.named_parameters(), gru.parameters()):
        assert q.grad is not None, name
        _close(q.grad, p.grad)


def test_gru_unbatched_and_default_state():
    ref, gru = _pair(4, 6, 2, True, False)
    x = torch.randn(5, 4)
    out_c, hn_c = ref(x)
    out_d, hn_d = gru(x.to(DEV))
    assert out_d.shape == (5, 6) and hn_d.shape == (2, 6)
    _close(out_d, out_c)
    _close(hn_d, hn_c)
    with pytest.raises(RuntimeError, match="2-D"):
        gru(x.to(DEV), torch.zeros(2, 1, 6, device=DEV))


def test_gru_program_holds_one_loop_per_layer_whatever_the_length():
    _, gru = _pair(4, 8, 2, True, False)
    sizes = []
    for length in (4, 64):
        out, hn = gru(torch.randn(length, 2, 4, device=DEV))
        text = hlo_text([out, hn])
        assert text.count("while(") + text.count("while ") >= 2
        sizes.append(len(text))
    assert abs(sizes[0] - sizes[1]) < 200  # the body is not unrolled


def test_gru_is_an_nn_gru_and_bidirectional_builds_upstream(caplog):
    gru = GRU(3, 4, num_layers=1)
    assert isinstance(gru, nn.GRU) and type(gru) is GRU
    bi = GRU(3, 4, bidirectional=True)
    assert type(bi) is nn.GRU and bi.bidirectional
    assert "unidirectional" in caplog.text


def test_gru_cpu_input_runs_nn_gru():
    ref, _ = _pair(3, 4, 1, True, False)
    gru = GRU(3, 4)
    gru.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(gru(x)[0], ref(x)[0])


def test_gru_second_step_does_not_compile():
    _, gru = _pair(4, 8, 1, True, False)
    for _ in range(3):  # the second step accumulates into .grad: a new graph; the third repeats it
        met.clear_all()
        out, _ = gru(torch.randn(6, 2, 4, device=DEV))
        out.sum().backward()
        xlatorch.sync()
    assert met.metric_data("CompileTime") is None


def test_gru_orig_is_torch_gru():
    assert GRU._orig is torch.nn.modules.rnn.GRU
