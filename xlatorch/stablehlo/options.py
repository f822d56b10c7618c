"""``StableHLOExportOptions``: how a program is exported and saved (torch_xla's fields)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["StableHLOExportOptions"]


@dataclasses.dataclass
class StableHLOExportOptions:
    """Options of ``exported_program_to_stablehlo`` and ``save_as_stablehlo``.

    Attributes:
      include_human_readable_text: keep the StableHLO text (``get_stablehlo_text``, the
        ``functions/<name>.mlir`` file) beside the bytecode.
      override_tracing_arguments: the positional arguments to trace with instead of the
        exported program's example inputs (a tuple; ``(args, kwargs)`` with a dict is accepted too).
      override_tracing_kwargs: the keyword arguments to trace with.
      save_weights: write the weights (``data/``) when saving.
      inline_all_constant: the graph's Python numbers become constants of the program
        (otherwise they are arguments of ``main``, saved under ``constants/``).
      export_weights: keep the weights in the bundle (``state_dict``); without them a loaded
        program needs its weights put back in ``bundle.state_dict`` before it runs.
      custom_ops_allowed_in_graph: op namespaces to map to ``stablehlo.custom_call``
        (not supported by xlatorch: an op of one of them raises NotImplementedError).
      export_node_metadata: keep op names and source locations (``aten::<op>``) in the text.
      include_debug_info: the same (xlatorch's name, kept for older code).
    """

    include_human_readable_text: bool = True
    override_tracing_arguments: Any = None
    override_tracing_kwargs: Any = None
    save_weights: bool = True
    inline_all_constant: bool = True
    export_weights: bool = True
    custom_ops_allowed_in_graph: set = dataclasses.field(default_factory=set)
    export_node_metadata: bool = False
    include_debug_info: bool = False
