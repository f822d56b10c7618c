"""torch_xla's kernels (``custom_kernel``, ``pallas_kernels``, ``splash_attention``) against plain
PyTorch on CPU: paged attention = gather the pages + softmax attention; quantized matmul =
dequantize + matmul; grouped matmuls = a loop over groups; outputs and, where the kernel is
differentiable, gradients.

Tolerances come from the dtype and the length of the sums (``_bound``): a float32 sum of ``n``
terms is off by at most about ``n * eps32`` times its largest term, and a result stored in a
narrower dtype adds that dtype's rounding. Attention's logit error moves the softmax weights by
the same relative amount, so its outputs are bounded by that times the largest value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xlatorch
import xlatorch.debug.metrics as met
from xlatorch.experimental import custom_kernel as ck
from xlatorch.experimental.pallas_kernels import quantized_matmul_kernel as qmk
from xlatorch.experimental.pallas_kernels import ragged_paged_attention_kernel as rpa
from xlatorch.experimental.splash_attention import SplashAttentionConfig, splash_attention

DEV = xlatorch.device()
EPS32 = torch.finfo(torch.float32).eps


def _bound(dtype: torch.dtype, terms: int, scale: float) -> float:
    """How far two float32 evaluations of ``terms``-term sums of magnitude ``scale``, each then
    stored as ``dtype``, may be apart (the orders of addition differ between backends)."""
    narrow = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    return (2 * terms * EPS32 + narrow) * scale


def _close(got, want, tol):
    got = got.detach().cpu().float()
    want = want.detach().float()
    assert got.shape == want.shape
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol, f"max error {err} > tolerance {tol}"


def _attention_bound(dtype, q, k, v, kv_len, sm_scale=1.0):
    """Output bound. A logit is a head_dim-term sum whose terms sum in magnitude to at most
    ``|q| |k|`` (Cauchy-Schwarz); its error shifts each softmax weight by the same relative
    amount, which moves the output (a convex combination of values) by twice that times the
    largest value; then the kv_len-term sum over the values and the rounding to ``dtype``."""
    norm = lambda t: float(t.float().norm(dim=-1).max())  # noqa: E731
    logit = _bound(torch.float32, q.shape[-1], norm(q) * norm(k) * sm_scale)
    vmax = float(v.abs().max())
    return 2 * logit * vmax + _bound(dtype, kv_len, vmax)


# --- plain PyTorch references ------------------------------------------------------------


def _ref_attend(q, k, v, keep, *, sm_scale=1.0, soft_cap=None, mask_value=float("-inf")):
    """``q`` [n_q, heads, d], ``k``/``v`` [n_k, kv_heads, d], ``keep`` [n_q, n_k]; float32 result."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    s = s.masked_fill(~keep, mask_value)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _head_major_keys(pages, index, length):
    """The first ``length`` rows of pages ``index`` of a [kv_heads, pages, page_size, d] cache."""
    x = pages[:, index].permute(1, 2, 0, 3)
    return x.reshape(-1, pages.shape[0], pages.shape[-1])[:length]


def _ref_multi_query(q, k_pages, v_pages, lengths, page_indices, q_lens, soft_cap=None, mask_value=float("-inf")):
    outs = []
    for b in range(q.shape[0]):
        n, eq = int(lengths[b]), int(q_lens[b])
        k, v = (_head_major_keys(p, page_indices[b], n) for p in (k_pages, v_pages))
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(n)[None]
        outs.append(_ref_attend(q[b], k, v, j <= i + n - eq, soft_cap=soft_cap, mask_value=mask_value))
    return torch.stack(outs)


def _paged_inputs(batch, q_heads, kv_heads, head_dim, page_size, pages_per_seq, dtype, query_len=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_pages = batch * pages_per_seq + 3
    shape = (batch, q_heads, head_dim) if query_len is None else (batch, query_len, q_heads, head_dim)
    q = torch.randn(shape, generator=g).to(dtype)
    k_pages = torch.randn(kv_heads, total_pages, page_size, head_dim, generator=g).to(dtype)
    v_pages = torch.randn(kv_heads, total_pages, page_size, head_dim, generator=g).to(dtype)
    page_indices = torch.randperm(total_pages, generator=g)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    lengths = torch.randint(1, pages_per_seq * page_size + 1, (batch,), generator=g)
    return q, k_pages, v_pages, lengths.int(), page_indices.int()


# --- paged attention -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_paged_attention_equals_attention_over_the_gathered_pages(dtype, q_heads, kv_heads, soft_cap):
    q, k_pages, v_pages, lengths, page_indices = _paged_inputs(3, q_heads, kv_heads, 16, 4, 4, dtype)
    lengths[0] = 1  # one key only; and one sequence filling all its pages
    lengths[1] = 16
    got = ck.paged_attention(*(t.to(DEV) for t in (q, k_pages, v_pages, lengths, page_indices)),
                             pages_per_compute_block=2, attn_logits_soft_cap=soft_cap)  # fmt: skip
    assert got.dtype == dtype and got.shape == q.shape
    want = _ref_multi_query(q[:, None], k_pages, v_pages, lengths, page_indices, torch.ones(3), soft_cap)[:, 0]
    _close(got, want, _attention_bound(dtype, q, k_pages, v_pages, 16))


def test_paged_attention_checks_megacore_mode():
    q, k_pages, v_pages, lengths, page_indices = _paged_inputs(1, 2, 2, 8, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="megacore_mode"):
        ck.paged_attention(q, k_pages, v_pages, lengths, page_indices, 1, megacore_mode="heads")


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("soft_cap", [None, 10.0])
def test_multi_queries_paged_attention_equals_the_reference(use_kernel, soft_cap):
    q, k_pages, v_pages, lengths, page_indices = _paged_inputs(3, 8, 2, 16, 4, 4, torch.float32, query_len=4)
    lengths = torch.tensor([16, 7, 4], dtype=torch.int32)
    q_lens = torch.tensor([4, 2, 4], dtype=torch.int32)  # example 1: 2 real queries, 2 padding
    args = (q, k_pages, v_pages, lengths, page_indices, q_lens)
    got = ck.multi_queries_paged_attention(*(t.to(DEV) for t in args), num_kv_pages_per_compute_block=2,
                                           num_queries_per_compute_block=4, use_kernel=use_kernel,
                                           attn_logits_soft_cap=soft_cap)  # fmt: skip
    want = _ref_multi_query(*args, soft_cap=soft_cap)
    _close(got, want, _attention_bound(torch.float32, q, k_pages, v_pages, 16))


def test_multi_queries_paged_attention_checks_block_sizes_as_the_kernel():
    from xlatorch.experimental.pallas_kernels.multi_queries_paged_attention_kernel import paged_attention

    q, k_pages, v_pages, lengths, page_indices = _paged_inputs(2, 4, 4, 8, 4, 4, torch.float32, query_len=2)
    args = [jnp.asarray(t.numpy()) for t in (q, k_pages, v_pages, lengths, page_indices)]
    with pytest.raises(ValueError, match="num_kv_pages_per_compute_block"):
        paged_attention(
            *args, jnp.ones(2, jnp.int32), num_kv_pages_per_compute_block=3, num_queries_per_compute_block=2
        )
    out = paged_attention(*args, jnp.full(2, 2, jnp.int32), num_kv_pages_per_compute_block=2,
                          num_queries_per_compute_block=2)  # fmt: skip
    assert out.shape == q.shape


def _ragged_inputs(q_lens, kv_lens, q_heads, kv_heads, head_dim, page_size, pages_per_seq, max_seqs, pad_tokens,
                   dtype=torch.float32, seed=1):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tokens = sum(q_lens) + pad_tokens
    total_pages = max_seqs * pages_per_seq + 2
    q = torch.randn(tokens, q_heads, head_dim, generator=g).to(dtype)
    kv_pages = torch.randn(total_pages, page_size, 2 * kv_heads, head_dim, generator=g).to(dtype)
    page_indices = torch.randperm(total_pages, generator=g)[: max_seqs * pages_per_seq].reshape(max_seqs, -1)
    cu = torch.zeros(max_seqs + 1, dtype=torch.int32)
    cu[1 : len(q_lens) + 1] = torch.tensor(q_lens).cumsum(0)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    kv = torch.zeros(max_seqs, dtype=torch.int32)
    kv[: len(kv_lens)] = torch.tensor(kv_lens)
    return q, kv_pages, kv, page_indices.int(), cu, torch.tensor([len(q_lens)], dtype=torch.int32)


def _ref_ragged(q, kv_pages, kv_lens, page_indices, cu, num_seqs, sm_scale=1.0, sliding_window=None, soft_cap=None,
                k_scale=None, v_scale=None):  # fmt: skip
    outs = []
    for s in range(int(num_seqs[0])):
        q_len, n = int(cu[s + 1] - cu[s]), int(kv_lens[s])
        x = kv_pages[page_indices[s]].reshape(-1, *kv_pages.shape[2:])[:n]
        k, v = x[:, 0::2].float(), x[:, 1::2].float()
        if k_scale is not None:
            k = (k * k_scale).to(q.dtype)
        if v_scale is not None:
            v = (v * v_scale).to(q.dtype)
        i, j = torch.arange(q_len)[:, None], torch.arange(n)[None]
        keep = j <= i + n - q_len
        if sliding_window is not None:
            keep &= j > i + n - q_len - sliding_window
        outs.append(_ref_attend(q[cu[s] : cu[s + 1]], k, v, keep, sm_scale=sm_scale, soft_cap=soft_cap))
    return torch.cat(outs)


RAGGED_CASES = [  # q_lens, kv_lens: decode (q_len 1), prefill (q_len == kv_len), chunked prefill
    ([1, 1, 1], [5, 16, 9]),
    ([7, 1, 3, 16], [7, 11, 20, 16]),
]


@pytest.mark.parametrize("q_lens,kv_lens", RAGGED_CASES)
@pytest.mark.parametrize("options", [{}, {"sm_scale": 0.25, "soft_cap": 8.0}, {"sliding_window": 4}])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_ragged_paged_attention_equals_the_reference(q_lens, kv_lens, options, use_kernel):
    args = _ragged_inputs(q_lens, kv_lens, 4, 2, 16, 4, 5, max_seqs=6, pad_tokens=3)
    got = ck.ragged_paged_attention(*(t.to(DEV) for t in args), use_kernel=use_kernel, **options)
    want = _ref_ragged(*args, **options)
    rows = sum(q_lens)
    assert got.shape[0] == (args[0].shape[0] if use_kernel else rows)
    tol = _attention_bound(torch.float32, args[0], args[1], args[1], max(kv_lens), options.get("sm_scale", 1.0))
    _close(got[:rows], want, tol)
    if use_kernel:
        assert float(got[rows:].abs().max()) == 0.0  # the padding rows


def test_ragged_paged_attention_with_scaled_fp8_like_cache_and_bfloat16():
    args = list(_ragged_inputs([3, 1], [6, 9], 4, 2, 16, 4, 3, max_seqs=2, pad_tokens=0, dtype=torch.bfloat16))
    got = ck.ragged_paged_attention(*(t.to(DEV) for t in args), k_scale=0.5, v_scale=2.0)
    want = _ref_ragged(*args, k_scale=0.5, v_scale=2.0)
    _close(got, want, _attention_bound(torch.bfloat16, args[0], args[1] * 0.5, args[1] * 2.0, 9))


def test_ragged_paged_attention_reference_path_checks_its_inputs():
    args = list(_ragged_inputs([3, 1], [2, 9], 4, 2, 16, 4, 3, max_seqs=2, pad_tokens=0))
    with pytest.raises(ValueError, match="q_len"):
        ck.ragged_paged_attention(*(t.to(DEV) for t in args), use_kernel=False)


def test_ragged_paged_attention_kernel_module_checkifies():
    q, kv_pages, kv_lens, page_indices, cu, num_seqs = _ragged_inputs([7, 1, 3], [7, 11, 20], 4, 2, 16, 4, 5, 3, 2)
    # The module's layout: separate caches [kv_heads, pages, page_size, d].
    k_pages = kv_pages[:, :, 0::2].permute(2, 0, 1, 3).contiguous()
    v_pages = kv_pages[:, :, 1::2].permute(2, 0, 1, 3).contiguous()
    j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    err, out = rpa.ragged_paged_attention(j(q), j(k_pages), j(v_pages), j(kv_lens), j(page_indices), j(cu), 3,
                                          sm_scale=0.5)  # fmt: skip
    err.throw()
    want = _ref_ragged(q, kv_pages, kv_lens, page_indices, cu, num_seqs, sm_scale=0.5)
    _close(torch.from_numpy(np.array(out))[:11], want, _attention_bound(torch.float32, q, k_pages, v_pages, 20))
    bad = kv_lens.clone()
    bad[0] = 2  # q_len 7 > kv_len 2
    err, _ = rpa.ragged_paged_attention(j(q), j(k_pages), j(v_pages), j(bad), j(page_indices), j(cu), 3)
    with pytest.raises(ValueError, match="cur_q_len must be less or equal to cur_kv_len"):
        err.throw()


# --- quantized matmul ----------------------------------------------------------------------


def _ref_quantized(x, w, scalar, quantize_activation):
    if not quantize_activation:
        return (x.float() @ w.float().T) * scalar.float()
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127
    x_int = torch.clamp(torch.round(x.float() / scale), -128, 127)
    return (x_int.double() @ w.double().T).float() * scalar.float() * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize_activation", [False, True])
@pytest.mark.parametrize("blocks", [(None, None, None), (8, 32, 128)])
def test_quantized_matmul_int8_equals_dequantize_then_matmul(dtype, quantize_activation, blocks):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 300, generator=g).to(dtype)
    w = torch.randint(-128, 128, (70, 300), generator=g, dtype=torch.int8)
    scalar = torch.rand(70, generator=g) / 128
    sizes = dict(zip(("batch_block_size", "out_block_size", "in_block_size"), blocks))
    got = ck.quantized_matmul_int8(
        x.to(DEV), w.to(DEV), scalar.to(DEV), quantize_activation=quantize_activation, **sizes
    )
    assert got.dtype == dtype and got.shape == (20, 70)
    want = _ref_quantized(x, w, scalar, quantize_activation)
    terms = float((x.float().abs() @ w.float().abs().T * scalar).max())  # the largest sum of |terms|
    # int8 x int8 sums are exact in int32; only the scaling rounds. Float sums round per term.
    tol = _bound(dtype, 4 if quantize_activation else 300, terms)
    _close(got, want, tol)


def test_quantized_matmul_int8_uses_a_tuned_entry(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 256, generator=g), torch.randint(-128, 128, (128, 256), generator=g, dtype=torch.int8)
    scalar = torch.rand(128, generator=g) / 128
    key = (qmk.get_tpu_version(), 16, 128, 256, "float32", True)
    monkeypatch.setitem(qmk.TUNED_BLOCK_SIZES, key, (8, 64, 128))
    assert qmk.get_tuned_block_sizes(qmk.TUNED_BLOCK_SIZES, 16, 128, 256, "float32", True) == (8, 64, 128)
    got = ck.quantized_matmul_int8(x.to(DEV), w.to(DEV), scalar.to(DEV), quantize_activation=True)
    want = _ref_quantized(x, w, scalar, True)
    _close(got, want, _bound(torch.float32, 4, float((x.abs() @ w.float().abs().T * scalar).max())))


def test_quantized_matmul_int8_refuses_zero_points():
    x, w, s = torch.randn(2, 4), torch.ones(3, 4, dtype=torch.int8), torch.ones(3)
    with pytest.raises(NotImplementedError, match="zero_point"):
        qmk.quantized_matmul_int8(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), jnp.asarray(s.numpy()),
                                  zero_point=jnp.zeros(3))  # fmt: skip


# --- grouped matmuls -----------------------------------------------------------------------


def _groups(sizes):
    ends = np.cumsum(sizes)
    return [(int(e - s), int(e)) for s, e in zip(sizes, ends)]


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_and_tgmm_equal_loops_over_groups_with_gradients(transpose_rhs):
    g = torch.Generator().manual_seed(6)
    sizes = [3, 0, 6, 2]
    lhs, rhs = torch.randn(11, 5, generator=g), torch.randn(4, 5, 7, generator=g)
    rhs_in = rhs.transpose(1, 2).contiguous() if transpose_rhs else rhs
    want_l, want_r = lhs.clone().requires_grad_(), rhs_in.clone().requires_grad_()
    r = want_r.transpose(1, 2) if transpose_rhs else want_r
    want = torch.cat([want_l[a:b] @ r[i] for i, (a, b) in enumerate(_groups(sizes))])
    want.pow(2).sum().backward()
    got_l, got_r = lhs.to(DEV).requires_grad_(), rhs_in.to(DEV).requires_grad_()
    got = ck.gmm(got_l, got_r, torch.tensor(sizes, dtype=torch.int32).to(DEV), transpose_rhs=transpose_rhs)
    got.pow(2).sum().backward()
    tol = _bound(torch.float32, 11 * 7, float(want.detach().abs().max()) ** 2)
    _close(got, want, _bound(torch.float32, 5, float(want.abs().max())))
    _close(got_l.grad, want_l.grad, tol)
    _close(got_r.grad, want_r.grad, tol)


def test_tgmm_equals_per_group_outer_products_with_gradients():
    g = torch.Generator().manual_seed(7)
    sizes = [2, 4, 0, 3]
    lhs, rhs = torch.randn(5, 9, generator=g), torch.randn(9, 6, generator=g)
    want_l, want_r = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    want = torch.stack([want_l[:, a:b] @ want_r[a:b] for a, b in _groups(sizes)])
    want.pow(2).sum().backward()
    got_l, got_r = lhs.to(DEV).requires_grad_(), rhs.to(DEV).requires_grad_()
    got = ck.tgmm(got_l, got_r, torch.tensor(sizes, dtype=torch.int32).to(DEV))
    got.pow(2).sum().backward()
    assert got.shape == (4, 5, 6)
    scale = float(want.abs().max())
    _close(got, want, _bound(torch.float32, 9, scale))
    _close(got_l.grad, want_l.grad, _bound(torch.float32, 9 * 6, scale * float(rhs.abs().max())))
    _close(got_r.grad, want_r.grad, _bound(torch.float32, 9 * 5, scale * float(lhs.abs().max())))


def test_grouped_matmuls_on_a_shard_of_the_groups():
    g = torch.Generator().manual_seed(8)
    sizes = torch.tensor([2, 3, 1, 4], dtype=torch.int32)
    lhs, rhs = torch.randn(10, 4, generator=g), torch.randn(2, 4, 3, generator=g)  # groups 1 and 2 only
    offset = torch.tensor(1, dtype=torch.int32)
    got = ck.gmm(lhs.to(DEV), rhs.to(DEV), sizes.to(DEV), group_offset=offset.to(DEV))
    want = torch.zeros(10, 3)
    want[2:5], want[5:6] = lhs[2:5] @ rhs[0], lhs[5:6] @ rhs[1]
    _close(got, want, _bound(torch.float32, 4, float(want.abs().max())))
    lt, r2 = torch.randn(4, 10, generator=g), torch.randn(10, 3, generator=g)
    got = ck.tgmm(lt.to(DEV), r2.to(DEV), sizes.to(DEV), group_offset=offset.to(DEV), num_actual_groups=2)
    want = torch.stack([lt[:, 2:5] @ r2[2:5], lt[:, 5:6] @ r2[5:6]])
    _close(got, want, _bound(torch.float32, 3, float(want.abs().max())))


def test_gmm_autograd_function_uses_gmm_backward():
    g = torch.Generator().manual_seed(9)
    sizes = [4, 2]
    lhs, rhs = torch.randn(6, 3, generator=g), torch.randn(2, 3, 5, generator=g)
    want_l, want_r = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    torch.cat([want_l[a:b] @ want_r[i] for i, (a, b) in enumerate(_groups(sizes))]).sum().backward()
    got_l, got_r = lhs.to(DEV).requires_grad_(), rhs.to(DEV).requires_grad_()
    ck.GMM.apply(got_l, got_r, torch.tensor(sizes, dtype=torch.int32).to(DEV)).sum().backward()
    _close(got_l.grad, want_l.grad, _bound(torch.float32, 5, float(rhs.abs().max()) * 5))
    _close(got_r.grad, want_r.grad, _bound(torch.float32, 6, float(lhs.abs().max()) * 6))


# --- repeat_with_fixed_output_size ---------------------------------------------------------


@pytest.mark.parametrize(
    "repeats,total",
    [([0, 1, 2, 0, 4, 0, 6, 7, 8, 9], 20), ([1, 2, 3], 6), ([1, 1, 0], 5), ([0, 2, 1], 2), ([3, 0, 2], 9)],
)
def test_repeat_with_fixed_output_size_equals_repeat_interleave_cut_or_padded(repeats, total):
    x = torch.arange(len(repeats), dtype=torch.float32) * 10
    r = torch.tensor(repeats)
    full = torch.repeat_interleave(x, r)
    # Padding repeats the element whose run starts last before the end.
    starts = torch.cumsum(r, 0) - r
    last = x[int((starts < total).nonzero().max())]
    want = torch.cat([full, last.repeat(max(0, total - len(full)))])[:total]
    xd = x.to(DEV).requires_grad_()
    got = ck.repeat_with_fixed_output_size(xd, r.to(DEV), total)
    assert torch.equal(got.detach().cpu(), want)
    got.sum().backward()
    counts = torch.bincount(torch.searchsorted(starts, torch.arange(total), right=True) - 1, minlength=len(x))
    assert torch.equal(xd.grad.cpu(), counts.float())


# --- trace_pallas --------------------------------------------------------------------------


def test_trace_pallas_lowers_without_running_and_caches():
    from jax.experimental import pallas as pl

    def add_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    def add(x, y, *, scale):
        return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(
            x, y * scale
        )

    x = torch.randn(8, 128, device=DEV)
    before = met.counter_value("trace_pallas_cache_hit") or 0
    payload, tensors = ck.trace_pallas(add, x, x, scale=2.0, static_argnames=["scale"], use_cache=True)
    assert isinstance(payload, str) and "func.func" in payload and tensors[0] is x and len(tensors) == 2
    again, _ = ck.trace_pallas(add, x, x, scale=2.0, static_argnames=["scale"], use_cache=True)
    assert again is payload and met.counter_value("trace_pallas_cache_hit") == before + 1
    assert ck.convert_torch_dtype_to_jax(torch.bfloat16) == jnp.bfloat16
    assert ck.to_jax_shape_dtype_struct(x) == jax.ShapeDtypeStruct((8, 128), jnp.float32)


# --- splash attention ----------------------------------------------------------------------


def _ref_splash(q, k, v, seg, causal, window, soft_cap):
    s = q @ k.transpose(-1, -2)
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None]
    keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window) & (j <= i + window)
    keep = keep[None, None]
    if seg is not None:
        keep = keep & (seg[:, None, :, None] == seg[:, None, None, :])
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(
    "causal,segments,window,soft_cap", [(True, False, None, None), (False, True, None, 4.0), (True, True, 3, None)]
)
def test_splash_attention_equals_masked_softmax_attention_with_gradients(causal, segments, window, soft_cap):
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g) for _ in range(3))
    seg = torch.tensor([[0] * 5 + [1] * 7, [0] * 12]) if segments else None
    config = SplashAttentionConfig(attentiontype_local_sliding=window is not None, slide_window_size=window)
    want_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _ref_splash(*want_in, seg, causal, window, soft_cap)
    want.pow(2).sum().backward()
    got_in = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    got = splash_attention(*got_in, config.to_json(), None if seg is None else seg.to(DEV), causal, soft_cap)
    got.pow(2).sum().backward()
    scale = float(v.abs().max())
    tol = _attention_bound(torch.float32, q, k, v, 12)
    _close(got, want, tol)
    for a, b in zip(got_in, want_in):
        _close(a.grad, b.grad, tol * 12 * max(1.0, scale) * float(q.abs().max() * k.abs().max()))


def test_splash_attention_config_round_trips_through_json():
    config = SplashAttentionConfig(sa_block_q=512, mesh="mesh", qkv_partition_spec=(("data", "fsdp"), None, "x", None))
    assert SplashAttentionConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="slide_window_size"):
        q = torch.zeros(1, 1, 4, 2, device=DEV)
        splash_attention(q, q, q, SplashAttentionConfig(attentiontype_local_sliding=True).to_json())


# --- the TPU paths, through JAX's TPU interpreter on CPU -----------------------------------


def test_paged_attention_on_tpu_is_jaxs_kernel(monkeypatch):
    from jax.experimental.pallas import tpu as pltpu

    # JAX's kernel loads keys and values as bfloat16: give it values that bfloat16 holds exactly.
    q, k_pages, v_pages, lengths, page_indices = _paged_inputs(3, 8, 2, 128, 16, 4, torch.float32, seed=11)
    k_pages, v_pages = (t.bfloat16().float() for t in (k_pages, v_pages))
    lengths = torch.tensor([5, 64, 33], dtype=torch.int32)
    monkeypatch.setattr(ck, "_on_tpu", lambda: True)
    with pltpu.force_tpu_interpret_mode():
        got = ck.paged_attention(*(t.to(DEV) for t in (q, k_pages, v_pages, lengths, page_indices)), 2,
                                 attn_logits_soft_cap=7.0).cpu()  # fmt: skip
    want = _ref_multi_query(q[:, None], k_pages, v_pages, lengths, page_indices, torch.ones(3), 7.0)[:, 0]
    _close(got, want, _attention_bound(torch.float32, q, k_pages, v_pages, 64))


def test_splash_attention_on_tpu_is_jaxs_splash_kernel():
    from xlatorch.experimental.splash_attention import _reference, _tpu_kernel

    keys = jax.random.split(jax.random.key(12), 3)
    q, k, v = (jax.random.normal(key, (1, 2, 256, 128), jnp.float32) for key in keys)
    seg = jnp.concatenate([jnp.zeros((1, 100), jnp.int32), jnp.ones((1, 156), jnp.int32)], 1)
    config = SplashAttentionConfig(**{f.name: 128 for f in SplashAttentionConfig.__dataclass_fields__.values()
                                      if f.name.startswith("sa_block")})  # fmt: skip
    opts = dict(causal=True, window=16, soft_cap=5.0)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) ** 2).sum()

    kernel = lambda q, k, v: _tpu_kernel(q, k, v, seg, config=config, interpret=True, **opts)  # noqa: E731
    ref = lambda q, k, v: _reference(q, k, v, seg, **opts)  # noqa: E731
    tol = _attention_bound(torch.float32, *(torch.from_numpy(np.array(t)) for t in (q, k, v)), 256)
    _close(torch.from_numpy(np.array(kernel(q, k, v))), torch.from_numpy(np.array(ref(q, k, v))), tol)
    got = jax.grad(loss(kernel), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(ref), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        scale = float(jnp.abs(b).max())
        _close(torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b)), tol * scale)


def test_make_sequence_metadata_lists_each_sequences_tiles():
    # Rows 0-191, 192-447, 448-511 in tiles of 128: a tile shared by two sequences is visited twice.
    cu = jnp.array([0, 192, 448, 512, 512])
    (seq_ids, tiles), n = rpa.make_sequence_metadata(cu_q_lens=cu, m=512, tm=128, start_sequence=jnp.array([0]),
                                                     num_sequences=3)  # fmt: skip
    assert int(n) == 6 and seq_ids.tolist() == [0, 0, 1, 1, 1, 2] and tiles.tolist() == [0, 1, 1, 2, 3, 3]
    (seq_ids, tiles), n = rpa.make_sequence_metadata(cu_q_lens=jnp.array([0, 128, 128, 200, 256]), m=256, tm=128,
                                                     start_sequence=jnp.array([1]), num_sequences=3)  # fmt: skip
    assert int(n) == 2 and seq_ids.tolist()[:2] == [2, 3] and tiles.tolist()[:2] == [1, 1]  # sequence 1 is empty
