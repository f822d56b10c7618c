"""Linear algebra: fused matrix products, norms, factorizations and solves.

Factorizations return PyTorch's conventions: LU pivots are 1-based int32 (LAPACK's
getrf), ``info`` is 0 (errors are not checked on the device).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax

_LOW = (jnp.bfloat16, jnp.float16)


def _lapack(fn):
    """Run a factorization or solve in float32 when its inputs are stored in bfloat16/float16.

    LAPACK (and JAX's linalg) has no low-precision kernels, and PyTorch rejects bfloat16 and
    float16 here; such inputs only arrive from float32/float64 tensors that a precision mode
    (XLA_USE_BF16, XLA_DOWNCAST_BF16) stores as bfloat16. Results are rounded back to the
    storage dtype when the node's outputs are cast to their avals.
    """

    @functools.wraps(fn)
    def run(out, *args, **kwargs):
        return fn(out, *(a.astype(jnp.float32) if getattr(a, "dtype", None) in _LOW else a for a in args), **kwargs)

    return run


def _scalars(out, beta, alpha):
    # PyTorch converts alpha and beta to the result's dtype (0.6 is 0 for int64, True for bool).
    return jnp.asarray(beta).astype(out.dtype), jnp.asarray(alpha).astype(out.dtype)


def _beta_self(beta, self):
    # PyTorch ignores ``self`` (NaN included) when beta == 0.
    return jnp.where(beta == 0, jnp.zeros((), self.dtype), beta * self)


def addbmm(out, self, batch1, batch2, beta=1, alpha=1):
    """aten.addbmm: beta * self + alpha * sum_b batch1[b] @ batch2[b]."""
    beta, alpha = _scalars(out, beta, alpha)
    return _beta_self(beta, self) + alpha * jnp.einsum("bij,bjk->ik", batch1, batch2)


def addmv(out, self, mat, vec, beta=1, alpha=1):
    """aten.addmv: beta * self + alpha * mat @ vec."""
    beta, alpha = _scalars(out, beta, alpha)
    return _beta_self(beta, self) + alpha * jnp.matmul(mat, vec)


def addr(out, self, vec1, vec2, beta=1, alpha=1):
    """aten.addr: beta * self + alpha * outer(vec1, vec2) (logical and/or for bool)."""
    beta, alpha = _scalars(out, beta, alpha)
    if out.dtype == jnp.bool_:
        return (beta & self) | (alpha & jnp.outer(vec1, vec2))
    if out.dtype in _LOW:
        # CPU's kernel rounds each product to the dtype: (beta * self) + ((alpha * vec1) * vec2).
        # reduce_precision keeps XLA from skipping those roundings (excess precision).
        info = jnp.finfo(out.dtype)
        r = functools.partial(lax.reduce_precision, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        f32 = jnp.float32
        prod = r(r(alpha.astype(f32) * vec1.astype(f32)[:, None]) * vec2.astype(f32)[None, :])
        scaled = jnp.where(beta == 0, 0, r(beta.astype(f32) * self.astype(f32)))  # beta == 0 ignores self
        return (scaled + prod).astype(out.dtype)
    return _beta_self(beta, self) + alpha * jnp.outer(vec1, vec2)


def vector_norm(out, self, ord=2, dim=None, keepdim=False, dtype=None):
    """aten.linalg_vector_norm (``ord`` static): inf/-inf/0/p norms, computed in ``out``'s dtype
    (in float32 for bfloat16/float16, rounded once, as CPU accumulates them)."""
    x = jnp.abs(self.astype(out.dtype) if not jnp.iscomplexobj(self) else self).astype(out.dtype)
    if x.dtype in _LOW:
        x = x.astype(jnp.float32)
    axes = None if dim is None or len(dim) == 0 else tuple(d % max(x.ndim, 1) for d in dim)
    if x.ndim == 0:
        axes = None
    if ord == float("inf"):
        res = jnp.max(x, axis=axes, keepdims=keepdim)
    elif ord == float("-inf"):
        res = jnp.min(x, axis=axes, keepdims=keepdim)
    elif ord == 0:
        res = jnp.sum(x != 0, axis=axes, keepdims=keepdim)
    elif ord == 1:
        res = jnp.sum(x, axis=axes, keepdims=keepdim)
    elif ord == 2:
        res = jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    else:
        res = jnp.sum(x**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)
    return res.astype(out.dtype)


def _lu(a):
    lu, piv, _ = lax.linalg.lu(a)
    return lu, (piv + 1).astype(jnp.int32)


def _zero_pivot(lu):
    """LAPACK's ``info`` of an LU factorization: the 1-based index of the first exactly zero
    diagonal element of U, 0 if none (per matrix of a batch)."""
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    if zero.shape[-1] == 0:  # an empty matrix factors
        return jnp.zeros(zero.shape[:-1], jnp.int32)
    return jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)


def _not_positive_definite(a):
    """LAPACK potrf's ``info``: the order of the first leading minor of Hermitian ``a`` that is not
    positive-definite (Sylvester: the first non-positive pivot of elimination without pivoting),
    0 if none."""
    n = a.shape[-1]
    if n == 0:
        return jnp.zeros(a.shape[:-2], jnp.int32)

    def step(k, carry):
        m, pivots = carry
        p = jnp.real(m[..., k, k])
        pivots = pivots.at[..., k].set(p)
        m = m - m[..., :, k, None] * m[..., None, k, :] / m[..., k, k][..., None, None]
        return m, pivots

    _, pivots = lax.fori_loop(0, n, step, (a, jnp.zeros(a.shape[:-1], jnp.real(a).dtype)))
    bad = ~(pivots > 0)  # NaN too
    return jnp.where(jnp.any(bad, axis=-1), jnp.argmax(bad, axis=-1) + 1, 0).astype(jnp.int32)


def _perm_sign(piv):
    n = piv.shape[-1]
    swaps = jnp.sum(piv != jnp.arange(1, n + 1, dtype=piv.dtype), axis=-1)
    return jnp.where(swaps % 2 == 0, 1, -1)


def _lu_as_cpu(A):
    """The LU that PyTorch's det/slogdet save for their backward: of A^T for a real A (CPU
    factors the transpose of a C-contiguous real matrix, which device tensors always are, and
    the backward solves with ``adjoint=False`` on that assumption), of A for a complex one."""
    return _lu(A if jnp.iscomplexobj(A) else jnp.swapaxes(A, -1, -2))


@_lapack
def linalg_det(out, A):
    """aten._linalg_det: (det, LU, pivots), the LU of A^T for real A (see ``_lu_as_cpu``)."""
    lu, piv = _lu_as_cpu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return jnp.prod(diag, axis=-1) * _perm_sign(piv).astype(lu.dtype), lu, piv


@_lapack
def linalg_slogdet(out, A):
    """aten._linalg_slogdet: (sign, logabsdet, LU, pivots), the LU of A^T for real A."""
    lu, piv = _lu_as_cpu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    sign = _perm_sign(piv).astype(lu.dtype) * jnp.prod(diag / jnp.abs(diag), axis=-1)
    logabs = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    sign = jnp.where(logabs == -jnp.inf, 0, sign)
    return sign, logabs, lu, piv


@_lapack
def lu_factor_ex(out, A, pivot=True, check_errors=False):
    """aten.linalg_lu_factor_ex: (LU, pivots, info) with partial pivoting."""
    lu, piv = _lu(A)
    return lu, piv, _zero_pivot(lu)


@_lapack
def solve_triangular(out, self, B, upper, left=True, unitriangular=False):
    """aten.linalg_solve_triangular: X with self @ X = B (or X @ self = B)."""
    shape = jnp.broadcast_shapes(self.shape[:-2], B.shape[:-2])
    a = jnp.broadcast_to(self, shape + self.shape[-2:])
    b = jnp.broadcast_to(B, shape + B.shape[-2:])
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)


@_lapack
def triangular_solve(out, self, A, upper=True, transpose=False, unitriangular=False):
    """aten.triangular_solve: (solution of op(A) X = self, A)."""
    shape = jnp.broadcast_shapes(A.shape[:-2], self.shape[:-2])
    a = jnp.broadcast_to(A, shape + A.shape[-2:])
    b = jnp.broadcast_to(self, shape + self.shape[-2:])
    x = lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)  # fmt: skip
    return x, a


@_lapack
def cholesky_ex(out, self, upper=False, check_errors=False):
    """aten.linalg_cholesky_ex: (L or U, info)."""
    low = jnp.linalg.cholesky(self)
    res = jnp.conj(jnp.swapaxes(low, -1, -2)) if upper else low
    failed = jnp.any(jnp.isnan(low))  # XLA fills a failed factorization with NaNs
    info = lax.cond(failed, _not_positive_definite, lambda a: jnp.zeros(a.shape[:-2], jnp.int32), self)
    return res, info


@_lapack
def cholesky_solve(out, self, input2, upper=False):
    """aten.cholesky_solve: X with (L L^H) X = self."""
    shape = jnp.broadcast_shapes(input2.shape[:-2], self.shape[:-2])
    c = jnp.broadcast_to(input2, shape + input2.shape[-2:])
    b = jnp.broadcast_to(self, shape + self.shape[-2:])
    return jsl.cho_solve((c, not upper), b)


@_lapack
def cholesky_inverse(out, self, upper=False):
    """aten.cholesky_inverse: (L L^H)^-1."""
    eye = jnp.broadcast_to(jnp.eye(self.shape[-1], dtype=self.dtype), self.shape)
    return jsl.cho_solve((self, not upper), eye)


@_lapack
def linalg_qr(out, A, mode="reduced"):
    """aten.linalg_qr (reduced/complete/r; Householder, LAPACK's signs)."""
    if mode == "r":
        return jnp.zeros(out[0].shape, out[0].dtype), jnp.linalg.qr(A, mode="r")
    return jnp.linalg.qr(A, mode=mode)


@_lapack
def inv_ex(out, A, check_errors=False):
    """aten.linalg_inv_ex: (inverse, info), from the LU CPU factors (``_lu_as_cpu``), so a
    singular matrix reports the zero diagonal element CPU names."""
    lu, piv = _lu_as_cpu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    inv = jsl.lu_solve((lu, piv - 1), eye, trans=0 if jnp.iscomplexobj(A) else 1)
    return inv, _zero_pivot(lu)


@_lapack
def solve_ex(out, A, B, left=True, check_errors=False):
    """aten._linalg_solve_ex: (X, LU, pivots, info); B may be a (batched) vector."""
    lu, piv = _lu(A)
    vector = B.ndim == A.ndim - 1 or B.ndim == 1
    b = B[..., None] if vector else B
    if not left:
        b = jnp.swapaxes(b, -1, -2)
        at = jnp.swapaxes(A, -1, -2)
        x = jnp.swapaxes(jnp.linalg.solve(at, b), -1, -2)
    else:
        shape = jnp.broadcast_shapes(A.shape[:-2], b.shape[:-2])
        x = jnp.linalg.solve(jnp.broadcast_to(A, shape + A.shape[-2:]), jnp.broadcast_to(b, shape + b.shape[-2:]))
    if vector:
        x = x[..., 0]
    return x, lu, piv, _zero_pivot(lu)


@_lapack
def eigh(out, A, UPLO="L", compute_v=True):
    """aten._linalg_eigh: ascending eigenvalues and eigenvectors (sign convention may differ)."""
    w, v = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return w, v if compute_v else jnp.zeros(out[1].shape, out[1].dtype)


@_lapack
def svd(out, A, full_matrices=False, compute_uv=True, driver=None):
    """aten._linalg_svd: (U, S, Vh) (singular-vector signs may differ from LAPACK's)."""
    if not compute_uv:
        s = jnp.linalg.svd(A, compute_uv=False)
        return jnp.zeros(out[0].shape, out[0].dtype), s, jnp.zeros(out[2].shape, out[2].dtype)
    return jnp.linalg.svd(A, full_matrices=full_matrices)


def linalg_cross(out, self, other, dim=-1):
    """aten.linalg_cross (inputs broadcast)."""
    a, b = jnp.broadcast_arrays(self, other)
    return jnp.cross(a, b, axis=dim % a.ndim)


def diag_embed(out, self, offset=0, dim1=-2, dim2=-1):
    """aten.diag_embed: the last dim of ``self`` on a diagonal of new dims ``dim1``/``dim2``."""
    n = out.shape[dim1 % len(out.shape)]
    base = jnp.zeros(self.shape[:-1] + (n, n), self.dtype)
    i = jnp.arange(self.shape[-1])
    r, c = (i, i + offset) if offset >= 0 else (i - offset, i)
    res = base.at[..., r, c].set(self)
    return jnp.moveaxis(res, (-2, -1), (dim1 % len(out.shape), dim2 % len(out.shape)))


@_lapack
def lu_solve(out, LU, pivots, B, left=True, adjoint=False):
    """aten.linalg_lu_solve: X with A X = B (A^H if ``adjoint``; X A = B if not ``left``)."""
    shape = jnp.broadcast_shapes(LU.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(LU, shape + LU.shape[-2:])
    piv = jnp.broadcast_to(pivots, shape + pivots.shape[-1:]) - 1
    b = jnp.broadcast_to(B, shape + B.shape[-2:])
    if left:
        return jsl.lu_solve((lu, piv), b, trans=2 if adjoint else 0)
    # X A = B  <=>  A^H X^H = B^H
    bh = jnp.conj(jnp.swapaxes(b, -1, -2))
    return jnp.conj(jnp.swapaxes(jsl.lu_solve((lu, piv), bh, trans=0 if adjoint else 2), -1, -2))


def trilinear(out, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """aten._trilinear (``F.bilinear``): two einsums, as CPU contracts: ``i1`` with ``i2`` over
    the summed dims ``i3`` lacks, the result (rounded to the output dtype, as CPU's bfloat16
    kernels round it) with ``i3`` over the rest; each input unsqueezed at its ``expand`` dims,
    size-1 dims broadcast."""
    n = i1.ndim + len(expand1)
    ops = []
    for x, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        gone = {e % n for e in expand}
        ops.append((x, [d for d in range(n) if d not in gone]))
    size = [max([x.shape[dims.index(d)] for x, dims in ops if d in dims], default=1) for d in range(n)]
    args = []
    for x, dims in ops:
        keep = [k for k, d in enumerate(dims) if x.shape[k] != 1 or size[d] == 1]  # drop broadcast dims
        args.append((x.reshape([x.shape[k] for k in keep]), [dims[k] for k in keep]))
    summed = {s % n for s in sumdim}
    (a, la), (b, lb), (c, lc) = args
    first = [d for d in range(n) if d in set(la) | set(lb) and not (d in summed and d not in lc)]
    ab = jnp.einsum(a, la, b, lb, first).astype(out.dtype)
    last = [d for d in range(n) if d not in summed and d in set(first) | set(lc)]
    return jnp.einsum(ab, first, c, lc, last).reshape(out.shape)


def pinv(out, self, atol=None, rtol=None, hermitian=False):
    """aten.linalg_pinv.atol_rtol_tensor: the pseudo-inverse from an SVD (an eigendecomposition
    when ``hermitian``), singular values at or below ``max(atol, rtol * largest)`` dropped;
    ``rtol`` defaults to eps * max(m, n), or 0 when a positive ``atol`` is given (PyTorch's rule)."""
    if 0 in self.shape:
        return jnp.zeros(out.shape, out.dtype)
    a = self.astype(jnp.float32) if self.dtype in _LOW else self
    real = jnp.finfo(a.dtype).dtype
    default_rtol = jnp.finfo(real).eps * max(a.shape[-2], a.shape[-1])
    atol_ = jnp.zeros((), real) if atol is None else atol.astype(real)
    if rtol is not None:
        rtol_ = rtol.astype(real)
    elif atol is not None:
        rtol_ = jnp.where(atol_ > 0, 0, default_rtol).astype(real)
    else:
        rtol_ = jnp.asarray(default_rtol, real)
    if hermitian:
        s, u = jnp.linalg.eigh(a, symmetrize_input=False)
        big = jnp.max(jnp.abs(s), axis=-1, keepdims=True)
        tol = jnp.maximum(atol_[..., None], rtol_[..., None] * big)
        inv = jnp.where(jnp.abs(s) > tol, 1 / s, 0).astype(a.dtype)
        return jnp.matmul(u * inv[..., None, :], jnp.conj(jnp.swapaxes(u, -1, -2)))
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    tol = jnp.maximum(atol_[..., None], rtol_[..., None] * s[..., :1])
    inv = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
    return jnp.matmul(jnp.conj(jnp.swapaxes(vh, -1, -2)) * inv[..., None, :], jnp.conj(jnp.swapaxes(u, -1, -2)))


def lu_unpack(out, LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    """aten.lu_unpack: (P, L, U) with A = P @ L @ U from LAPACK-style LU and 1-based pivots."""
    m, n = LU_data.shape[-2:]
    k = min(m, n)
    P = L = U = None
    if unpack_data:
        L = jnp.tril(LU_data[..., :, :k], -1) + jnp.eye(m, k, dtype=LU_data.dtype)
        U = jnp.triu(LU_data[..., :k, :])
    else:
        L, U = jnp.zeros(out[1].shape, out[1].dtype), jnp.zeros(out[2].shape, out[2].dtype)
    if unpack_pivots:
        perm = lax.linalg.lu_pivots_to_permutation(LU_pivots.astype(jnp.int32) - 1, m)
        # P^T A = L U with (P^T)[i] = e_perm[i]: P[perm[i], i] = 1.
        P = jnp.swapaxes(jnp.eye(m, dtype=out[0].dtype)[perm], -1, -2)
        P = jnp.broadcast_to(P, out[0].shape)
    else:
        P = jnp.zeros(out[0].shape, out[0].dtype)
    return P, L, U
