"""Regenerate generated/ from ops.yaml; ``--check`` fails when generated/ is stale.

Usage: python tools/gen_ops.py [--check]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from codegen.gen import render  # noqa: E402
from codegen.registry import RegistryError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if generated/ differs from a fresh render")
    ap.add_argument("--ops", default=os.path.join(ROOT, "ops.yaml"))
    ap.add_argument("--out", default=os.path.join(ROOT, "generated"))
    a = ap.parse_args(argv)
    try:
        files = render(a.ops)
    except RegistryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = []
    for name, text in files.items():
        path = os.path.join(a.out, name)
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            stale.append(name)
            if not a.check:
                with open(path, "w") as f:
                    f.write(text)
    if a.check and stale:
        print(f"generated/ is stale ({', '.join(stale)}): run python tools/gen_ops.py", file=sys.stderr)
        return 1
    changed = f" ({len(stale)} changed)" if stale and not a.check else ""
    print(f"{'checked' if a.check else 'wrote'} {len(files)} files in generated/{changed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
