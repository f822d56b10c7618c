"""``torch.compile(model, backend="openxla")`` (or ``"xlatorch"``) on the xla device.

Dynamo captures the program as FX graphs, AOTAutograd turns each into ATen forward and
backward graphs, and each of those becomes one node of the lazy graph (``runtime/trace/fx.py``),
lowered by the ops.yaml emitters: a compiled step pays one node per graph instead of Python
dispatch per op, and the step (forward, backward, optimizer) still compiles into one cached
XLA program at ``mark_step``. A graph with an op that has no lowering runs op by op on the
lazy path instead (counted as ``CompiledGraphOpByOp``); Dynamo's graph breaks run on the lazy
path too. Dynamo's recompiles show in ``torch._dynamo.utils.counters`` and here as
``DynamoCompile`` (graphs handed to this backend).

Importing this module (``torch.compile`` does it on its first call once xlatorch is imported)
teaches Dynamo that xla tensors are tensors, keeps it out of xlatorch's own code, and
registers the backends (replacing PyTorch's built-in ``openxla``, which needs torch_xla).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _COMPILER_FNS, _lazy_import, register_backend
from torch._dynamo.variables.builder import VariableBuilder
from torch._functorch.aot_autograd import make_boxed_func

from xlatorch.runtime.base.record import COUNTERS
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


def _install() -> None:
    # Dynamo models tensor subclasses that override __torch_dispatch__ as opaque objects
    # (every call a graph break); xla tensors are plain tensors to it, faked on the xla device.
    VariableBuilder._type_dispatch()[XlaTensor] = VariableBuilder.wrap_tensor
    torch._dynamo.trace_rules.add("xlatorch")  # never trace xlatorch's own Python
    _lazy_import()  # PyTorch's built-in backends, its openxla among them, are registered now
    for name in ("openxla", "xlatorch"):
        _COMPILER_FNS.pop(name, None)
        register_backend(compiler_fn=xlatorch_backend, name=name)


_install()
