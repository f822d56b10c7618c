"""OpInfo conformance: every lowered op against PyTorch eager on CPU, forward and backward.

For each OpInfo in ``op_db`` that exercises an ops.yaml entry (the entry's op name, or
the names in its ``test: opinfo:`` list), the OpInfo's sample inputs run on the xla
device and on CPU and the results are compared with ``torch.testing.assert_close``:
forward for float32, bfloat16, int64 and bool where the OpInfo supports them, the
generated in-place variant for float32, and float32 gradients for differentiable ops.
All samples of one (OpInfo, dtype) are traced into one graph, so each test compiles
once. Tolerances and expected failures come from the entries' ``test:`` fields in
ops.yaml, never from this file.

CI runs a few samples per test; ``--opinfo-full`` (or ``XLATORCH_OPINFO_FULL=1``) runs
all of them. Select ops with ``-k``, e.g. ``pytest tests/test_opinfo.py -k "sort or topk"``.

CI compiles about 1,700 small graphs here, and XLA's compile was most of this file's time
(its CPU backend: ~150 ms a graph, ~80% of ``test_forward`` under cProfile). They compile with
the options xlatorch gives a graph expected to run once (``runtime/lower/compiler.py``: LLVM's
lowest level, XLA's classic fusion emitters), which nearly halves the file's time (the float32
and int64 forward tests: 136 -> 74 s, every one passing both ways). The same HLO runs either
way; XLA's default options are what every other test file compiles with, and what
``--opinfo-full`` uses, as does a run with ``XLATORCH_XLA_OPTIONS`` already set.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import unittest
from collections import defaultdict

import pytest
import torch
from torch.testing._internal import common_utils
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo import core as opinfo_core
from torch.utils._pytree import tree_flatten, tree_map

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from codegen import registry, schema
from codegen.gen import ROOT

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
# Default (atol, rtol) by result dtype: float32 allows XLA's own transcendental
# approximations, bfloat16 about one ulp; integers and bools are exact.
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2),
       torch.float16: (1e-3, 1e-3), torch.complex64: (1e-5, 1e-5), torch.complex128: (1e-5, 1e-5)}  # fmt: skip
GRAD_TOL = (1e-4, 1e-4)
CI_SAMPLES = 4
# CI skips error inputs larger than this (multinomial's 2**24 + 1 categories: 12 s to compile and run)
CI_ERROR_ELEMENTS = 1 << 20


def _extract_test_fn():
    """PyTorch's ``extract_test_fn`` (the running ``unittest`` test method, found on the stack)
    without ``inspect.stack()``: that one reads every frame's source line and searches
    ``sys.modules`` for each frame's module, 12 ms a call under pytest, and ``sample_inputs``
    calls it twice (measured: 60% of ``test_forward``'s time under cProfile). Same answer:
    these pytest functions run in no ``TestCase``, so both give None."""
    frame = sys._getframe(1)
    while frame is not None:
        self_val = frame.f_locals.get("self")
        if isinstance(self_val, unittest.TestCase):
            *_, cls_name, test_name = self_val.id().rsplit(".", 2)
            if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                return getattr(self_val, test_name).__func__
        frame = frame.f_back
    return None


common_utils.extract_test_fn = opinfo_core.extract_test_fn = _extract_test_fn


@functools.lru_cache(maxsize=1)
def _plan():
    """``{opinfo id: (OpInfo, [entries])}`` for every OpInfo that exercises a lowered entry."""
    entries = registry.load(os.path.join(ROOT, "ops.yaml"), schema.load()[0])
    wanted = defaultdict(list)
    for e in entries:
        if e.fallback is not None or e.dispatch == "metadata":
            continue
        for name in {e.schema.op, *(e.test.get("opinfo") or [])}:
            wanted[name].append(e)
    plan = {}
    for op in op_db:
        found = wanted.get(op.name, []) + (wanted.get(op.aten_name, []) if op.aten_name != op.name else [])
        if found:
            key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
            plan[key] = (op, found)
    return plan


def _cases():
    fwd, grad, inplace = [], [], []
    for key, (op, entries) in sorted(_plan().items()):
        if op.inplace_variant is not None and torch.float32 in op.supported_dtypes("cpu"):
            inplace.append(key)
        supported = op.supported_dtypes("cpu")
        only = set().union(*[e.test.get("dtypes") or DTYPES for e in entries])
        fwd += [(key, tag) for tag, dt in DTYPES.items() if dt in supported and tag in only]
        if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu"):
            grad.append(key)
    return fwd, grad, inplace


FWD_CASES, GRAD_CASES, INPLACE_CASES = _cases()
# Writes into a tensor of another dtype: in-place variants on int64 samples, out= int64 for float32 ones
INPLACE_INT_CASES = sorted(
    k for k, (op, _) in _plan().items() if op.inplace_variant is not None and torch.int64 in op.supported_dtypes("cpu")
)
ERROR_CASES = sorted(k for k, (op, _) in _plan().items() if op.error_inputs_func is not None)
OUT_CASES = sorted(
    k for k, (op, _) in _plan().items() if op.supports_out and torch.float32 in op.supported_dtypes("cpu")
)


@pytest.fixture(autouse=True, scope="module")
def _compile_fast(request):
    from xlatorch.runtime.lower import cache, compiler

    own = _full(request.config) or "XLATORCH_XLA_OPTIONS" in os.environ
    fast = None if own else compiler.options(once=True)  # None too where the backend has no such options
    if not fast:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLATORCH_XLA_OPTIONS", ",".join(f"{k}={v}" for k, v in fast.items()))
        yield
    cache.CACHE.clear()  # executables compiled so serve no later test (the key holds no options)


def _full(config) -> bool:
    return config.getoption("--opinfo-full", False) or os.environ.get("XLATORCH_OPINFO_FULL") == "1"


def _hints(entries, tag: str, key: str = ""):
    """(xfail reason or None, atol, rtol) for a test of ``entries`` under dtype/grad ``tag``
    (xfails may name one OpInfo: ``"<OpInfo key>/<tag>"``)."""
    reason = None
    grad = tag == "grad"
    atol, rtol = GRAD_TOL if grad else (0, 0)  # forward: raised to the result dtype's default
    for e in entries:
        x = e.test.get("xfail") or {}
        reason = reason or x.get(f"{key}/{tag}") or x.get(f"{key}/all") or x.get(tag) or x.get("all")
        atol = max(atol, _tol(e.test.get("grad_atol" if grad else "atol", 0), tag))
        rtol = max(rtol, _tol(e.test.get("grad_rtol" if grad else "rtol", 0), tag))
    return reason, atol, rtol


def _tol(t, tag: str) -> float:
    """A tolerance hint: one number, or ``{dtype tag: number}``."""
    return t.get(tag, 0) if isinstance(t, dict) else t


def _result_tol(entries, tag: str):
    """``dtype -> (atol, rtol)`` for the results of a forward or in-place test under ``tag``.

    A floating result takes the floating tolerances of its own dtype (defaults and per-dtype
    hints), whatever the sample's dtype: ``cos(int64)`` gives float32 and ``inplace`` tests run
    float32 samples, and neither is compared exactly or without its float32 hints.
    """

    def tol(dtype):
        key = tag
        if dtype.is_floating_point:
            key = next((t for t, d in DTYPES.items() if d == dtype), "float32")
        _, atol, rtol = _hints(entries, key)
        da, dr = TOL.get(dtype, (0, 0))
        return max(atol, da), max(rtol, dr)

    return tol


def _setup(key, tag, request):
    """(OpInfo, entries, atol, rtol), marking the test as an expected failure if ops.yaml says so."""
    op, entries = _plan()[key]
    reason, atol, rtol = _hints(entries, tag, key)
    if reason:
        # Strict when every sample runs; CI's few samples may miss the failing one.
        request.applymarker(pytest.mark.xfail(reason=reason, strict=_full(request.config)))
    return op, entries, atol, rtol


def _to_xla(x, moved=None):
    """A sample's tensor on the device; a view (the OpInfos' non-contiguous samples) stays a
    view with CPU's layout: its base moved, and ``as_strided`` of it. ``moved`` (CPU tensor's
    id -> its device copy) keeps tensors that share memory on CPU sharing it on the device
    (an error input's out= that is its input)."""
    if isinstance(x, torch.Tensor):
        moved = {} if moved is None else moved
        base = x._base
        plain = not (x.is_conj() or x.is_neg())
        if base is not None and base.dtype == x.dtype and base.layout == torch.strided and plain:
            if id(base) not in moved:
                moved[id(base)] = (base, base.detach().to("xla"))
            with torch.no_grad():
                t = moved[id(base)][1].as_strided(x.shape, x.stride(), x.storage_offset())
        elif id(x) in moved:
            return moved[id(x)][1]
        else:
            t = x.detach().to("xla")
            moved[id(x)] = (x, t)  # keeps x alive: its id is not reused while the sample moves
        return t.requires_grad_() if x.requires_grad else t
    return x


class _Moved:
    """A sample's input, args and kwargs with every tensor moved to the xla device."""

    def __init__(self, s):
        moved: dict = {}
        self.input, self.args, self.kwargs = tree_map(lambda x: _to_xla(x, moved), (s.input, s.args, s.kwargs))
        if "device" in self.kwargs:  # factories: made on the device
            self.kwargs = dict(self.kwargs, device="xla")
        # A factory sample that names no device (torch.linspace(1, 3, 1)) makes its result on
        # the default device: the xla device here, CPU for the reference.
        self.default_xla = "device" not in self.kwargs and not any(
            isinstance(t, torch.Tensor) for t in tree_flatten((self.input, self.args, self.kwargs))[0]
        )


def _samples(op, dtype, requires_grad, full):
    out = []
    for s in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
        out.append(s)
        if not full and len(out) >= CI_SAMPLES:
            break
    return out


def _call(op, s):
    with torch.device("xla") if getattr(s, "default_xla", False) else contextlib.nullcontext():
        return op(s.input, *s.args, **s.kwargs)


def _meta_compare(entries) -> bool:
    """Random ops and uninitialised memory: compare shapes and dtypes, not values."""
    return any(e.random or e.test.get("compare") == "meta" for e in entries)


def _compare(got, want, tol, where):
    g, _ = tree_flatten(got)
    w, _ = tree_flatten(want)
    assert len(g) == len(w), f"{where}: {len(g)} outputs on xla, {len(w)} on CPU"
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.device.type == "xla", f"{where}: output not an xla tensor: {a!r}"
            atol, rtol = tol(b.dtype)
            if a._is_view():
                # Moved to the host, a view is its chain replayed there on its base; in an op it is
                # computed on the device: compare that too, and its layout (a view's is CPU's).
                if b._is_view():
                    assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset()), where
                torch.testing.assert_close(a.clone().cpu(), b, atol=atol, rtol=rtol, equal_nan=True,
                                           msg=lambda m: f"{where} (computed on the device): {m}")  # fmt: skip
            torch.testing.assert_close(a.cpu(), b, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m: f"{where}: {m}")  # fmt: skip
        else:
            assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def _check(entries, got, want, tol, where):
    if _meta_compare(entries):
        _meta_only(got, want, where)
    else:
        _compare(got, want, tol, where)


def _meta_only(got, want, where):
    g, _ = tree_flatten(got)
    w, _ = tree_flatten(want)
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), f"{where}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"


@functools.cache
def _fallbacks(key: str, full: bool) -> dict:
    """Fallback counters after running the OpInfo's float32 (or first supported) samples."""
    op, _ = _plan()[key]
    supported = op.supported_dtypes("cpu")
    if not supported:
        return {}
    dtype = torch.float32 if torch.float32 in supported else next(iter(supported))
    xm.mark_step()
    met.clear_counters()
    for s in _samples(op, dtype, False, full):
        try:
            _call(op, _Moved(s))
        except Exception:
            pass  # errors are the forward test's business
    xm.mark_step()
    return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}


@pytest.mark.parametrize("key, tag", FWD_CASES, ids=[f"{k}-{t}" for k, t in FWD_CASES])
def test_forward(key, tag, request):
    op, entries, _, _ = _setup(key, tag, request)
    tol = _result_tol(entries, tag)
    pending, errors = [], []
    for i, s in enumerate(_samples(op, DTYPES[tag], False, _full(request.config))):
        try:
            want = _call(op, s)
        except Exception:
            continue  # not a valid sample on CPU either
        try:
            got = _call(op, _Moved(s))
        except Exception as e:
            errors.append(f"sample {i} ({s.summary() if hasattr(s, 'summary') else s}): {type(e).__name__}: {e}")
            continue
        pending.append((i, s, got, want))
    xm.mark_step()
    assert not errors, "\n".join(errors)
    for i, s, got, want in pending:
        where = f"{key} {tag} sample {i}: input {tuple(s.input.shape) if isinstance(s.input, torch.Tensor) else ''}"
        _check(entries, got, want, tol, where)


@pytest.mark.parametrize("key", GRAD_CASES)
def test_grad(key, request):
    op, entries, atol, rtol = _setup(key, "grad", request)
    if _meta_compare(entries):
        pytest.skip("random op: gradients depend on the sampled values")
    gen = torch.Generator().manual_seed(0)
    pending = []
    for i, s in enumerate(_samples(op, torch.float32, True, _full(request.config))):
        leaves = [t for t in tree_flatten((s.input, s.args, s.kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
        if not leaves:
            continue
        try:
            outs = [o for o in tree_flatten(_call(op, s))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if not outs:
                continue
            cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
            want = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
        except Exception:
            continue
        xs = _Moved(s)
        xleaves = [t for t in tree_flatten((xs.input, xs.args, xs.kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
        xouts = [o for o in tree_flatten(_call(op, xs))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        got = torch.autograd.grad(xouts, xleaves, [c.to("xla") for c in cots], allow_unused=True)
        pending.append((i, got, want))
    xm.mark_step()
    for i, got, want in pending:
        for j, (g, w) in enumerate(zip(got, want)):
            if w is None:
                continue
            assert g is not None, f"{key} sample {i}: gradient {j} is None on xla"
            torch.testing.assert_close(g.cpu(), w, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m, i=i, j=j: f"{key} sample {i} grad {j}: {m}")  # fmt: skip


@pytest.mark.parametrize("key", INPLACE_CASES)
def test_inplace(key, request):
    """The generated in-place variant (``op_``) writes the forward's result into ``self``."""
    op, entries, _, _ = _setup(key, "inplace", request)
    tol = _result_tol(entries, "inplace")
    pending = []
    for i, s in enumerate(_samples(op, torch.float32, False, _full(request.config))):
        if not isinstance(s.input, torch.Tensor):
            continue
        cpu = s.input.clone()
        try:
            want = op.inplace_variant(cpu, *s.args, **s.kwargs)
        except Exception as e:  # e.g. the result would not fit self's shape: the device refuses it too
            _refuses(lambda s=s: op.inplace_variant(_Moved(s).input.clone(), *_Moved(s).args, **_Moved(s).kwargs),
                     e, f"{key} in-place sample {i}")  # fmt: skip
            continue
        xs = _Moved(s)
        xs.input = xs.input.clone()  # as the reference: not a view, whose storage as_strided would index
        got = op.inplace_variant(xs.input, *xs.args, **xs.kwargs)
        assert got is xs.input, f"{key} sample {i}: in-place op did not return self"
        pending.append((i, got, want))
    xm.mark_step()
    for i, got, want in pending:
        _check(entries, got, want, tol, f"{key} in-place sample {i}")


def _refuses(call, cpu_error, where) -> None:
    """``call`` on the device raises, as its CPU twin raised ``cpu_error``: a program CPU refuses
    never computes something on the device (nothing is synced: no graph is compiled)."""
    try:
        call()
    except Exception:
        return
    raise AssertionError(f"{where}: CPU raised {type(cpu_error).__name__}: {cpu_error}; the xla device did not")


@pytest.mark.parametrize("key", INPLACE_INT_CASES)
def test_inplace_int64_refuses_what_cpu_refuses(key, request):
    """An in-place op on int64 samples: where CPU raises (``sqrt_`` would write floats into
    integers; ``eq_`` would broadcast ``self``), the device raises too, instead of writing
    converted values or a value of another shape (``int32.mul_(float32)`` and ``a.eq_(b)``
    with ``a`` of [5, 1] and ``b`` of [5, 5] did). Where CPU accepts, the device must too (its
    values are the forward and in-place tests' business: nothing is synced here)."""
    op, _, _, _ = _setup(key, "inplace", request)
    for i, s in enumerate(_samples(op, torch.int64, False, _full(request.config))):
        if not isinstance(s.input, torch.Tensor):
            continue
        try:
            op.inplace_variant(s.input.clone(), *s.args, **s.kwargs)
        except Exception as e:
            _refuses(lambda s=s: op.inplace_variant(_Moved(s).input.clone(), *_Moved(s).args, **_Moved(s).kwargs),
                     e, f"{key} int64 in-place sample {i}")  # fmt: skip
        else:
            xs = _Moved(s)
            op.inplace_variant(xs.input.clone(), *xs.args, **xs.kwargs)


@pytest.mark.parametrize("key", OUT_CASES)
def test_out_of_another_dtype_refuses_what_cpu_refuses(key, request):
    """``out=`` an int64 tensor for a float32 result: where CPU raises (``add`` would cast
    unsafely; ``mm`` and ``abs`` want the result's own dtype) the device raises too, instead of
    writing truncated values (``torch.abs(x, out=int_tensor)`` did); where CPU accepts
    (``eq``'s bools, ``bernoulli``), the device must too."""
    op, _, _, _ = _setup(key, "out", request)
    for i, s in enumerate(_samples(op, torch.float32, False, _full(request.config))):
        try:
            want = op(s.input, *s.args, **s.kwargs)
        except Exception:
            continue
        if not isinstance(want, torch.Tensor):
            continue
        try:
            op(s.input, *s.args, **s.kwargs, out=torch.empty(want.shape, dtype=torch.int64))
        except Exception as e:
            _refuses(lambda s=s, w=want: _call_out(op, _Moved(s), w), e, f"{key} out=int64 sample {i}")
        else:
            _call_out(op, _Moved(s), want)


# CPU's messages the device does not give word for word (the exception's type it does give).
_OWN_WORDS = {
    # PyTorch's argument parser names the Python type it got: XlaTensor (a subclass) for Tensor.
    "received an invalid combination of arguments": "the argument parser names XlaTensor",
    # masked_fill's value as a device tensor: PyTorch's reference refuses its dtype, not its value.
    "cannot be converted to type int64_t without overflow": "the value is on the device",
}


@pytest.mark.parametrize("key", ERROR_CASES)
def test_error_inputs_raise_as_on_cpu(key, request):
    """The OpInfo's error inputs (arguments CPU refuses: a wrong dtype, shape or dimension, an
    out= overlapping an input): each that raises on CPU raises on the device too, when the op
    is called or when its result is read (an out-of-range index is checked on the device), with
    CPU's exception type and message (where a meta kernel words it otherwise, CPU's kernel is
    asked: ``nodes.error_on_cpu``)."""
    op, _, _, _ = _setup(key, "errors", request)
    missed = []
    full = _full(request.config)
    for i, e in enumerate(op.error_inputs("cpu")):
        s = e.sample_input
        if not full and _elements(s) > CI_ERROR_ELEMENTS:
            continue
        try:
            op(s.input, *s.args, **s.kwargs)
            continue  # CPU takes it (an error input of another device)
        except Exception as cpu_error:  # noqa: BLE001 - any error CPU raises
            error = cpu_error
        cpu = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        try:
            xs = _Moved(s)
            tensors = [t for t in tree_flatten(op(xs.input, *xs.args, **xs.kwargs))[0] if isinstance(t, torch.Tensor)]
            for t in tensors:
                t.cpu()
        except Exception as device_error:  # noqa: BLE001 - refused, as on CPU: in CPU's words?
            words = cpu.split(": ", 1)[1] in str(device_error) or any(w in cpu for w in _OWN_WORDS)
            if not isinstance(device_error, type(error)) or not words:
                missed.append(f"error input {i}: CPU raised {cpu[:200]}; the device {type(device_error).__name__}: "
                              f"{str(device_error)[:200]}")  # fmt: skip
            continue
        missed.append(f"error input {i}: CPU raised {cpu[:200]}; the device did not")
    assert not missed, "\n".join(missed)


# Dtypes CPU's kernels often lack: integers and bools for float math, complex for comparisons and
# sorting. Not float16 / bfloat16: where CPU has no kernel (avg_pool3d, cdist, cholesky), the
# device computes what an accelerator gives (in float32, rounded once), as torch_xla does.
UNSUPPORTED = (torch.int64, torch.bool, torch.complex64)
UNSUPPORTED_CASES = sorted(k for k, (op, _) in _plan().items() if set(UNSUPPORTED) - set(op.supported_dtypes("cpu")))


@pytest.mark.parametrize("key", UNSUPPORTED_CASES)
def test_a_dtype_cpu_has_no_kernel_for_raises_on_the_device(key, request):
    """Samples in a dtype the OpInfo says CPU does not support (``softmax`` of integers, ``abs``
    of bools, ``maximum`` of complex numbers): where CPU raises, the device raises too, at the
    call (ops.yaml ``refuse_dtypes``), instead of computing a value CPU never gives (``gelu`` of
    an int64 tensor gave int64 values). Nothing is synced where the device refuses. Where CPU
    computes the sample after all (its kernel depends on the arguments: an undilated
    convolution of int32; or it runs none: an empty result), the device does not refuse it."""
    op, _, _, _ = _setup(key, "unsupported", request)
    missed = []
    for dtype in UNSUPPORTED:
        if dtype in op.supported_dtypes("cpu"):
            continue
        try:
            samples = _samples(op, dtype, False, _full(request.config))[: None if _full(request.config) else 1]
        except Exception:  # noqa: BLE001, S112 - the OpInfo makes no samples of this dtype
            continue
        for i, s in enumerate(samples):
            try:
                _call(op, s)
            except Exception as cpu_error:  # noqa: BLE001 - any error CPU raises
                error = cpu_error
            else:  # CPU takes it (an empty result, a 0-d input, arguments its kernel has): so does the device
                try:
                    _call(op, _Moved(s))
                except Exception as e:  # noqa: BLE001 - a refusal CPU does not make
                    missed.append(f"{dtype} sample {i}: CPU computes it, the device raised {type(e).__name__}: {e}")
                continue
            try:
                xs = _Moved(s)
                for t in tree_flatten(_call(op, xs))[0]:
                    if isinstance(t, torch.Tensor):
                        t.cpu()
            except Exception:  # noqa: BLE001, S112 - refused, as on CPU
                continue
            missed.append(f"{dtype} sample {i}: CPU raised {type(error).__name__}: {str(error)[:200]}")
    assert not missed, "\n".join(missed)


def _elements(s) -> int:
    return sum(t.numel() for t in tree_flatten((s.input, s.args, s.kwargs))[0] if isinstance(t, torch.Tensor))


def _call_out(op, xs, want):
    return op(xs.input, *xs.args, **xs.kwargs, out=torch.empty(want.shape, dtype=torch.int64, device="xla"))


@pytest.mark.parametrize("key", sorted(_plan()))
def test_no_fallback(key, request):
    """The OpInfo's own lowered ops never fall back to CPU on its samples."""
    _, entries = _plan()[key]
    if any(e.test.get("xfail", {}).get("all") for e in entries):
        pytest.skip("expected to fail entirely")
    counts = _fallbacks(key, _full(request.config))
    own = {f"aten::{e.schema.op}" for e in entries}
    fell = {n: c for n, c in counts.items() if n in own}
    assert not fell, f"{key}: lowered ops fell back to CPU: {fell} (all fallbacks: {counts})"
