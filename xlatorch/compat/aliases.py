"""The front doors' table and the meta-path finder that resolves it.

Other generations' module names resolve to xlatorch's own module objects, never to
copies: ``import torch_xla.core.xla_model as xm`` binds the very module that
``import xlatorch.core.xla_model`` binds, so state (the device, the RNG, counters) is
shared. Only the runner (``python -m xlatorch.compat``) calls ``install``; importing this
module changes nothing, so a real torch_xla beside xlatorch is never shadowed elsewhere.

What must stay true:
- Every name under a front root is claimed by the finder: mapped, or refused with
  ``ModuleNotFoundError``. Were a name left to the path finder, it would search the
  ``__path__`` of an aliased xlatorch package and load a second copy of an xlatorch module.
- An aliased package's children map to that package's own children of the same name
  (``torch_xla.core`` -> ``xlatorch.core``, so ``torch_xla.core.xla_model`` ->
  ``xlatorch.core.xla_model``): the import system sets each child as an attribute of the
  parent module, which here is the xlatorch package itself. Where an old generation's
  package has children with no such counterpart (``lazy_tensor_core.core.lazy_model``),
  the package is a front module (``FRONTS``), which only lends attributes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ROOTS = ("torch_xla", "torch_xla_py", "lazy_tensor_core")

# Packages of the old generations that are front modules: new empty packages whose other
# attributes are looked up on the module named here (None: none). Importing one imports
# that module, so ``import torch_xla`` / ``import lazy_tensor_core`` registers the device.
FRONTS: dict[str, str | None] = {
    "torch_xla": "xlatorch",
    "torch_xla_py": "xlatorch",
    "lazy_tensor_core": "xlatorch",
    "lazy_tensor_core.core": None,
}

# Old name -> xlatorch module (the same object). Checked before PREFIXES.
ALIASES: dict[str, str] = {
    "torch_xla._XLAC": "xlatorch.compat.xlac",
    # torch_xla 0.1 (torch_xla_py)
    "torch_xla_py.xla_model": "xlatorch.core.xla_model",
    "torch_xla_py.data_parallel": "xlatorch.distributed.data_parallel",
    "torch_xla_py.xla_multiprocessing": "xlatorch.distributed.xla_multiprocessing",
    "torch_xla_py.parallel_loader": "xlatorch.distributed.parallel_loader",
    # lazy_tensor_core
    "lazy_tensor_core.core.lazy_model": "xlatorch.compat.lazy_model",
    "lazy_tensor_core.utils": "xlatorch.utils",
    "lazy_tensor_core.utils.serialization": "xlatorch.utils.serialization",
    "lazy_tensor_core.debug": "xlatorch.debug",
    "lazy_tensor_core.debug.metrics": "xlatorch.debug.metrics",
    "lazy_tensor_core.distributed": "xlatorch.distributed",
    "lazy_tensor_core.distributed.parallel_loader": "xlatorch.distributed.parallel_loader",
}

# Every other name under torch_xla: the xlatorch module of the same path, if there is one.
PREFIXES: dict[str, str] = {"torch_xla.": "xlatorch."}


def target_of(name: str) -> str | None:
    """The xlatorch module that old module ``name`` resolves to (None: no mapping).

    Front modules (``FRONTS``) are not in this table: they are new modules, not aliases.
    """
    if name in ALIASES:
        return ALIASES[name]
    for old, new in PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def _exists(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent is missing or is not a package
        return False


def _missing(name: str, target: str | None) -> ModuleNotFoundError:
    where = f"it would be {target}, which xlatorch does not have" if target else "xlatorch has no counterpart for it"
    msg = (f"No module named {name!r} (python -m xlatorch.compat maps {name.partition('.')[0]} to xlatorch; "
           f"{where}; see 'Coming from torch_xla' in xlatorch's README.md)")  # fmt: skip
    return ModuleNotFoundError(msg, name=name)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as an existing xlatorch module: the import system keeps what
    ``exec_module`` leaves in ``sys.modules`` (its documented replacement case), so the
    xlatorch module's own ``__spec__``, ``__name__`` and ``__file__`` stay untouched."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)

    def get_code(self, fullname: str):
        """The xlatorch module's code: ``-m torch_xla.x.y`` (runpy) runs what ``-m xlatorch.x.y`` runs."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _FrontLoader(importlib.abc.Loader):
    """Fills a front module: an empty package that lends the attributes of ``lender``."""

    def __init__(self, lender: str | None):
        self.lender = lender

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        lender = importlib.import_module(self.lender) if self.lender else None
        module.__doc__ = f"{name} under python -m xlatorch.compat" + (f": the names of {self.lender}" if lender else "")

        def __getattr__(attr: str):
            # torch_xla._XLAC, torch_xla_py.xla_model ...: reachable without importing them first
            if f"{name}.{attr}" in ALIASES:
                return importlib.import_module(f"{name}.{attr}")
            if lender is not None and (not attr.startswith("__") or attr == "__version__"):
                return getattr(lender, attr)
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")

        def __dir__():
            return sorted(set(module.__dict__) | (set(dir(lender)) if lender is not None else set()))

        module.__getattr__ = __getattr__
        module.__dir__ = __dir__


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``torch_xla``, ``torch_xla_py`` and ``lazy_tensor_core`` names to xlatorch."""

    def find_spec(self, fullname: str, path=None, target=None):
        """A spec for an old name; raises ``ModuleNotFoundError`` for one with no counterpart."""
        if fullname.partition(".")[0] not in ROOTS:
            return None
        if fullname in FRONTS:
            lender = FRONTS[fullname]
            origin = f"front door to {lender}" if lender else "front door"
            return importlib.machinery.ModuleSpec(fullname, _FrontLoader(lender), origin=origin, is_package=True)
        new = target_of(fullname)
        if new is None or not _exists(new):
            raise _missing(fullname, new)
        # origin: the file runpy names as sys.argv[0] for ``-m torch_xla.x.y``
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new), origin=importlib.util.find_spec(new).origin)


def installed() -> bool:
    """Whether this process resolves the old names (only the runner's processes do)."""
    return any(isinstance(f, AliasFinder) for f in sys.meta_path)


def install() -> None:
    """Resolve the old names to xlatorch in this process, ahead of every other finder.

    Idempotent. Called by the runner and, in the processes it starts, by the stub packages
    of ``front/`` on their first import.
    """
    if not installed():
        sys.meta_path.insert(0, AliasFinder())


def replace_stub(name: str) -> None:
    """Called by a stub package of ``front/`` while it is being imported: install the
    finder and leave the front module in ``sys.modules`` in the stub's place."""
    install()
    del sys.modules[name]  # the stub; the same thread holds the import lock, so this import re-enters
    sys.modules[name] = importlib.import_module(name)
    if name == "torch_xla":
        _patch_like_torch_xla()


def _patch_like_torch_xla() -> None:
    """What ``import torch_xla`` does to torch: ``nn.GRU`` becomes its scan GRU
    (``torch_xla.experimental.gru.GRU``; the original stays as ``nn.GRU._orig``)."""
    import torch.nn as nn

    from xlatorch.experimental.gru import GRU

    if nn.GRU is not GRU:
        nn.GRU = GRU
