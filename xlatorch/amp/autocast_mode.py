"""Autocast on the device: ``torch.autocast("xla")`` and ``xlatorch.amp.autocast``.

Autocast works as PyTorch's own for CPU and CUDA: a kernel on the device's autocast
dispatch key (``AutocastPrivateUse1``, the ``xla`` device being PrivateUse1 renamed) for
each op of ``policy.POLICY`` casts the op's device tensor arguments and calls the op again
with that key excluded, so autograd and the lazy tracer below see ordinary ops on already
cast tensors (the casts are ``_to_copy`` nodes in the graph, differentiable as any other).
Every other op falls through the key unchanged. Nothing here syncs or transfers.
"""

from __future__ import annotations

import weakref

import torch

from xlatorch.amp.policy import FP32, LOW, POLICY
from xlatorch.runtime.base import record

__all__ = ["autocast", "install", "DEFAULT_DTYPE", "SUPPORTED_DTYPES"]

DEFAULT_DTYPE = torch.bfloat16  # as torch_xla on TPU; float16 needs a GradScaler
SUPPORTED_DTYPES = [torch.bfloat16, torch.float16]
_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_EXCLUDE = torch._C.DispatchKeySet(_KEY)
_LOW_FLOATS = (torch.float16, torch.bfloat16)
_LIBS: list = []  # the registrations live as long as the process

# The cast of a float32 leaf that requires grad (a weight) is made once per step and reused by
# later ops (PyTorch caches the same casts per autocast region). Keyed by id() of the weight; an
# entry is valid while the weight object is alive and unchanged (its _version), so a reused id
# or an optimizer step in between never hits a stale cast. Emptied at every mark_step (and when
# xlatorch.amp.autocast exits) so that casts do not outlive their step.
_CACHE: dict[int, tuple] = {}


def _device_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla" and t.dtype.is_floating_point


def _cast(t, dtype: torch.dtype):
    if not _device_float(t) or t.dtype == dtype or t.dtype == torch.float64:
        return t
    # Not under no_grad: a cast made there has no grad_fn, and reusing it later would cut the
    # weight out of the backward pass.
    cacheable = (dtype in _LOW_FLOATS and t.is_leaf and t.requires_grad and torch.is_grad_enabled()
                 and torch.is_autocast_cache_enabled())  # fmt: skip
    if cacheable:
        hit = _CACHE.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2].dtype == dtype:
            return hit[2]
    out = t.to(dtype)
    if cacheable:
        _CACHE[id(t)] = (weakref.ref(t), t._version, out)
    return out


def clear_cache() -> None:
    """Drop the kept casts of weights (called after every ``mark_step`` and when ``autocast`` exits)."""
    _CACHE.clear()


def _map(args, fn):
    """``fn`` applied to every tensor of ``args`` (lists of tensors included)."""
    return [
        fn(a) if isinstance(a, torch.Tensor) else [fn(x) for x in a] if isinstance(a, (list, tuple)) and a and
        all(isinstance(x, torch.Tensor) for x in a) else a for a in args
    ]  # fmt: skip


def _widest(args) -> torch.dtype:
    """The widest floating dtype among the device tensors in ``args``, starting from the autocast dtype."""
    dt = torch.get_autocast_dtype("xla")
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if _device_float(t) and t.dtype != torch.float64:
                dt = torch.promote_types(dt, t.dtype)
    return dt


def _kernel(op: torch._ops.OpOverload, cls: str):
    """The autocast kernel of ``op`` under cast class ``cls`` (``policy.LOW``/``FP32``/``PROMOTE``)."""

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if cls is LOW:
                dtype = torch.get_autocast_dtype("xla")
            elif cls is FP32:
                dtype = torch.float32
            else:
                dtype = _widest(list(args) + list(kwargs.values()))
            fn = (lambda t: _cast(t, dtype)) if cls is not FP32 else (
                lambda t: _cast(t, dtype) if _device_float(t) and t.dtype in _LOW_FLOATS else t)  # fmt: skip
            args = _map(args, fn)
            kwargs = dict(zip(kwargs, _map(kwargs.values(), fn)))
            return op(*args, **kwargs)

    kernel.__name__ = f"autocast_{cls}_{op.__name__}"
    return kernel


def _overload(name: str) -> torch._ops.OpOverload:
    op, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), ov or "default")


def install() -> None:
    """Register the device's autocast kernels (once per process; ``import xlatorch`` calls it).

    Every op of ``policy.POLICY`` gets a casting kernel on ``AutocastPrivateUse1``; every other
    op falls through that key (PyTorch registers no fallthrough for it). The calling thread's
    default autocast dtype for the device becomes bfloat16 (autocast state is per thread in
    PyTorch: other threads keep PyTorch's float16 unless they pass ``dtype``).
    """
    if _LIBS:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    for name, cls in POLICY.items():
        op = _overload(name)
        lib.impl(op, _kernel(op, cls), "AutocastPrivateUse1")
    _LIBS.extend([fallthrough, lib])
    record.STEP_HOOKS.append(clear_cache)
    torch.set_autocast_dtype("xla", DEFAULT_DTYPE)


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` for the ``xla`` device, with bfloat16 as the default dtype.

    ``xlatorch.amp.autocast(device)`` is ``torch.autocast("xla", dtype=torch.bfloat16)``: in
    the region, ops of the policy table (``xlatorch.amp.policy``) run in ``dtype`` or in
    float32 as the table says. Casts are recorded lazily like any op: nothing syncs.

    Args:
      device: the device (``xlatorch.device()``, ``"xla"``, ``"xla:0"``); must be an xla device.
      enabled: whether autocasting is on in the region.
      dtype: the low precision dtype (default bfloat16; float16 wants a ``GradScaler``).
      cache_enabled: reuse the cast of each weight within the region.
    """

    def __init__(self, device, enabled: bool = True, dtype: torch.dtype | None = None, cache_enabled: bool = True):
        if torch.device(device).type != "xla":
            raise ValueError(f"xlatorch.amp.autocast is for the xla device, got {device!r}: use torch.autocast")
        super().__init__("xla", enabled=enabled, dtype=DEFAULT_DTYPE if dtype is None else dtype,
                         cache_enabled=cache_enabled)  # fmt: skip

    def __exit__(self, exc_type, exc_val, exc_tb):
        out = super().__exit__(exc_type, exc_val, exc_tb)
        if not torch.is_autocast_enabled("xla"):
            clear_cache()
        return out
