"""How PyTorch's module and autograd machinery meets the device: tied parameters stay tied,
and a backward pass that cannot run on the device says why.

Shared (tied) parameters and buffers stay shared when a module moves to or from the device.

``nn.Module._apply`` (behind ``.to()``, ``.cpu()``, ``.half()``, ``.float()`` ...) keeps a
parameter's identity only when ``torch._has_compatible_shallow_copy_type(old, new)``
holds; between a CPU tensor and a device tensor (a wrapper subclass) it does not, so each
module that holds the parameter gets a new ``Parameter`` of its own: a tied embedding and
output layer become two parameters, each receiving half the gradient, and the model
trains differently from CPU without any error.

xlatorch wraps ``nn.Module._apply`` once: the outermost call notes which parameter and
buffer slots (across every submodule) hold the same tensor, and after the conversion
points all of them at the first slot's new tensor (with its gradient). Programs whose
parameters keep their identity anyway (CPU-only, same-device dtype changes) see no change.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn as nn

from xlatorch.runtime.base import interrupts
from xlatorch.runtime.base.threads import CALLERS, DEFERRED, _get_ident, _in_backward, defer_to_owners, owner
from xlatorch.runtime.base.topology import thread_replicas
from xlatorch.runtime.ir import values as ir
from xlatorch.runtime.trace.tensor import DEVICE, XlaTensor

__all__ = ["install"]

_IMPORT_ORDER = (
    "xlatorch: the autograd engine started before `import xlatorch` (a backward pass ran on CPU "
    "first) and sized its device queues without the xla device, so it cannot run a backward "
    "pass on the device in this process. Import xlatorch at the top of the program, before "
    "any backward pass (or in the process's first lines: `import torch, xlatorch`)."
)
# torch 2.11 on an H100 (seen, bench/accelerator/): with a PrivateUse1 device registered,
# PyTorch takes it for the process's accelerator and its engine finds no stream for a CUDA
# node (pytorch/pytorch#161129): every backward pass over CUDA tensors fails this assert.
_CUDA_STREAMS = (
    "xlatorch: a backward pass over CUDA tensors cannot run in a process that imported xlatorch: "
    "PyTorch takes the registered xla device (its PrivateUse1 backend) for the process's "
    "accelerator, and its autograd engine then finds no CUDA stream for the pass (a PyTorch "
    "limitation, pytorch/pytorch#161129). Run the CUDA work in a process that does not import "
    "xlatorch, or run it on the xla device (PJRT_DEVICE=GPU puts the xla device on the GPU)."
)

# A lazy module's parameter (nn.LazyLinear ...) before its first forward: its shape is unknown, and
# its later materialization in place (as on CPU, where an optimizer made before holds the same
# object) cannot give it a device array.
UNINITIALIZED = (
    "xlatorch: an uninitialized parameter or buffer (a lazy module's, such as nn.LazyLinear's, before its "
    "first forward) cannot be on the xla device: create the module on the CPU, run one forward pass there with "
    "a sample input (it infers the shapes and initializes the weights), then move the module with "
    ".to(device) and create its optimizer"
)


_tls = threading.local()
_BACKWARD = threading.Lock()
_original = None


def _shared_slots(module: nn.Module) -> list[list]:
    """Groups of ``(submodule, table, name)`` slots that hold the same tensor (groups of 2+)."""
    groups: dict[int, list] = {}
    held = []  # keeps the tensors alive, so their ids stay unique while grouping
    for m in module.modules():
        for table in ("_parameters", "_buffers"):
            for name, t in getattr(m, table).items():
                if t is not None:
                    groups.setdefault(id(t), []).append((m, table, name))
                    held.append(t)
    return [g for g in groups.values() if len(g) > 1]


def _apply(self, fn, recurse=True):
    if getattr(_tls, "active", False) or not recurse:
        return _original(self, fn, recurse)
    shared = _shared_slots(self)
    if not shared:
        return _original(self, fn, recurse)
    _tls.active = True
    try:
        result = _original(self, fn, recurse)
    finally:
        _tls.active = False
    for group in shared:
        m0, table0, name0 = group[0]
        tied = getattr(m0, table0)[name0]
        for m, table, name in group[1:]:
            getattr(m, table)[name] = tied
    return result


def _checked_backward(run):
    """``torch.autograd``'s engine entry. Records the thread that calls a device backward pass
    (the device ops autograd runs on its own thread work for it), raises there the errors that
    thread could not raise, and turns the engine's internal assert about its device queues
    (a backward ran before xlatorch was imported) into an error that says what to do."""

    def engine_run_backward(t_outputs, *args, **kwargs):
        mine = (
            _in_backward() == -1
            and not ir._multi
            and (any(type(t) is XlaTensor for t in t_outputs) or _reaches_device(t_outputs))
        )
        if mine:
            # One user thread's device backward pass at a time, so that autograd's device
            # thread knows whom its ops work for (tensor.owner). Its ops are serialised by
            # tensor.LOCK anyway. Not from autograd's thread (a backward inside a backward)
            # nor under dp.DataParallel, whose threads meet in replicated executions.
            _BACKWARD.acquire()
            me = _get_ident()
            CALLERS[me] = 1
        try:
            if thread_replicas() and _in_backward() == -1:
                # dp.DataParallel: autograd's one device thread would run every replica's device
                # ops, but it has no replica device of its own, and ``xla:0`` (every device
                # tensor reports it) means "this thread's device": a gradient's cast back
                # (ToCopyBackward: ``grad.to(xla:0, dtype)``) moved replica 1's gradient to
                # device 0, its all_reduce joined device 0's step, and replica 0 waited forever
                # for replica 1's. Run the pass on the replica's thread (its ops trace there
                # as they would on autograd's thread): new values go to the replica's device,
                # and a collective a backward pass syncs meets the other replicas' threads
                # instead of blocking the one thread they all need. Replica threads are never
                # the main thread, so Ctrl-C cannot unwind through the engine there.
                with torch.autograd.set_multithreading_enabled(False):
                    result = run(t_outputs, *args, **kwargs)
            elif mine:
                # The calling thread runs the pass, as autograd does for CPU tensors: handing
                # it to autograd's device thread and back cost 0.3 ms of a 2.5 ms MLP step's
                # host time (two thread switches, and the GIL between them). A Ctrl-C still
                # waits for the user's next line (runtime/base/interrupts.py).
                with torch.autograd.set_multithreading_enabled(False):
                    result = run(t_outputs, *args, **kwargs)
            else:
                result = run(t_outputs, *args, **kwargs)
        except RuntimeError as e:
            if "device_ready_queues_" in str(e):
                raise RuntimeError(_IMPORT_ORDER) from None
            if "opt_ready_stream && opt_parent_stream" in str(e):
                raise RuntimeError(_CUDA_STREAMS) from e
            error = DEFERRED.pop(me, None) if mine else None
            if error is None:
                raise
            # The user's code raised first (a saved tensor's unpack hook, deferred): what failed
            # after it, on the stand-in it left, is its consequence
            _undo_failed_pass(t_outputs, error)
            raise error from e
        finally:
            if mine:
                del CALLERS[me]
                _BACKWARD.release()
        if mine and DEFERRED:  # an error autograd's device thread could not raise (tensor.defer_to_owners)
            error = DEFERRED.pop(me, None)
            if error is not None:
                _undo_failed_pass(t_outputs, error)
                raise error
        return result

    interrupts.ENGINE_ENTRIES.add(engine_run_backward.__code__)
    return engine_run_backward


_WALK_LIMIT = 4096  # autograd nodes looked at for a device one, from a pass's CPU outputs


def _reaches_device(t_outputs) -> bool:
    """Whether a backward pass started from CPU tensors runs device ops (a loss computed on the
    host from device values, ``(y.cpu() ** 2).sum()``): then it is a device pass too, run in
    the calling thread, and an error of the user's code in its device part is deferred as in
    one started on the device (else autograd's device thread runs that part, and the error
    aborts the process)."""
    todo = [t.grad_fn for t in t_outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    try:
        while todo and len(seen) < _WALK_LIMIT:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if any(m.device.type == "xla" for m in fn._input_metadata):
                return True
            todo.extend(f for f, _ in fn.next_functions)
    except Exception:  # a node this torch describes otherwise: the pass runs as PyTorch runs it
        return False
    return False


def _on_host(args) -> bool:
    """Whether the arguments autograd hands the user's code show a CPU node's: tensors, none of
    them a device tensor (one level of tuples and lists: a node hook's gradients, a Function's
    ``ctx`` and gradients). No tensor at all (every gradient None): not known, so not."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for a in args:
        if type(a) in (tuple, list):
            tensors += [x for x in a if isinstance(x, torch.Tensor)]
    return bool(tensors) and not any(type(t) is XlaTensor for t in tensors)


def _deferring(fn, result=lambda *args: None, by_args=True):
    """``fn``, user code autograd's engine calls in a backward pass (a tensor's hook, a custom
    Function's backward), with an exception it raises in a device backward pass left for the
    thread that called ``backward()``, which raises it when the pass returns: unwinding through
    the engine aborts the process (torch's Python device guard). The pass goes on with
    ``result(*args)`` in its place (a hook: the gradient unchanged)."""

    @functools.wraps(fn)
    def call(*args):
        try:
            return fn(*args)
        except Exception as e:
            if _in_backward() == -1 or not CALLERS:  # not in a device pass: as PyTorch would
                raise
            if by_args and _on_host(args):  # a CPU node's: the pass stops there, as CPU's does
                raise
            defer_to_owners(e, (owner(),))
            return result(*args)

    return call


def _undo_failed_pass(t_outputs, error) -> None:
    """After the user's code raised in a device backward pass: the pass ran to its end (an
    exception cannot unwind through autograd's engine) writing nothing from then on
    (``XlaTensor.__torch_dispatch__``), so a gradient that existed keeps its value; a leaf
    whose gradient the rest of the pass made anew has none again. As CPU, whose pass stops at
    the error: what it accumulated before stays, nothing after."""
    tick = getattr(error, "_xlatorch_tick", None)
    if tick is None:
        return
    seen = set()
    todo = [t.grad_fn for t in t_outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node's
        if leaf is not None:
            g = leaf.grad
            if type(g) is XlaTensor and g._st.sid > tick:
                leaf.grad = None
        todo.extend(f for f, _ in fn.next_functions)


def _hooks_deferred(register):
    def register_hook(self, hook):
        return register(self, _deferring(hook))

    register_hook.__doc__ = register.__doc__
    return register_hook


def _no_grads(ctx, *grads):
    return (None,) * len(ctx.needs_input_grad)


def _stand_in(packed):
    """What a saved tensor's unpack hook that raised in a device pass gives the pass instead:
    the packed tensor itself, or a 0-d one (the pass writes nothing more either way)."""
    return packed if isinstance(packed, torch.Tensor) else torch.zeros(())


def _not_on_device(new):
    """A lazy module's uninitialized parameter made on the xla device (``nn.LazyLinear(3,
    device=dev)``, or under ``torch.device(dev)``) raises what to do (PyTorch's own error names
    tensor subclasses); elsewhere as before."""

    @functools.wraps(new)
    def __new__(cls, *args, **kwargs):
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        if torch.device(device if device is not None else torch.get_default_device()).type == DEVICE.type:
            raise RuntimeError(UNINITIALIZED)
        return new(cls, *args, **kwargs)

    return staticmethod(__new__)


def install() -> None:
    """Wrap ``nn.Module._apply``, autograd's engine entry and the user's code it calls (once)."""
    global _original
    if _original is None:
        _original = nn.Module._apply
        nn.Module._apply = _apply
        for cls in (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer):
            cls.__new__ = _not_on_device(cls.__new__)
        import torch.autograd as autograd
        from torch.autograd.function import BackwardCFunction, _HookMixin

        for name in ("register_hook", "register_post_accumulate_grad_hook"):
            setattr(XlaTensor, name, _hooks_deferred(getattr(torch.Tensor, name)))
        BackwardCFunction.apply = _deferring(BackwardCFunction.apply, _no_grads)
        # Every node's hooks (``grad_fn.register_hook`` / ``register_prehook``: a built-in op's
        # node, a custom Function's, a module's full backward hooks) are kept by this one call.
        register = _HookMixin._register_hook

        def _register_hook(backward_hooks, hook):
            return register(backward_hooks, _deferring(hook))

        _HookMixin._register_hook = staticmethod(_register_hook)

        # A saved tensor's unpack hook runs in the pass (torch.utils.checkpoint's, save_on_cpu's)
        hooks = torch.autograd.graph.saved_tensors_hooks
        init = hooks.__init__

        @functools.wraps(init)
        def saved_tensors_hooks_init(self, pack_hook, unpack_hook):
            init(self, pack_hook, _deferring(unpack_hook, _stand_in, by_args=False))  # its device is not in its args

        hooks.__init__ = saved_tensors_hooks_init
        # torch.autograd.backward and .grad call the name bound in torch.autograd.
        autograd._engine_run_backward = _checked_backward(autograd._engine_run_backward)
