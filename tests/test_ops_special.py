"""Special functions against CPU eager where the OpInfo samples do not reach: the polynomials'
scalar overloads and degrees past the trigonometric switch, gcd / lcm at integer limits."""

from __future__ import annotations

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met


def _run(op: str, fn, *args):
    """``fn`` on CPU and on the device, asserting the device ran ``aten::<op>`` without a fallback."""
    dev = xm.xla_device()
    want = fn(*args)
    met.clear_counters()
    got = fn(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]).cpu()
    assert f"aten::{op}" not in met.executed_fallback_ops()
    return want, got


# The scalar overloads of a few kinds (each call compiles a loop: kept short for CI)
@pytest.mark.parametrize("name", ["chebyshev_polynomial_u", "shifted_chebyshev_polynomial_w", "legendre_polynomial_p"])
def test_polynomial_overloads(name):
    fn = getattr(torch.special, name)
    # Ends of the (shifted) interval, inside it, outside it; no NaN x: CPU's U/V/W/L/P kernels
    # return an uninitialised value there (their loop never runs).
    x = torch.tensor([-1.0, 1.0, 0.0, 0.25, 0.5, -0.3, 0.9, 1.5, -1.5, 3.0], dtype=torch.float64)
    n = torch.tensor([-2.0, 0, 1, 2, 5, 7, 9, 12, 30, float("nan")], dtype=torch.float64)
    # float64: the recurrences and the trigonometric forms lose a few ulps times the degree
    for args in [(0.5, n), (x, 9)]:
        want, got = _run(f"special_{name}", fn, *args)
        tol = 1e-4 if want.dtype == torch.float32 else 1e-10  # float32: degree 30 times ~1e-7 per step
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def test_huge_degree_takes_no_loop():
    """CPU returns before its loop (NaN past hermite's limit, the trigonometric form, n < 0):
    a huge integer degree must not run the recurrence that many steps."""
    n = torch.tensor([2**62, -(2**63), 7], dtype=torch.int64)
    for name, x in [("hermite_polynomial_h", 0.5), ("chebyshev_polynomial_t", 0.5), ("legendre_polynomial_p", 1.0)]:
        want, got = _run(f"special_{name}", getattr(torch.special, name), torch.full((3,), x), n)
        torch.testing.assert_close(got, want, equal_nan=True)


def test_gcd_lcm_integer_limits():
    a = torch.tensor([-(2**63), -(2**63), 2**62, -3, 0, 12, -12, 7], dtype=torch.int64)
    b = torch.tensor([0, 2, 3, -5, 0, -18, -18, 0], dtype=torch.int64)
    for op in ("gcd", "lcm"):
        want, got = _run(op, getattr(torch, op), a, b)
        assert torch.equal(got, want)
    # int8: C++ computes lcm's product in int before the store truncates it
    a8 = torch.tensor([-43, -128, -128, 100, 0], dtype=torch.int8)
    b8 = torch.tensor([3, 0, -128, 3, -7], dtype=torch.int8)
    for op in ("gcd", "lcm"):
        want, got = _run(op, getattr(torch, op), a8, b8)
        assert torch.equal(got, want)
