"""StableHLO export of ``torch.export`` programs (torch_xla's ``torch_xla.stablehlo``).

``exported_program_to_stablehlo(torch.export.export(model, args))`` runs the exported program
once on the xla device, lazily, lowers the recorded ATen graph with the ops.yaml emitters and
``jax.export`` to a StableHLO module, and returns a :class:`StableHLOGraphModule`: its text,
bytecode, what each argument of ``main`` is, and a callable that runs the StableHLO on the
device. ``save_as_stablehlo`` writes it to a directory in torch_xla's layout;
``StableHLOGraphModule.load`` reads it back in any process.

Layout: ``options`` (export options), ``modules`` (StableHLO bytes), ``bundle`` (the
dataclasses and the directory), ``graph_module`` (calling a bundle), ``export`` (tracing and
lowering).
"""

from xlatorch.stablehlo.bundle import (
    InputLocation,
    StableHLOFunc,
    StableHLOFunctionMeta,
    StableHLOJSONSerializer,
    StableHLOModelBundle,
    VariableSignature,
    VariableType,
    stablehlo_obj_hook,
)
from xlatorch.stablehlo.export import (
    XLAExportInterpreter,
    exported_program_to_stablehlo,
    save_as_stablehlo,
    save_torch_model_as_stablehlo,
)
from xlatorch.stablehlo.graph_module import StableHLOGraphModule
from xlatorch.stablehlo.options import StableHLOExportOptions

__all__ = [
    "InputLocation",
    "StableHLOExportOptions",
    "StableHLOFunc",
    "StableHLOFunctionMeta",
    "StableHLOGraphModule",
    "StableHLOJSONSerializer",
    "StableHLOModelBundle",
    "VariableSignature",
    "VariableType",
    "XLAExportInterpreter",
    "exported_program_to_stablehlo",
    "save_as_stablehlo",
    "save_torch_model_as_stablehlo",
    "stablehlo_obj_hook",
]
