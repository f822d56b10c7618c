"""What a graph lowers to (``runtime/ir/emit.py``, ``lowering/pointwise.py``): no op traced only
for XLA to fold it away, and no value cast again for each op reading it. Lowering is the host's
part of a first step's compile (JAX traces every op), so each op it skips is time saved at every
first sync; the values stay CPU's."""

import logging

import jax
import pytest
import torch

import xlatorch.core.xla_model as xm
from xlatorch.runtime.base.dtypes import weak_number


def _count(text: str, op: str) -> int:
    return text.count(f"stablehlo.{op} ")


def test_a_default_alpha_lowers_to_no_multiply_and_gives_cpus_values():
    dev = xm.xla_device()
    x = torch.randn(5)
    y = torch.randn(5)
    t, u = x.to(dev), y.to(dev)
    chain = lambda a, b: ((a + b) - b + 2 - 1.5).add(b).sub(a)  # noqa: E731 (alpha at its default each time)
    out = chain(t, u)
    text = xm.get_stablehlo([out])
    assert _count(text, "multiply") == 0, text
    torch.testing.assert_close(out.cpu(), chain(x, y), rtol=0, atol=0)
    scaled = torch.add(t, u, alpha=2)  # a number the program passed: a parameter, multiplied
    assert _count(xm.get_stablehlo([scaled]), "multiply") == 1
    torch.testing.assert_close(scaled.cpu(), torch.add(x, y, alpha=2), rtol=0, atol=0)


def test_addmm_with_default_beta_and_alpha_lowers_to_a_product_and_a_sum():
    dev = xm.xla_device()
    c, a, b = torch.randn(3, 4), torch.randn(3, 2), torch.randn(2, 4)
    out = torch.addmm(c.to(dev), a.to(dev), b.to(dev))
    text = xm.get_stablehlo([out])
    assert (_count(text, "multiply"), _count(text, "select"), _count(text, "dot_general")) == (0, 0, 1), text
    torch.testing.assert_close(out.cpu(), torch.addmm(c, a, b))
    # beta=0 ignores self, NaN included; integer results truncate beta and alpha, as CPU
    nan = torch.full((3, 4), float("nan"))
    got = torch.addmm(nan.to(dev), a.to(dev), b.to(dev), beta=0).cpu()
    torch.testing.assert_close(got, torch.addmm(nan, a, b, beta=0))
    ci, ai, bi = (torch.randint(-5, 5, s) for s in ((3, 4), (3, 2), (2, 4)))
    got = torch.addmm(ci.to(dev), ai.to(dev), bi.to(dev), beta=2.7, alpha=1.9).cpu()
    assert torch.equal(got, torch.addmm(ci, ai, bi, beta=2.7, alpha=1.9))


@pytest.mark.parametrize("op", [torch.add, torch.sub])
def test_a_complex_add_with_an_infinite_part_is_as_on_cpu(op):
    """CPU multiplies by alpha even at 1: (inf + 0j) * (1 + 0j) has a NaN part (XLA would fold
    a multiply by a constant 1 away)."""
    a = torch.tensor([complex(1, 0), complex(2, -1)])
    b = torch.tensor([complex(float("inf"), 0), complex(0, float("-inf"))])
    dev = xm.xla_device()
    torch.testing.assert_close(op(a.to(dev), b.to(dev)).cpu(), op(a, b), equal_nan=True, rtol=0, atol=0)


def test_a_value_read_by_many_ops_is_cast_once():
    dev = xm.xla_device()
    s = torch.tensor([3, -2, 7, 1])  # int64: each op casts it to float32
    x = torch.randn(4)
    t, sd = x.to(dev), s.to(dev)
    xm.mark_step()
    u, ref = t, x
    for _ in range(3):
        u, ref = (u + sd) * sd, (ref + s) * s
    text = xm.get_stablehlo([u])
    assert _count(text, "convert") == 1, text
    torch.testing.assert_close(u.cpu(), ref, rtol=0, atol=0)


def test_a_default_number_is_a_concrete_constant_even_when_made_inside_a_trace(caplog):
    """``weak_number`` keeps its constants across graphs: one made while a graph is traced
    must not be that trace's tracer (another graph would then hold a leaked tracer), and
    making one compiles nothing (no program in the persistent cache, no compile time)."""
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        fresh = [weak_number(v) for v in (12.375, -3, True, 2 - 1j)]
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert [str(c.dtype) for c in fresh] == ["float64", "int64", "bool", "complex128"]
    assert all(c.aval.weak_type for c in fresh[:2] + fresh[3:])
    made = []

    def f(x):
        made.append(weak_number(7.25))
        return x * made[-1]

    assert float(jax.jit(f)(jax.numpy.float32(2))) == 14.5
    assert not isinstance(made[0], jax.core.Tracer)
    assert float(jax.jit(lambda x: x + weak_number(7.25))(jax.numpy.float32(1))) == 8.25
    assert weak_number(7.25) is made[0] and weak_number(-0.0) is not weak_number(0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lerp_with_a_number_weight_decides_its_branch_once_and_gives_cpus_values(dtype):
    """torch.optim's Adam lerps every parameter's moment by one number: the branch CPU's
    formula takes for it (by ``|w| < 0.5``, ``1 - w`` in the tensors' dtype, half dtypes in
    float32) is computed once for the whole foreach op, not per tensor."""
    dev = xm.xla_device()
    xs = [torch.randn(3, 4, dtype=dtype), torch.randn(50, dtype=dtype), torch.randn(2, 2, 2, dtype=dtype)]
    ys = [torch.randn_like(x) * 5 for x in xs]
    for w in (0.1, 0.3, 0.5, 0.9, 1.0, -0.2, -2.0, float("nan")):
        got = [x.to(dev) for x in xs]
        torch._foreach_lerp_(got, [y.to(dev) for y in ys], w)
        text = xm.get_stablehlo(got)
        assert _count(text, "compare") == 1, text
        want = [x.clone() for x in xs]
        torch._foreach_lerp_(want, ys, w)
        for g, r in zip(got, want):
            torch.testing.assert_close(g.cpu(), r, rtol=0, atol=0, equal_nan=True)
        one = torch.lerp(xs[1].to(dev), ys[1].to(dev), w).cpu()
        torch.testing.assert_close(one, torch.lerp(xs[1], ys[1], w), rtol=0, atol=0, equal_nan=True)


def test_numbers_on_the_compiled_path_lower_as_on_the_lazy_path():
    """Dynamo's graphs keep Python numbers as such (``trace/fx.py``): add / sub / rsub of a
    number, real and complex, through ``torch.compile``."""
    dev = xm.xla_device()

    def f(x, z):
        return torch.add(x, 2.5) - 1.5, torch.rsub(x, 3.0), torch.sub(z, 1.5j), torch.add(z, 2.0, alpha=3)

    x, z = torch.randn(6), torch.randn(6, dtype=torch.complex64)
    got = torch.compile(f, backend="openxla")(x.to(dev), z.to(dev))
    for g, r in zip(got, f(x, z)):
        torch.testing.assert_close(g.cpu(), r, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_division_by_a_broadcast_divisor_gives_cpus_correctly_rounded_quotients(dtype):
    """XLA's simplifier turns ``A / broadcast(b)`` into ``A * broadcast(1 / b)``: float32 ``x /
    0.3`` differed from CPU in a quarter of elements, ``x / x.sum(-1, keepdim=True)`` in a third,
    and ``_foreach_div`` of Adam's bias correction likewise (the lazy and compiled paths then
    differed from each other, as XLA rewrote one program and not the other). A broadcast divisor
    now reaches the division through an optimization barrier: the program still fuses the
    broadcast into the division, and every quotient is CPU's."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 300, generator=g) * 3).to(dtype)
    s = (torch.rand(64, 1, generator=g) + 0.5).to(dtype)
    t = torch.tensor(0.7, dtype=dtype)

    def f(x, s, t):
        return [
            x / 0.3,
            x / t,
            x / s,
            torch.div(x, 0.3, rounding_mode="trunc"),
            torch.div(x, s, rounding_mode="floor"),
            torch.addcdiv(x, x, s, value=-0.5),
            torch._foreach_div([x, x[0]], [0.3, 3.0])[1],
        ]

    want = f(x, s, t)
    dev = [v.to("xla") for v in (x, s, t)]
    for path, fn in (("lazy", f), ("compiled", torch.compile(f, backend="openxla"))):
        for i, (a, b) in enumerate(zip(fn(*dev), want)):
            if path == "compiled" and i == 5 and dtype == torch.bfloat16:
                continue  # Dynamo rewrites addcdiv(value=) into div, mul and add, each rounded (any backend)
            assert torch.equal(a.cpu(), b), (path, i, (a.cpu() != b).sum().item())
