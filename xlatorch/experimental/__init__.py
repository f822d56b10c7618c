"""``torch_xla.experimental``: the programming model of today's torch_xla.

- ``eager``: eager mode (each op launched at once, compiled once per signature);
- ``scan``, ``scan_layers``, ``fori_loop``, ``gradient_accumulation``: loops lowered to one
  XLA loop whose body is compiled once;
- ``assume_pure``: a pure function traced once per signature, then replayed.

Each module is a thin user API over the runtime: loops and replayed functions are IR nodes
(``runtime/trace/loops.py``), eager mode is a sync policy.
"""

from xlatorch.experimental.eager import eager_mode, eager_mode_context, is_eager_mode  # noqa: F401
