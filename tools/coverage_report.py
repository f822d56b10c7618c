"""Which ATen ops a program sends to CPU, how often and from where; and static op coverage.

Usage:
  python -m tools.coverage_report [--] script.py [args...]     run a script, report its fallbacks
  python -m tools.coverage_report -- python train.py [args...] any command (subprocesses too)
  python -m tools.coverage_report --static [--all]             ops by status, core ATen coverage
  python -m tools.coverage_report --static FILE.py:FACTORY      what a model's step would send to CPU, cut or
                                                                recompile, without running it (xlatorch.check)
  tools/coverage_report script.py                               the same, as an executable

A program's fallbacks are collected by xlatorch itself: with ``XLATORCH_FALLBACK_REPORT=<file>``
set, every process appends its fallback records (op, count, first user source line) to the
file at exit; this tool sets it, runs the command, and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STATUSES = ("lowered", "decomposed", "fallback", "unlisted")


def op_status() -> dict[str, str]:
    """``{"op.overload": status}`` for every ATen overload in torch's native_functions.yaml.

    ``lowered``: a generated shim (including in-place / out= variants), a runtime handler,
    or answered from metadata; ``decomposed``: PyTorch's decomposition into lowered ops;
    ``fallback``: a declared CPU fallback; ``unlisted``: not in ops.yaml (falls back).
    """
    from xlatorch._generated import dispatch as table

    import xlatorch  # noqa: F401  (fills the dispatch tables)
    from codegen import registry, schema
    from xlatorch.runtime.trace.dispatch import RUNTIME_OPS

    def name(op) -> str:
        return op._schema.name.removeprefix("aten::") + "." + op._overloadname

    schemas = schema.load()[0]
    status = dict.fromkeys(schemas, "unlisted")
    for op in list(table.SHIMS) + list(RUNTIME_OPS):
        status[name(op)] = "lowered"
    for op in table.DECOMPOSED:
        status[name(op)] = "decomposed"
    for op in table.FALLBACKS:
        status[name(op)] = "fallback"
    for e in registry.load(os.path.join(ROOT, "ops.yaml"), schemas):
        if e.dispatch == "metadata":
            status[e.name] = "lowered"
    return status


def core_coverage() -> tuple[int, int, list[str]]:
    """(covered, total, uncovered names) over the overloads tagged ``core``: lowered or decomposed."""
    from codegen import schema

    schemas = schema.load()[0]
    status = op_status()
    core = sorted(n for n, s in schemas.items() if "core" in s.tags)
    missing = [n for n in core if status[n] not in ("lowered", "decomposed")]
    return len(core) - len(missing), len(core), missing


def print_static(show_all: bool) -> None:
    status = op_status()
    by = defaultdict(list)
    for n, s in sorted(status.items()):
        by[s].append(n)
    covered, total, missing = core_coverage()
    print(f"ATen overloads: {len(status)}")
    for s in STATUSES:
        print(f"  {s:<11}{len(by[s]):>6}")
    print(f"core ATen coverage: {covered}/{total} = {100.0 * covered / total:.1f}% (lowered or decomposed)")
    if missing:
        print("core overloads not covered: " + " ".join(missing))
    for s in ("decomposed", "fallback") + (("lowered",) if show_all else ()):
        print(f"\n{s}:")
        for n in by[s]:
            print(f"  {n}")


def _listed_ops() -> dict[str, str]:
    """``{op name: "listed" / "declared fallback"}`` for ops with any ops.yaml entry."""
    from codegen import registry, schema

    out = {}
    for e in registry.load(os.path.join(ROOT, "ops.yaml"), schema.load()[0]):
        out.setdefault(e.schema.op, "declared fallback" if e.fallback is not None else "listed")
    return out


def read_records(path: str) -> dict[str, dict]:
    """Merge the JSON lines every process wrote: ``{op: {"count", "origin"}}``."""
    merged: dict[str, dict] = {}
    if not os.path.exists(path):
        return merged
    with open(path) as f:
        for line in f:
            for op, rec in json.loads(line).items():
                m = merged.setdefault(op, {"count": 0, "origin": rec["origin"]})
                m["count"] += rec["count"]
    return merged


def format_table(records: dict[str, dict]) -> str:
    """The fallback table: op, count, first user source line, planned (listed) or missing."""
    if not records:
        return "No op fell back to CPU."
    listed = _listed_ops()
    rows = []
    for op, rec in sorted(records.items(), key=lambda kv: -kv[1]["count"]):
        base = op.removeprefix("aten::").split(".")[0]
        rows.append((op, str(rec["count"]), rec["origin"] or "?", listed.get(base, "missing")))
    head = ("op", "count", "first called from", "lowering")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    total = sum(rec["count"] for rec in records.values())
    lines.append(f"{len(records)} ops fell back to CPU, {total} calls in all.")
    return "\n".join(lines)


def run(cmd: list[str]) -> tuple[int, dict[str, dict]]:
    """Run ``cmd`` (a script and its args, or a full command) and collect its fallbacks."""
    if cmd and cmd[0].endswith(".py"):
        cmd = [sys.executable] + cmd
    fd, path = tempfile.mkstemp(prefix="xlatorch-fallbacks-", suffix=".jsonl")
    os.close(fd)
    try:
        env = dict(os.environ, XLATORCH_FALLBACK_REPORT=path)
        rc = subprocess.call(cmd, env=env)
        return rc, read_records(path)
    finally:
        os.unlink(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="coverage_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--static", action="store_true", help="list ATen ops by status and the core coverage")
    ap.add_argument("--all", action="store_true", help="with --static: also list every lowered overload")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="script.py [args] or -- command [args]")
    a = ap.parse_args(argv)
    if a.static and a.cmd:
        from xlatorch.check import main as check_main

        return check_main(a.cmd)
    if a.static:
        print_static(a.all)
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give a script to run, or --static")
    rc, records = run(cmd)
    print("\n== xlatorch CPU fallbacks ==")
    print(format_table(records))
    return rc


if __name__ == "__main__":
    sys.exit(main())
