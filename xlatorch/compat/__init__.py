"""Front doors for other generations' module names: ``python -m xlatorch.compat SCRIPT``.

The runner (``__main__.py``) runs a script written for ``torch_xla``, ``torch_xla_py``
(torch_xla 0.1) or ``lazy_tensor_core`` unmodified: in its processes those names resolve
to xlatorch's own modules (``aliases.py``: the table and the finder), plus two small
adapters where an old name has no xlatorch counterpart (``lazy_model.py`` for
``lazy_tensor_core.core.lazy_model``, ``xlac.py`` for ``torch_xla._XLAC``). Importing
this package installs nothing: outside the runner ``import torch_xla`` finds a real
torch_xla, or fails.
"""

import os

FRONT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "front")
"""The directory the runner puts on ``PYTHONPATH``: stub packages ``torch_xla``,
``torch_xla_py`` and ``lazy_tensor_core`` that install the aliases when first imported."""
