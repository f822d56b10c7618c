"""More linear algebra: the matrix exponential, LU with its permutation matrix, products of
Householder reflectors.

``linalg_matrix_exp`` follows CPU's algorithm (``mexp`` in ``LinearAlgebra.cpp``: Bader,
Blanes and Casas's optimised Taylor polynomials of degree 1, 2, 4, 8, 12 or 18, chosen per
matrix by its 1-norm, the last with scaling and squaring). CPU groups the matrices of a batch
by degree; here every polynomial is evaluated for every matrix and each matrix keeps CPU's
choice (a select, no data-dependent shapes). Its matmuls run at full float32 precision, as
CPU's (which disables TF32 for it), whatever the precision set for other matmuls.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from xlatorch.lowering.linalg import _lapack, _lu, lu_unpack

# The largest 1-norm for which each degree (1, 2, 4, 8, 12, 18) is accurate to the unit
# roundoff: float32/complex64 thetas, and float64's (which CPU uses for every other dtype).
_THETAS_F32 = (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02, 5.800524627688768e-01,
               1.461661507209034e00, 3.010066362817634e00)  # fmt: skip
_THETAS_F64 = (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04, 4.991228871115323e-02,
               2.996158913811580e-01, 1.090863719290036e00)  # fmt: skip

_SQRT_177 = 0.1330413469565007072504e2
_X3 = 2.0 / 3.0
# x7 divides by x3^2 (the paper's; torch 2.13's CPU results agree, older copies of this code
# divide by x3 once, which is off by ~1e-13 in float64)
_T8 = dict(
    x1=_X3 * ((1.0 + _SQRT_177) / 88.0),
    x2=_X3 * ((1.0 + _SQRT_177) / 352.0),
    x4=(-271.0 + 29.0 * _SQRT_177) / (315.0 * _X3),
    x5=(-11.0 + 11.0 * _SQRT_177) / (1260.0 * _X3),
    x6=(-99.0 + 11.0 * _SQRT_177) / (5040.0 * _X3),
    x7=(89.0 - _SQRT_177) / (5040.0 * _X3 * _X3),
    y2=(857.0 - 58.0 * _SQRT_177) / 630.0,
)
# T12's and T18's coefficients: row i gives B_i as a combination of (I, A, A^2, A^3[, A^6]).
_B12 = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
        (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
        (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
        (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359))  # fmt: skip
_B18 = ((0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.0),
        (0.0, 3.97849749499645077844e-01, 1.36783778460411720168e00, 4.98289622525382669416e-01,
         -6.37898194594723280150e-04),
        (-1.09676396052962061844e01, 1.68015813878906206114e00, 5.71779846478865511061e-02,
         -6.98210122488052056106e-03, 3.34975017086070470649e-05),
        (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
         2.95552570429315521194e-02, -1.39180257516060693404e-05),
        (0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05))  # fmt: skip


def _mm(a, b):
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _combine(powers, coeffs):
    """sum_j coeffs[j] * powers[j] (CPU's ``_compute_linear_combination``), coefficients
    rounded to the matrices' real dtype as CPU's constants are."""
    real = jnp.finfo(powers[0].dtype).dtype
    res = None
    for p, c in zip(powers, coeffs):
        term = p * jnp.asarray(c, real)
        res = term if res is None else res + term
    return res


def _taylor(a, eye):
    """CPU's degree 1, 2, 4, 8, 12 and 18 approximations of exp(a) (compute_T1 ... T18)."""
    a2 = _mm(a, a)
    t1 = eye + a
    t2 = eye + a + a2 / 2
    t4 = eye + a + _mm(a2, _combine((eye, a, a2), (1 / 2.0, 1 / 6.0, 1 / 24.0)))
    c = _T8
    a4 = _mm(a2, _combine((a, a2), (c["x1"], c["x2"])))
    a8 = _mm(_combine((a2, a4), (_X3, 1.0)), _combine((eye, a, a2, a4), (c["x4"], c["x5"], c["x6"], c["x7"])))
    t8 = _combine((eye, a, a2, a8), (1.0, 1.0, c["y2"], 1.0))
    a3 = _mm(a, a2)
    b = [_combine((eye, a, a2, a3), row) for row in _B12]
    a6 = b[2] + _mm(b[3], b[3])
    t12 = b[0] + _mm(b[1] + a6, a6)
    return t1, t2, t4, t8, t12


def _t18(a, eye):
    a2 = _mm(a, a)
    a3 = _mm(a, a2)
    b = [_combine((eye, a, a2, a3, _mm(a3, a3)), row) for row in _B18]
    a9 = b[3] + _mm(b[0], b[4])
    return b[1] + _mm(b[2] + a9, a9)


@_lapack
def matrix_exp(out, self):
    """aten.linalg_matrix_exp: CPU's degree-selected Taylor approximation (module docstring)."""
    n = self.shape[-1]
    if n == 0:
        return self
    if n == 1:
        return jnp.exp(self)
    single = out.dtype in (jnp.float32, jnp.complex64)
    thetas = _THETAS_F32 if single else _THETAS_F64
    a = self
    real = jnp.finfo(a.dtype).dtype
    eye = jnp.eye(n, dtype=a.dtype)
    norm = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1)[..., None, None]  # the 1-norm, per matrix
    # Scaling and squaring for norms past the degree-12 bound: exp(a) = exp(a / 2^s)^(2^s).
    s = jnp.maximum(jnp.ceil(jnp.log2(norm / jnp.asarray(thetas[5], real))), 0)
    s = jnp.where(jnp.isfinite(s), s, 0).astype(jnp.int64)  # CPU gives no finite result either
    res = _t18(a / (2.0**s).astype(real), eye)

    def square(carry):
        i, m = carry
        return i + 1, jnp.where(i < s, _mm(m, m), m)

    _, res = lax.while_loop(lambda c: c[0] < jnp.max(s), square, (jnp.zeros((), jnp.int64), res))
    # Degree k for a norm in (theta_{k-1}, theta_k]; a norm of exactly theta_12 (and a NaN)
    # keeps degree 18, as CPU's last pass overwrites it.
    bounds = [-1.0, *thetas[:5]]
    for k, t in enumerate(_taylor(a, eye)):
        low, high = jnp.asarray(bounds[k], real), jnp.asarray(bounds[k + 1], real)
        inside = (low < norm) & ((norm <= high) if k < 4 else (norm < high))
        res = jnp.where(inside, t, res)
    return res


@_lapack
def linalg_lu(out, A, pivot=True):
    """aten.linalg_lu: (P, L, U) with A = P L U, from LAPACK's partially pivoted LU of A, as
    CPU unpacks it (CPU has no LU without pivoting: its entry refuses pivot=False)."""
    lu, piv = _lu(A)
    P, L, U = lu_unpack(out, lu, piv, unpack_pivots=pivot)
    return P, L, U  # pivot=False (only an empty A gets here): P is an empty (0,)


@_lapack
def householder_product(out, input, tau):
    """aten.linalg_householder_product: the first n columns of H_1 ... H_k, H_i = I - tau_i v_i
    v_i^H with v_i below the diagonal of column i of ``input`` (LAPACK's orgqr / ungqr)."""
    if math.prod(input.shape) == 0:
        return jnp.zeros(out.shape, out.dtype)
    return lax.linalg.householder_product(input, tau)


def eig_finite(self):
    """The check CPU's ``linalg_eig`` makes before LAPACK's geev: no inf or NaN in the input."""
    if self.size == 0:
        return None
    return (
        jnp.any(~jnp.isfinite(self)),
        0,
        0,
        RuntimeError,
        "torch.linalg.eig: input tensor should not contain infs or NaNs.",
    )


@_lapack
def linalg_eig(out, self):
    """aten.linalg_eig: complex eigenvalues and right eigenvectors from geev, as CPU's: its
    eigenvalue order, each eigenvector of unit 2-norm with its largest component real. That
    leaves each eigenvector's sign to the LAPACK build (CPU's MKL and JAX's flip some apart)."""
    if self.size == 0:
        return jnp.zeros(out[0].shape, out[0].dtype), jnp.zeros(out[1].shape, out[1].dtype)
    w, v = lax.linalg.eig(self, compute_left_eigenvectors=False)
    return w.astype(out[0].dtype), v.astype(out[1].dtype)


@_lapack
def linalg_eigvals(out, self):
    """aten._linalg_eigvals: the eigenvalues of :func:`linalg_eig`."""
    if self.size == 0:
        return jnp.zeros(out.shape, out.dtype)
    (w,) = lax.linalg.eig(self, compute_left_eigenvectors=False, compute_right_eigenvectors=False)
    return w.astype(out.dtype)
