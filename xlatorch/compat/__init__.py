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
import sys

FRONT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "front")
"""The directory the runner puts on ``PYTHONPATH``: stub packages ``torch_xla``,
``torch_xla_py`` and ``lazy_tensor_core`` that install the aliases when first imported."""


RUNNER = ("xlatorch.compat", "xlatorch.compat.__main__")


def is_runner() -> bool:
    """Whether this process is ``python [OPTIONS] -m xlatorch.compat ...`` with Python still
    locating the module (``sys.argv[0]`` is ``'-m'`` only then)."""
    if sys.argv[:1] != ["-m"]:
        return False
    args, i = sys.orig_argv[1:], 0
    while i < len(args):
        a = args[i]
        if a == "-m":
            return args[i + 1 : i + 2] in ([RUNNER[0]], [RUNNER[1]])
        if a.startswith("-m"):
            return a[2:] in RUNNER
        if not a.startswith("-") or a.startswith("-c") or a == "-":
            return False
        i += 2 if a in ("-X", "-W") else 1
    return False


def exec_if_runner() -> None:
    """In ``python -m xlatorch.compat``, replace this process with Python on the user's
    program now (``__main__.main``), before ``import xlatorch`` loads PyTorch and JAX for
    nothing (seconds per run). Elsewhere, do nothing."""
    if is_runner():
        from xlatorch.compat.__main__ import main

        main(sys.argv[1:])
