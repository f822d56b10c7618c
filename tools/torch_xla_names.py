"""Which of torch_xla's public names xlatorch has, and how often torch_xla's users call them.

Reads torch_xla's sources from a git checkout or bare mirror (``git show``, nothing is
written), collects each public module's public names with ``ast`` (top-level functions,
classes, assignments and names re-exported from the package's own modules), and looks
each one up on the xlatorch module that ``python -m xlatorch.compat`` maps that module to
(``xlatorch.compat.aliases.target_of``). Uses are counted in torch_xla's ``test/``,
``docs/`` and ``examples/``: ``alias.name`` for every alias a file binds to the module
(``import torch_xla.core.xla_model as xm``, plus the customary ones: ``xm``, ``xr``,
``xs`` ...), and each later mention of a name a file imports with ``from M import name``.
``torch_xla._XLAC`` has no Python source: its names are those that torch_xla's own Python
calls (``_XLAC._name``).

Usage::

    python tools/torch_xla_names.py [--repo PATH] [--min-uses 5] [--all]

Prints, per module, names present / total (core modules first), then every missing name
used ``--min-uses`` times or more, most used first.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

MIRROR = "/work/.mirror/pytorch+xla/repo"

# The modules torch_xla's guides teach, whose coverage the goal is measured on.
CORE = (
    "torch_xla",
    "torch_xla.core.xla_model",
    "torch_xla.runtime",
    "torch_xla.debug.metrics",
    "torch_xla.debug.profiler",
    "torch_xla.distributed.spmd",
    "torch_xla.distributed.parallel_loader",
    "torch_xla.distributed.xla_multiprocessing",
    "torch_xla.utils.serialization",
    "torch_xla.utils.utils",
    "torch_xla.amp",
    "torch_xla.amp.syncfree",
    "torch_xla.stablehlo",
    "torch_xla.backends",
    "torch_xla.utils.checkpoint",
)

# Aliases torch_xla's docs use without an import line in the same file.
CUSTOMARY = {
    "xm": "torch_xla.core.xla_model",
    "xr": "torch_xla.runtime",
    "xs": "torch_xla.distributed.spmd",
    "met": "torch_xla.debug.metrics",
    "xp": "torch_xla.debug.profiler",
    "xmp": "torch_xla.distributed.xla_multiprocessing",
    "pl": "torch_xla.distributed.parallel_loader",
    "xu": "torch_xla.utils.utils",
    "xser": "torch_xla.utils.serialization",
    "xb": "torch_xla.core.xla_builder",
    "xor": "torch_xla.core.xla_op_registry",
    "xf": "torch_xla.core.functions",
    "torch_xla": "torch_xla",
    "_XLAC": "torch_xla._XLAC",
}


@dataclass
class Module:
    name: str
    names: set[str] = field(default_factory=set)


class Repo:
    def __init__(self, path: str):
        self.path = path
        cmd = ["git", "-C", path, "ls-tree", "-r", "--name-only", "HEAD"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        self.files = out.stdout.split()
        self._set = set(self.files)

    def show(self, path: str) -> str:
        out = subprocess.run(["git", "-C", self.path, "show", f"HEAD:{path}"], capture_output=True, check=True)
        return out.stdout.decode("utf-8", "replace")

    def is_module(self, dotted: str) -> bool:
        p = dotted.replace(".", "/")
        return f"{p}.py" in self._set or f"{p}/__init__.py" in self._set


def module_name(path: str) -> str:
    mod = path[: -len(".py")].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def public_modules(repo: Repo) -> list[str]:
    mods = []
    for f in repo.files:
        if not (f.startswith("torch_xla/") and f.endswith(".py")):
            continue
        mod = module_name(f)
        if any(part.startswith("_") for part in mod.split(".")[1:]) and mod != "torch_xla._dynamo":
            continue
        mods.append(mod)
    return sorted(mods)


def _package(mod: str, path: str) -> str:
    return mod if path.endswith("__init__.py") else mod.rpartition(".")[0]


def public_names(repo: Repo, mod: str, seen: frozenset = frozenset()) -> set[str]:
    """Top-level public defs, classes, assignments and relative re-exports of ``mod``."""
    p = mod.replace(".", "/")
    path = f"{p}/__init__.py" if f"{p}/__init__.py" in repo._set else f"{p}.py"
    tree = ast.parse(repo.show(path))
    pkg = _package(mod, path)
    names: set[str] = set()

    def walk(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                src = f"{base}.{node.module}" if node.module else base
                for a in node.names:
                    if a.name == "*":
                        if src not in seen and repo.is_module(src):
                            names.update(public_names(repo, src, seen | {mod}))
                    elif not repo.is_module(f"{src}.{a.name}"):
                        names.add(a.asname or a.name)
            elif isinstance(node, (ast.If, ast.Try)):
                walk(node.body)
                walk(getattr(node, "orelse", []))

    walk(tree.body)
    return {n for n in names if not n.startswith("_") and n != "logger"}


def xlac_names(repo: Repo) -> set[str]:
    names: set[str] = set()
    for f in repo.files:
        if f.startswith("torch_xla/") and f.endswith(".py"):
            names.update(re.findall(r"\b_XLAC\.(_\w+)", repo.show(f)))
    return names


_IMPORT_AS = re.compile(r"^\s*import\s+(torch_xla[\w.]*)\s+as\s+(\w+)", re.M)
_FROM_AS = re.compile(r"^\s*from\s+(torch_xla[\w.]*)\s+import\s+(\w+)\s+as\s+(\w+)", re.M)
_FROM = re.compile(r"^\s*from\s+(torch_xla[\w.]*)\s+import\s+\(?([\w\s,]+)\)?", re.M)


def count_uses(repo: Repo, modules: dict[str, Module]) -> dict[str, Counter]:
    uses: dict[str, Counter] = {m: Counter() for m in modules}
    docs = [
        f
        for f in repo.files
        if f.split("/")[0] in ("test", "docs", "examples") and f.endswith((".py", ".md", ".rst", ".ipynb"))
    ]
    for f in docs:
        text = repo.show(f)
        aliases = dict(CUSTOMARY)
        for mod, alias in _IMPORT_AS.findall(text):
            aliases[alias] = mod
        for pkg, sub, alias in _FROM_AS.findall(text):
            if repo.is_module(f"{pkg}.{sub}"):
                aliases[alias] = f"{pkg}.{sub}"
        for alias, mod in aliases.items():
            if mod not in modules:
                continue
            for name in re.findall(rf"(?<![\w.]){re.escape(alias)}\.(\w+)", text):
                if name in modules[mod].names:
                    uses[mod][name] += 1
        for mod in modules:  # fully dotted, without an alias
            for name in re.findall(rf"\b{re.escape(mod)}\.(\w+)", text):
                if name in modules[mod].names:
                    uses[mod][name] += 1
        for mod, names in _FROM.findall(text):
            if mod not in modules:
                continue
            for name in re.split(r"[\s,]+", names.strip()):
                if name in modules[mod].names:
                    uses[mod][name] += max(1, len(re.findall(rf"(?<![\w.]){name}\b", text)) - 1)
    return uses


def xlatorch_has(mod: str, name: str) -> bool:
    sys.path.insert(0, ".")
    from xlatorch.compat.aliases import target_of

    target = {"torch_xla": "xlatorch", "torch_xla.torch_xla": "xlatorch"}.get(mod) or target_of(mod)
    try:
        m = importlib.import_module(target)
    except Exception:
        return False
    return hasattr(m, name)


def collect(repo: Repo, only: list[str] | None = None) -> tuple[dict[str, Module], dict[str, Counter]]:
    """Every public module's names (``only``: just those modules) and their uses."""
    modules = {}
    for mod in only or public_modules(repo):
        if mod == "torch_xla.torch_xla":  # its names are torch_xla's (``from .torch_xla import *``)
            continue
        try:
            modules[mod] = Module(mod, public_names(repo, mod))
        except (SyntaxError, subprocess.CalledProcessError):
            continue
    if only is None or "torch_xla._XLAC" in only:
        modules["torch_xla._XLAC"] = Module("torch_xla._XLAC", xlac_names(repo))
    return modules, count_uses(repo, modules)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=MIRROR)
    ap.add_argument("--min-uses", type=int, default=5)
    ap.add_argument("--all", action="store_true", help="list every missing name, not only the used ones")
    args = ap.parse_args(argv)
    modules, uses = collect(Repo(args.repo))
    missing_used = []
    tot = {"core": [0, 0], "other": [0, 0]}
    order = sorted(modules, key=lambda m: (m not in CORE, m))
    print(f"{'module':58} {'have':>5} / {'all':>4}  {'uses':>5}")
    for mod in order:
        m = modules[mod]
        have = {n for n in m.names if xlatorch_has(mod, n)}
        kind = "core" if mod in CORE else "other"
        tot[kind][0] += len(have)
        tot[kind][1] += len(m.names)
        mark = "  core" if kind == "core" else ""
        print(f"{mod:58} {len(have):5} / {len(m.names):4}  {sum(uses[mod].values()):5}{mark}")
        for n in m.names - have:
            if uses[mod][n] >= args.min_uses or args.all:
                missing_used.append((uses[mod][n], mod, n))
    for kind, (h, t) in tot.items():
        print(f"{kind} modules: {h} / {t} = {100 * h / max(t, 1):.1f}%")
    print(f"\nmissing names used >= {args.min_uses} times in test/, docs/, examples/:")
    for n_uses, mod, n in sorted(missing_used, reverse=True):
        print(f"{n_uses:5}  {mod}.{n}")


if __name__ == "__main__":
    main()
