"""JAX inside PyTorch programs on the device: ``call_jax`` (one node of the lazy graph),
``j2t_autograd`` (a JAX function in a trained model), device data shared with JAX and DLPack,
and ``PureModule``. Values against the same computation in PyTorch on CPU.

Tolerance: each compared value is a few float32 ops over sums of at most a few dozen terms
(``NOISE`` of the largest value, tests/tolerances.py).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import pytest
import torch
from tolerances import NOISE

import xlatorch
import xlatorch.core.xla_builder as xb
import xlatorch.debug.metrics as met
from xlatorch.experimental.assume_pure import PureModule
from xlatorch.runtime.trace.bodies import BodyError
from xlatorch.utils import dlpack

DEV = xlatorch.device()


def _close(got, want):
    got, want = got.detach().cpu(), want.detach()
    tol = NOISE * max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= tol


def _count(metric: str) -> int:
    data = met.metric_data(metric)
    return data[0] if data else 0


def _jax_fn(x, w, *, scale):
    return {"y": jnp.tanh(x @ w) * scale, "positive": jnp.sum(x > 0)}


def test_call_jax_is_one_node_of_the_step_and_equals_torch():
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    xd, wd = x.to(DEV), w.to(DEV)
    xlatorch.sync()
    before = _count("ExecuteTime")
    out = xb.call_jax(_jax_fn, (xd * 2, wd), {"scale": 3.0})
    z = out["y"] + 1  # torch ops after it join the same graph
    assert _count("ExecuteTime") == before  # nothing ran at the call
    xlatorch.sync()
    assert _count("ExecuteTime") == before + 1  # one execution for the whole step
    _close(z, torch.tanh((x * 2) @ w) * 3.0 + 1)
    assert int(out["positive"]) == int(((x * 2) > 0).sum())


def test_call_jax_is_cached_by_function_shapes_and_static_arguments():
    x = torch.randn(5, device=DEV)
    xlatorch.sync()
    xb.call_jax(jnp.sin, (x,))
    xlatorch.sync()
    compiles = _count("CompileTime")
    xb.call_jax(jnp.sin, (x,))
    xlatorch.sync()
    assert _count("CompileTime") == compiles  # the same call: the same executable
    y = xb.call_jax(lambda a, k: a * k, (x, 2.0), override_hash="times")
    z = xb.call_jax(lambda a, k: a * k, (x, 3.0), override_hash="times")  # another static value
    _close(y, x.cpu() * 2)
    _close(z, x.cpu() * 3)


def test_call_jax_rejects_a_cpu_tensor():
    with pytest.raises(BodyError, match="call_jax.*argument 1 is a tensor on cpu"):
        xb.call_jax(jnp.add, (torch.ones(2, device=DEV), torch.ones(2)))


class _JaxLayer(torch.nn.Module):
    """A layer whose math is JAX, in the middle of a PyTorch model."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
        self.f = xb.j2t_autograd(lambda x, w: jax.nn.gelu(x @ w, approximate=False) + x)

    def forward(self, x):
        return self.f(x, self.w)


class _TorchLayer(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.detach().clone())

    def forward(self, x):
        return torch.nn.functional.gelu(x @ self.w) + x


def test_a_jax_layer_in_a_trained_model_equals_torch():
    torch.manual_seed(0)
    jl = _JaxLayer()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), jl, torch.nn.Linear(8, 2))
    cpu = torch.nn.Sequential(copy.deepcopy(model[0]), _TorchLayer(jl.w), copy.deepcopy(model[2]))
    model.to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1)
    x, t = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x.to(DEV)), t.to(DEV))
        loss.backward()
        opt.step()
        opt.zero_grad()
        xlatorch.sync()
        loss_cpu = torch.nn.functional.mse_loss(cpu(x), t)
        loss_cpu.backward()
        opt_cpu.step()
        opt_cpu.zero_grad()
        assert abs(loss.item() - loss_cpu.item()) <= NOISE * 3 * loss_cpu.item()
    for p, q in zip(model.parameters(), cpu.parameters()):
        _close(p, q)


def test_device_data_is_shared_with_jax_and_dlpack_without_a_copy():
    t = torch.arange(6.0, device=DEV) * 2
    a = dlpack.to_jax(t)
    assert isinstance(a, jax.Array) and a.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    c = torch.from_dlpack(dlpack.to_dlpack(t))
    assert c.data_ptr() == a.unsafe_buffer_pointer()  # the same buffer
    t.add_(1)  # a later step writes a new buffer: what was handed out keeps its values
    xlatorch.sync()
    assert c.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0] and t.cpu().tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    b = dlpack.from_jax(jnp.arange(3, dtype=jnp.int32))
    assert b.device.type == "xla" and b.dtype == torch.int32 and (b + 1).cpu().tolist() == [1, 2, 3]
    back = dlpack.from_dlpack(torch.arange(4.0))
    assert back.device.type == "xla" and back.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_pure_module_equals_its_module():
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    cpu = copy.deepcopy(m)
    m.to(DEV)
    pm = PureModule(m)
    x = torch.randn(3, 4)
    y = pm(x.to(DEV))
    y.sum().backward()
    yc = cpu(x)
    yc.sum().backward()
    _close(y, yc)
    for p, q in zip(m.parameters(), cpu.parameters()):
        _close(p.grad, q.grad)


def _sdpa_reference(q, k, v, causal, seg_q, seg_kv, scale, ab):
    mask = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2])
    if ab is not None:
        mask = mask + ab
    if seg_q is not None:
        mask = mask.masked_fill(seg_q[:, None, :, None] != seg_kv[:, None, None, :], float("-inf"))
    if causal:
        mask = mask.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("causal,segments,bias", [(False, False, False), (True, False, False), (True, True, True)])
def test_flash_attention_equals_scaled_dot_product_attention(causal, segments, bias):
    from xlatorch.experimental.custom_kernel import flash_attention

    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1, 1, 1]]) if segments else None
    ab = torch.randn(2, 3, 8, 8) if bias else None
    want_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _sdpa_reference(*want_in, causal, seg, seg, 0.5, ab)
    want.pow(2).sum().backward()
    got_in = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = flash_attention(*got_in, causal=causal, q_segment_ids=dev(seg), kv_segment_ids=dev(seg), sm_scale=0.5,
                          ab=dev(ab))  # fmt: skip
    got.pow(2).sum().backward()
    _close(got, want)
    for g, w in zip(got_in, want_in):
        _close(g.grad, w.grad)


def test_grouped_matmul_equals_a_loop_over_groups():
    from xlatorch.experimental.custom_kernel import gmm

    torch.manual_seed(3)
    lhs, rhs = torch.randn(7, 4), torch.randn(3, 4, 5)
    sizes = torch.tensor([2, 0, 5], dtype=torch.int32)
    want_l, want_r = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    want = torch.cat([want_l[:2] @ want_r[0], want_l[2:7] @ want_r[2]])
    want.pow(2).sum().backward()
    got_l, got_r = lhs.to(DEV).requires_grad_(), rhs.to(DEV).requires_grad_()
    got = gmm(got_l, got_r, sizes.to(DEV))
    got.pow(2).sum().backward()
    _close(got, want)
    _close(got_l.grad, want_l.grad)
    _close(got_r.grad, want_r.grad)


def test_a_pallas_kernel_runs_on_xla_tensors():
    from jax.experimental import pallas as pl

    from xlatorch.experimental.custom_kernel import make_kernel_from_pallas

    def add_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    def add(x, y):
        return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)

    run = make_kernel_from_pallas(add, lambda x, y: [(x.shape, x.dtype)])
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    _close(run(x.to(DEV), y.to(DEV)), x + y)


def test_a_jax_setting_that_changes_the_trace_makes_another_call():
    x = torch.randn(4, 4, device=DEV)
    before = xb._jax_to_xla_computation_cache_elements()
    xb.call_jax(jnp.matmul, (x, x))
    xb.call_jax(jnp.matmul, (x, x))
    assert xb._jax_to_xla_computation_cache_elements() == before + 1
    with jax.default_matmul_precision("highest"):
        y = xb.call_jax(jnp.matmul, (x, x))
    assert xb._jax_to_xla_computation_cache_elements() == before + 2
    _close(y, x.cpu() @ x.cpu())
