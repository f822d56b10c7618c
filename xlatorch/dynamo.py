"""``torch.compile(model, backend="openxla")`` (or ``"xlatorch"``) on the xla device.

Dynamo captures the program as FX graphs, AOTAutograd turns each into ATen forward and
backward graphs, and each of those becomes one node of the lazy graph (``runtime/trace/fx.py``),
lowered by the ops.yaml emitters: a compiled step pays one node per graph instead of Python
dispatch per op, and the step (forward, backward, optimizer) still compiles into one cached
XLA program at ``mark_step``. A graph with an op that has no lowering runs op by op on the
lazy path instead (counted as ``CompiledGraphOpByOp``); Dynamo's graph breaks run on the lazy
path too. Dynamo's recompiles show in ``torch._dynamo.utils.counters`` and here as
``DynamoCompile`` (graphs handed to this backend).

A Python float passed as an argument (``step(x, lr)``, also inside a list or dict argument) is
an input of the graph, as the lazy path makes Python numbers parameters: a learning-rate
schedule reuses one graph and one XLA program. ``torch._dynamo.config.specialize_float`` is
False by default, but ``dynamic=False`` (these backends' default: XLA wants static shapes)
makes Dynamo bake every float into the graph and guard on its value (a new graph, and a new
XLA program, per value, up to ``recompile_limit``, then eager). For these backends a float
argument is wrapped as under ``dynamic=True`` instead: Dynamo passes it as a float64 0-d CPU
tensor, cast where it is used, and guards only on its type. Floats that are attributes of a
module stay constants (as Dynamo keeps a module's int attributes static), as does every
float under ``specialize_float=True``. Dynamo itself still specializes a float that an op
takes as a plain number (``torch.full``'s value, ``clamp``'s bounds, ``x ** p``) or that the
function returns as a number (a graph per value, as before), and a float that decides
control flow gives a graph per branch taken.

``xm.all_reduce``, ``all_gather`` and ``reduce_scatter`` inside a compiled function are calls in
Dynamo's graph that record ``xlatorch::`` ops (``runtime/trace/collectives.py``); a graph holding
one compiles as the SPMD program over the replicas. Tensors the function builds from Python
data (``torch.tensor([...], device=...)``) are fake while it is traced (``runtime/device.py``)
and constants of its graph.

Importing this module (``torch.compile`` does it on its first call once xlatorch is imported)
teaches Dynamo that xla tensors are tensors, keeps it out of xlatorch's own code (but for the
collectives), and registers the backends (replacing PyTorch's built-in ``openxla``, which needs
torch_xla).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _COMPILER_FNS, _lazy_import, register_backend
from torch._dynamo.variables.builder import VariableBuilder
from torch._functorch.aot_autograd import make_boxed_func

from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.trace import collectives
from xlatorch.runtime.trace.fx import FxProgram, Unlowerable
from xlatorch.runtime.trace.tensor import XlaTensor

__all__ = ["xlatorch_backend"]


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, name: str):
    COUNTERS["DynamoCompile"] += 1
    try:
        program = FxProgram(gm, name)
    except Unlowerable as e:
        COUNTERS["CompiledGraphOpByOp"] += 1
        reason = str(e)

        def op_by_op(*args):
            return gm(*args)

        op_by_op.reason = reason
        return make_boxed_func(op_by_op)

    def run(args):
        out = program(args)
        args.clear()  # boxed calling convention: the inputs are not kept alive
        return out

    run._boxed_call = True  # AOTAutograd passes one list of arguments
    return run


def _forward(gm, example_inputs):
    return _compile_graph(gm, example_inputs, "forward")


def _backward(gm, example_inputs):
    return _compile_graph(gm, example_inputs, "backward")


def _decompositions() -> dict:
    """PyTorch's decompositions of the ops ops.yaml does not lower (select_backward,
    ops.yaml's ``decompose: true`` entries ...): AOTAutograd applies them while tracing, so the
    graphs reach FxProgram made of lowered ops (compose before you add)."""
    from torch._decomp import decomposition_table

    from xlatorch.runtime.trace.fx import HANDLED, SPECS

    return {op: fn for op, fn in decomposition_table.items() if op not in SPECS and op not in HANDLED}


xlatorch_backend = aot_autograd(fw_compiler=_forward, bw_compiler=_backward, decompositions=_decompositions())


def _for_xla(compiler_fn) -> bool:
    """Whether Dynamo compiles for this backend: ``compiler_fn`` is it, or wraps it (Dynamo's
    debug wrapper, ``torch.compile``'s wrapper)."""
    for _ in range(4):
        if compiler_fn is xlatorch_backend:
            return True
        inner = getattr(compiler_fn, "_torchdynamo_orig_backend", None)
        compiler_fn = inner if inner is not None else getattr(compiler_fn, "compiler_fn", None)
    return False


def _argument(source) -> bool:
    """Whether ``source`` is an argument of the compiled function, or an item of one."""
    from torch._dynamo.source import DictGetItemSource, GetItemSource, LocalSource

    while isinstance(source, (GetItemSource, DictGetItemSource)):
        source = source.base
    return isinstance(source, LocalSource) and source.is_input


def _float_arguments_are_inputs(wrap_symfloat):
    """``VariableBuilder.wrap_symfloat``, wrapping a float argument as an input of the graph
    for this backend even though its ``dynamic=False`` assumes static values."""

    def wrap(self, value):
        if _for_xla(self.tx.output.compiler_fn) and _argument(self.get_source()):
            with torch._dynamo.config.patch(assume_static_by_default=False):
                return wrap_symfloat(self, value)
        return wrap_symfloat(self, value)

    wrap._xlatorch = True
    return wrap


def _install() -> None:
    # Dynamo models tensor subclasses that override __torch_dispatch__ as opaque objects
    # (every call a graph break); xla tensors are plain tensors to it, faked on the xla device.
    VariableBuilder._type_dispatch()[XlaTensor] = VariableBuilder.wrap_tensor
    # A float argument is an input of the graph, not a constant (a learning-rate schedule
    # compiles once). Other backends keep Dynamo's behaviour.
    if not getattr(VariableBuilder.wrap_symfloat, "_xlatorch", False):
        VariableBuilder.wrap_symfloat = _float_arguments_are_inputs(VariableBuilder.wrap_symfloat)
    torch._dynamo.trace_rules.add("xlatorch")  # never trace xlatorch's own Python
    # ... nor its generated shims (in a source checkout they live outside the package folder)
    torch._dynamo.trace_rules.add("xlatorch._generated")
    # ... but record xm's collectives as calls: given a tracer's tensors they record their ops.
    for fn in (collectives.all_reduce, collectives.all_gather, collectives.reduce_scatter):
        torch._dynamo.allow_in_graph(fn)
    _lazy_import()  # PyTorch's built-in backends, its openxla among them, are registered now
    for name in ("openxla", "xlatorch"):
        _COMPILER_FNS.pop(name, None)
        register_backend(compiler_fn=xlatorch_backend, name=name)


_install()
