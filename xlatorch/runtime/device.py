"""The ``xla`` device: PrivateUse1 renamed, its Python hooks, factories and copies.

Importing this module registers the device with PyTorch (no C++): a device module
(``torch.xla``), a PrivateUse1 hook and device guard (autograd's engine needs one),
PrivateUse1 kernels for every factory op in ops.yaml, the hand-written
runtime ops (copies between devices, aliases, ``item()``), and host-memory pinning
for the device (CPU kernels of ``_pin_memory`` / ``is_pinned``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator

import torch
from torch._prims_common import make_contiguous_strides_for

from xlatorch.runtime.base import fork
from xlatorch.runtime.base.topology import device_index, local_device_count
from xlatorch.runtime.execute import eager
from xlatorch.runtime.execute.materialize import to_cpu, to_other_device
from xlatorch.runtime.execute.transfer import to_device
from xlatorch.runtime.ir import rng
from xlatorch.runtime.ir.ops import SPECS
from xlatorch.runtime.plan import births
from xlatorch.runtime.trace import dynamic, modules, strides, views
from xlatorch.runtime.trace import tensor as _tensor_module
from xlatorch.runtime.trace.dispatch import RUNTIME_OPS, SHIMS, call
from xlatorch.runtime.trace.nodes import convert_value, node
from xlatorch.runtime.trace.tensor import XlaTensor, nested_error, value_of, wrap, write

aten = torch.ops.aten


class _DeviceModule:
    """``torch.xla``: what PyTorch asks a backend module for."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return local_device_count()

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return fork.FORKED[0] is not None

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        rng.set_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """The low precision dtypes ``torch.autocast("xla", dtype=...)`` accepts."""
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def get_rng_state(device="xla"):
        return torch.tensor([rng.get_seed()], dtype=torch.uint64)

    @staticmethod
    def set_rng_state(state, device="xla"):
        rng.set_seed(int(state[0]))

    @staticmethod
    def current_stream(device=None) -> _Stream:
        """The device's one stream (PyTorch code that overlaps copies asks for it, e.g.
        ``torch.distributed.checkpoint``'s writer)."""
        return _STREAM

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


class _Stream:
    """The device's one stream, for PyTorch code that overlaps device-to-host copies with
    other work. Every copy to host here has finished when ``.to("cpu")`` returns, so there
    is nothing to wait for: ``synchronize`` returns at once (it must not wait on the newest
    execution's outputs: a writer thread calls it while training donates those buffers)."""

    device_type = "xla"
    device_index = 0

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass  # one stream: already ordered

    def query(self) -> bool:
        return True


_STREAM = _Stream()


def _constant(value):
    """A callable returning ``value`` that runs no Python bytecode.

    PyTorch calls the hooks and the device guard from C++ (autograd's engine, device guards
    in destructors). A Python function there can raise ``KeyboardInterrupt`` (Python runs
    a pending signal handler at a function's first bytecode), and an exception unwinding
    through those C++ frames terminates the process. A builtin method never runs the
    handler, so Ctrl-C waits for the next bytecode of the user's program.
    """
    return itertools.repeat(value).__next__


class _Hook(torch._C._acc.PrivateUse1Hooks):
    is_available = staticmethod(_constant(True))
    is_built = staticmethod(_constant(True))
    has_primary_context = staticmethod(functools.partial(operator.is_not, None))  # (dev_id) -> True


class _Guard(torch._C._acc.DeviceGuard):
    type_ = staticmethod(_constant(torch._C._autograd.DeviceType.PrivateUse1))


_registered = False
_KEEP: list = []
_lib = None


def register(factories: dict) -> None:
    """Register the device once; ``factories`` maps schema names to lowered factory shims."""
    global _registered, _lib
    if _registered:
        return
    _registered = True
    torch._register_device_module("xla", _DeviceModule())
    modules.install()  # module.to(device) keeps tied parameters tied
    # PyTorch keeps raw pointers to these: they must live as long as the process.
    _KEEP.extend([_Hook(), _Guard()])
    torch._C._acc.register_python_privateuseone_hook(_KEEP[0])
    torch._C._acc.register_python_privateuseone_device_guard(_KEEP[1])
    # torch.optim picks its multi-tensor (foreach) path only for exact Tensor/Parameter types;
    # device tensors are a subclass. Listing it makes Adam & co. trace one node per update
    # op instead of one per parameter (GPT: 501 -> 269 nodes, a third less tracing).
    from torch.optim import optimizer

    if XlaTensor not in optimizer._foreach_supported_types:
        optimizer._foreach_supported_types.append(XlaTensor)
    _fake_tensors_stay_fake()
    _lib = torch.library.Library("aten", "IMPL")
    for name, shim in factories.items():
        _lib.impl(name, _ordinal_checked(_laid_out(shim) if name == "empty_strided" else shim), "PrivateUse1")
    # torch.tensor(data, device="xla") copies below the Python key: ATen asks for _copy_from.
    _lib.impl("_copy_from", lambda self, dst, non_blocking=False: _launched(_copy_(dst, self)), "PrivateUse1")
    _lib.impl("_pin_memory", _pin_memory, "CPU")
    _lib.impl("is_pinned", _is_pinned, "CPU")
    _lib.impl("ctc_loss.Tensor", _ctc_loss, "AutogradPrivateUse1")
    _lib.impl("ctc_loss.IntList", _ctc_loss, "AutogradPrivateUse1")
    _lib.impl("one_hot", _one_hot, "AutogradPrivateUse1")
    _lib.impl("_native_multi_head_attention", _native_multi_head_attention, "AutogradPrivateUse1")
    for name in _FUSED_BACKWARD:
        _lib.impl(name, _fused_backward(getattr(aten, name).default), "AutogradPrivateUse1")
    _lib.impl("set_.source_Tensor_storage_offset", views.set_to_view, "AutogradPrivateUse1")
    fork.HOOKS.append(_refuse_ops_in_a_forked_child)
    _nested = torch.library.Library("_", "IMPL")
    _nested.fallback(_nested_on_device, "NestedTensorPrivateUse1")
    _KEEP.append(_nested)


def _refuse_ops_in_a_forked_child() -> None:
    """In a child forked after the runtime started (base/fork.py), every op on an xla tensor
    raises at once, where it is called, rather than at the sync that would hang."""

    def refuse(func, args, kwargs):
        fork.check(f"{func._schema.name} (an op on an xla tensor)")

    _tensor_module.DISPATCH = refuse


# A nested tensor's ops on the device (its ``.to("xla")`` keeps it nested) reach its key for the
# device, where nothing is registered: PyTorch's error said "Could not run 'aten::_to_copy' with
# arguments from the 'NestedTensorxla' backend" and listed every backend. (Sparse tensors are
# refused at their upload: ``execute/transfer.to_device``.)
def _nested_on_device(op, *args, **kwargs):
    raise nested_error(f"{op._schema.name} got")


# Pinning a CPU tensor for the device. PyTorch asks the accelerator's hooks for a pinned-memory
# allocator (``getPinnedMemoryAllocator``), and Python hooks cannot provide one: the
# DataLoader (``pin_memory=True``, Hugging Face Trainer's default) failed in its pin thread
# once ``xla`` is the accelerator. The device needs no page-locked memory (every upload is
# ``jax.device_put`` of a host array, which stages it itself), so for the xla device
# ``_pin_memory`` is the copy its schema promises, in ordinary memory, and ``is_pinned`` says
# so (False). Requests for any other device (a CUDA build's) go to PyTorch's own kernel.
_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def _pins_for_xla(device) -> bool:
    target = torch.accelerator.current_accelerator() if device is None else torch.device(device)
    return target is not None and target.type == "xla"


def _pin_memory(self, device=None):
    if not _pins_for_xla(device):
        return aten._pin_memory.default._op_dk(_COMPOSITE, self, device)
    return self.clone(memory_format=torch.contiguous_format)


def _is_pinned(self, device=None):
    if not _pins_for_xla(device):
        return aten.is_pinned.default._op_dk(_COMPOSITE, self, device)
    return False


_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
    """``ctc_loss`` (either overload) on the device: its lengths become device tensors, read in
    the graph (``_ctc_loss.Tensor``), so one compiled step serves every set of lengths (as int
    lists they would be constants of the graph: a compile per set). Lengths held on the CPU are
    taken, as CUDA takes them; ones of a float dtype raise CPU's error."""
    lens = []
    for name, t in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t, dtype=torch.long)
        elif t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise RuntimeError(f"{name} must be integral")  # CPU's and CUDA's kernels' first check
        lens.append(t.to(log_probs.device) if type(t) is torch.Tensor else t)
    return aten.ctc_loss.Tensor._op_dk(_IMPLICIT, log_probs, targets, *lens, blank, reduction, zero_infinity)


def _native_multi_head_attention(*args, **kwargs):
    """``nn.MultiheadAttention``'s inference fast path: without ``need_weights`` CPU returns no
    weights (None), where PyTorch's meta kernel, from which the device's results are shaped,
    says an empty tensor."""
    with torch._C._AutoDispatchBelowAutograd():
        out, weights = aten._native_multi_head_attention.default(*args, **kwargs)
    need = kwargs.get("need_weights", args[10] if len(args) > 10 else True)
    return out, weights if need else None


# Gradient ops that CPU computes in one kernel and PyTorch decomposes for any other backend (a
# CompositeImplicitAutograd kernel: ``sigmoid``, ``mul``, ``add``... each rounded to the
# tensors' dtype): a bfloat16 SiLU's gradient differed from CPU's in 48% of elements. Here they
# reach their ops.yaml lowering (CPU's formula in float32, rounded once). When autograd must
# record them (a gradient of a gradient), or for fake tensors, they decompose as before.
_FUSED_BACKWARD = ("silu_backward", "mish_backward")


def _fused_backward(op):
    def kernel(*args):
        if (torch.is_grad_enabled() and any(a.requires_grad for a in args)) or any(
                type(a) is not XlaTensor for a in args):  # fmt: skip
            return op._op_dk(_IMPLICIT, *args)
        return XlaTensor.__torch_dispatch__(op, (XlaTensor,), args)

    return kernel


def _one_hot(self, num_classes=-1):
    """``F.one_hot`` on the device, with CPU's checks. PyTorch's composite skips them for an
    accelerator and compares with ``arange``: a class outside ``[0, num_classes)`` gave a row
    of zeros where CPU raises. Here the values are checked on the device (ops.yaml ``one_hot``),
    CPU's message at the read; ``num_classes=-1`` reads the largest class, as CPU does. Fake
    tensors (``torch.compile``'s tracing) take the composite."""
    if type(self) is not XlaTensor:
        return aten.one_hot.default._op_dk(_IMPLICIT, self, num_classes)
    if self.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if self.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
    elif num_classes < 0:  # read on the host, as CPU reads it: the least class first
        if int(self.min()) < 0:
            raise RuntimeError("Class values must be non-negative.")
        if num_classes != -1:
            raise RuntimeError("Class values must be smaller than num_classes.")
        num_classes = int(self.max()) + 1
    return XlaTensor.__torch_dispatch__(aten.one_hot.default, (XlaTensor,), (self, num_classes))


def _fake_tensors_stay_fake() -> None:
    """``torch.tensor(data, device="xla")`` while a fake mode traces (Dynamo, AOTAutograd,
    ``torch.export``) makes a fake tensor, never a real device tensor.

    The constructor builds its data on the CPU below the Python key. A fake mode that
    ``avoid_device_init`` lifts that CPU tensor to a fake one and moves it with a fake
    ``_to_copy``; one that does not (PyTorch's choice when a PrivateUse1 backend is
    available) first copies it to the device for real, through the PrivateUse1 kernels,
    and only converts a plain tensor to a fake one: an xla tensor came out real, and the
    first op mixing it with fakes failed (Hugging Face's ``DynamicCache`` starts from
    ``torch.tensor([], device=...)``). Avoiding device init is always sound (it only gives up
    folding constants that move between devices) and is what torch_xla gets, its device not
    being a PrivateUse1 one; the traced graph holds the data as a CPU constant moved to the
    device.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.avoid_device_init = property(lambda self: True)


def _laid_out(shim):
    """``empty_strided`` reporting the strides it is given, when dense (an upload's
    destination: ``x.t().to("xla")`` is transposed, as CUDA's copy; trace/strides.py)."""

    def empty_strided(size, stride, *args, **kwargs):
        t = shim(size, stride, *args, **kwargs)
        if tuple(stride) == make_contiguous_strides_for(size):  # the common case: no meta tensor
            return t
        geo = strides.layout_like(torch.empty_strided(size, stride, device="meta"))
        return t if geo is None else wrap(value_of(t), geo=geo)

    return empty_strided


def _ordinal_checked(shim):
    """A factory that raises for a device ordinal this process does not have (``xla:3``)."""

    def factory(*args, **kwargs):
        d = kwargs.get("device")
        if d is not None and d.index:
            device_index(d)
        return _launched(shim(*args, **kwargs))

    return factory


def _launched(out):
    """``out``, computed now in eager mode (these kernels run below ``__torch_dispatch__``)."""
    if eager.ON:
        eager.launch()
    return out


def _xla_target(device) -> bool:
    return device is None or torch.device(device).type == "xla"


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):  # fmt: skip
    if not _xla_target(device):
        cpu = to_cpu(self, ".cpu()")
        return cpu.to(device=device, dtype=dtype or cpu.dtype)
    dev = device_index(torch.device(device) if device is not None else None)
    # The copy keeps the layout (preserve_format), as CUDA's does: trace/strides.py
    geo = strides.layout_like(self, memory_format)
    if type(self) is not XlaTensor:
        return wrap(to_device(self.to(dtype=dtype or self.dtype), dev), geo=geo)
    v = value_of(self) if device is None or self._st.dev == dev else to_other_device(self, dev)
    return wrap(convert_value(v, dtype or self.dtype), geo=geo)


def _fit(v, dst: XlaTensor):
    """``v`` cast and broadcast to ``dst``'s dtype and shape, as ``copy_`` does."""
    if v.aval[1] != dst.dtype:
        v = convert_value(v, dst.dtype)
    if v.aval[0] != tuple(dst.shape):
        v = node(SPECS["expand.default"], (v, tuple(dst.shape), False)).outs[0]
    return v


def _copy_(self, src, non_blocking=False):
    if type(self) is not XlaTensor:  # device -> host
        self.copy_(to_cpu(src, "copy_ to CPU"))
        return self
    if type(src) is XlaTensor:
        v = value_of(src) if src._st.dev == self._st.dev else to_other_device(src, self._st.dev)
    else:
        v = to_device(src, self._st.dev)
    write(self, _fit(v, self))
    return self


def _alias(self):
    return wrap(value_of(self), self._st, self._vw, self._geo)


def _item(self):
    return to_cpu(self, ".item()").item()


def install(specs: dict) -> None:
    """Hook the hand-written runtime ops into dispatch (called once the table is loaded)."""
    SPECS.update(specs)
    births.mark(specs)
    RUNTIME_OPS.update(
        {
            aten._to_copy.default: _to_copy,
            aten.copy_.default: _copy_,
            aten.detach.default: _alias,
            aten.alias.default: _alias,
            aten.lift_fresh.default: lambda self: self,
            aten._local_scalar_dense.default: _item,
        }
    )
    SHIMS.pop(aten._to_copy.default, None)
    dynamic.install()  # nonzero, masked_select, boolean-mask indexing, resize_
    views.install()  # t_, transpose_, squeeze_, unsqueeze_, as_strided_


def check_runtime(listed) -> None:
    """Every op ops.yaml routes to the runtime has a handler (a registry/runtime mismatch is a bug)."""
    missing = [str(op) for op in listed if op not in RUNTIME_OPS and op not in SHIMS]
    if missing:
        raise AssertionError(f"ops.yaml says 'dispatch: runtime' but no handler is installed: {missing}")


__all__ = ["register", "install", "call"]
