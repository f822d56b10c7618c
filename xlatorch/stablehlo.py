"""StableHLO export of ``torch.export`` programs (torch_xla's ``torch_xla.stablehlo``).

``exported_program_to_stablehlo(torch.export.export(model, args))`` runs the exported
program once on the xla device, lazily (nothing executes): the ATen graph it records is
lowered by the same ops.yaml emitters a training step uses, and JAX lowers that to
StableHLO. The result gives the text (``get_stablehlo_text``), MLIR bytecode, what each
argument of the StableHLO ``main`` is (``meta``), and runs the program on the device when
called.

The StableHLO is for the example inputs' shapes (dynamic dimensions are specialised to
them); calling the module with other shapes works, through the lazy runtime.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from xlatorch.runtime.execute.lowered import lower
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.trace.tensor import XlaTensor, value_of

__all__ = [
    "StableHLOExportOptions",
    "StableHLOGraphModule",
    "StableHLOFunctionMeta",
    "VariableSignature",
    "exported_program_to_stablehlo",
]


@dataclasses.dataclass
class StableHLOExportOptions:
    """Options of :func:`exported_program_to_stablehlo`.

    Attributes:
      override_tracing_arguments: ``(args, kwargs)`` (or a tuple of args) to trace with
        instead of the exported program's example inputs.
      include_debug_info: op metadata (``aten::<op>`` names) and locations in the text.
    """

    override_tracing_arguments: Any = None
    include_debug_info: bool = False


@dataclasses.dataclass
class VariableSignature:
    """One argument or result of the StableHLO ``main``."""

    shape: tuple
    dtype: str
    kind: str  # "input" (a user input), "parameter", "buffer", "constant" (a tensor the
    # program holds), "scalar" (the Python numbers of the graph, packed into one argument)
    name: str  # the input's position, or the parameter's / buffer's name


@dataclasses.dataclass
class StableHLOFunctionMeta:
    """What the arguments and results of the StableHLO ``main`` are, in order."""

    name: str
    input_signature: list
    output_signature: list


class StableHLOGraphModule:
    """An exported program lowered to StableHLO; calling it runs the program on the device."""

    def __init__(self, module: torch.nn.Module, lowered, meta: StableHLOFunctionMeta, debug_info: bool):
        self._module = module
        self._lowered = lowered
        self._debug_info = debug_info
        self.meta = meta

    def get_stablehlo_text(self, method_name: str | None = None) -> str:
        """The program as StableHLO (MLIR text, before XLA's optimisations)."""
        self._method(method_name)
        return self._lowered.as_text(dialect="stablehlo", debug_info=self._debug_info)

    def get_stablehlo_bytecode(self, method_name: str | None = None) -> bytes:
        """The program as StableHLO MLIR bytecode."""
        import io

        self._method(method_name)
        buf = io.BytesIO()
        self._lowered.compiler_ir("stablehlo").operation.write_bytecode(buf)
        return buf.getvalue()

    def _method(self, name):
        if name not in (None, "forward"):
            raise ValueError(f"xlatorch.stablehlo: no method {name!r}; an exported program has 'forward' only")

    def __call__(self, *args, **kwargs):
        """Run the program on the xla device (CPU inputs are moved there); returns device tensors."""
        args, kwargs = tree_map(_to_device, (args, kwargs))
        return self._module(*args, **kwargs)


def _to_device(x):
    if isinstance(x, torch.Tensor) and type(x) is not XlaTensor:
        return x.to("xla")
    return x


def _sig(shape, dtype, kind, name) -> VariableSignature:
    return VariableSignature(tuple(shape), str(dtype).removeprefix("torch."), kind, str(name))


def exported_program_to_stablehlo(exported_program, options: StableHLOExportOptions | None = None):
    """Lower ``exported_program`` (from ``torch.export.export``) to StableHLO.

    Records the program once on the xla device with its example inputs (or
    ``options.override_tracing_arguments``), lowers the recorded graph as a sync would,
    and returns a :class:`StableHLOGraphModule`. Neither compiles nor runs anything.

    Args:
      exported_program: a ``torch.export.ExportedProgram``.
      options: a :class:`StableHLOExportOptions`.
    """
    options = options or StableHLOExportOptions()
    if not isinstance(exported_program, torch.export.ExportedProgram):
        raise TypeError(
            "xlatorch.stablehlo.exported_program_to_stablehlo expects a torch.export.ExportedProgram "
            f"(torch.export.export(model, args)), got {type(exported_program).__name__}"
        )
    example = options.override_tracing_arguments or exported_program.example_inputs
    if example is None:
        raise ValueError("xlatorch.stablehlo: the exported program has no example inputs; pass "
                         "StableHLOExportOptions(override_tracing_arguments=(args, kwargs))")  # fmt: skip
    args, kwargs = example if len(example) == 2 and isinstance(example[1], dict) else (tuple(example), {})
    module = exported_program.module().to("xla")
    args, kwargs = tree_map(_to_device, (tuple(args), dict(kwargs)))
    with torch.no_grad():
        outputs = module(*args, **kwargs)
    flat_out = [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor)]
    lowered, leaves, packed = lower(flat_out, "xlatorch.stablehlo")
    names = {}  # id(device data) -> (kind, name)
    for i, t in enumerate(tree_flatten((args, kwargs))[0]):
        if type(t) is XlaTensor:
            names.setdefault(id(value_of(t)), ("input", i))
    for kind, table in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in table:
            names.setdefault(id(value_of(t)), (kind, name))
    inputs = [_sig(v.aval[0], v.aval[1], *names.get(id(v), ("constant", f"c{k}")))
              for k, v in enumerate(v for v in leaves if type(v) is Data)]  # fmt: skip
    inputs += [_sig(p.shape, p.dtype, "scalar", "packed") for p in packed]
    outs = [_sig(o.shape, o.dtype, "output", i) for i, o in enumerate(flat_out)]
    meta = StableHLOFunctionMeta("forward", inputs, outs)
    return StableHLOGraphModule(module, lowered, meta, options.include_debug_info)
