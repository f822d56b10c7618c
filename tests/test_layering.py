"""The package's imports follow the pipeline (ARCHITECTURE.md, "Layering"), read with ``ast``
(imports inside functions included).

The runtime records and the debug tools report: nothing under ``xlatorch/runtime/`` imports
``xlatorch.debug``, ``xlatorch.core``, ``xlatorch.distributed``, ``xlatorch.fallback`` or
``xlatorch.compat``; only the package root imports ``xlatorch.compat``;
``runtime/base/record.py`` imports nothing of xlatorch. Inside the runtime, a stage imports
only the stages before it (``STAGES``, in processing order) and its own; no two files of the
package import each other, directly or through others.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xlatorch")
ABOVE_RUNTIME = ("xlatorch.debug", "xlatorch.core", "xlatorch.distributed", "xlatorch.fallback", "xlatorch.compat")


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, module: str) -> set[str]:
    """Every xlatorch module ``path`` imports, wherever the import statement is."""
    found = set()
    modules = _modules()
    for n in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:  # relative: resolve against the importing package
                parts = module.split(".")[: -n.level] if not path.endswith("__init__.py") else module.split(".")
                base = ".".join(parts + ([n.module] if n.module else []))
            names = [f"{base}.{a.name}" for a in n.names]
            if not all(m in modules for m in names):  # ``from pkg import module`` reads the module, not pkg
                found.add(base)
            found.update(names)
    return {m for m in found if m == "xlatorch" or m.startswith("xlatorch.")}


def _owner(module: str, modules) -> str:
    """The file a dotted name lives in: the module itself, or the module defining that name."""
    while module not in modules:
        module = module.rpartition(".")[0]
    return module


def _folder(module: str) -> str | None:
    """The top-level folder of the package a module lives in (None for ``xlatorch/__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and os.path.isdir(os.path.join(PKG, parts[1]))) else None


def test_the_runtime_imports_nothing_above_it():
    bad = []
    for mod, path in _modules().items():
        if mod.startswith("xlatorch.runtime"):
            bad += [f"{mod} imports {m}" for m in sorted(_imports(path, mod)) if m.startswith(ABOVE_RUNTIME)]
    assert not bad, "\n".join(bad)


def test_only_the_package_root_uses_the_front_doors():
    # xlatorch.compat sits on top of everything: only xlatorch/__init__ (which hands a
    # ``python -m xlatorch.compat`` process to the runner before loading anything) imports it.
    bad = []
    for mod, path in _modules().items():
        if mod != "xlatorch" and not mod.startswith("xlatorch.compat"):
            bad += [f"{mod} imports {m}" for m in sorted(_imports(path, mod)) if m.startswith("xlatorch.compat")]
    assert not bad, "\n".join(bad)
    assert "xlatorch.compat" in _imports(_modules()["xlatorch"], "xlatorch")  # the walk sees the root's import


def test_the_recording_module_is_the_bottom():
    path = _modules()["xlatorch.runtime.base.record"]
    assert not _imports(path, "xlatorch.runtime.base.record")


# The runtime's stages in processing order (runtime/README.md); ``device`` and the package
# itself (``xr``) sit on top of them all.
STAGES = ("base", "ir", "trace", "plan", "lower", "multi", "execute")


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["xlatorch", "runtime"]:
        return None
    return STAGES.index(parts[2]) if len(parts) > 3 and parts[2] in STAGES else len(STAGES)


def test_runtime_stages_import_only_earlier_stages():
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        s = _stage(mod)
        if s is None:
            continue
        for m in sorted(_imports(path, mod)):
            t = _stage(_owner(m, modules))
            if t is not None and t > s:
                bad.append(f"{mod} ({STAGES[s] if s < len(STAGES) else 'top'}) imports {m}")
    assert not bad, "\n".join(bad)
    seen = {mod.split(".")[2] for mod in modules if _stage(mod) is not None and _stage(mod) < len(STAGES)}
    assert seen == set(STAGES)  # every stage is a folder the walk saw


def test_no_import_circle_between_files():
    modules = _modules()
    edges = defaultdict(set)
    for mod, path in modules.items():
        for m in _imports(path, mod):
            dst = _owner(m, modules)
            if dst != mod and dst != "xlatorch":  # every module imports its package root first
                edges[mod].add(dst)
    assert "xlatorch.runtime.execute.sync" in edges["xlatorch.runtime.execute.materialize"]  # the walk found imports
    cycle = _cycle(edges)
    assert cycle is None, "import circle between files: " + " -> ".join(cycle)


def _cycle(edges) -> list[str] | None:
    """A cycle in ``{node: {node, ...}}`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_circle_between_top_level_folders():
    edges = defaultdict(set)
    for mod, path in _modules().items():
        src = _folder(mod)
        for m in _imports(path, mod):
            dst = _folder(m)
            if src and dst and dst != src:
                edges[src].add(dst)
    assert "runtime" in edges["debug"]  # the walk found the package's imports
    cycle = _cycle(edges)
    assert cycle is None, "import circle between folders: " + " -> ".join(cycle)


def test_the_circle_search_finds_circles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
