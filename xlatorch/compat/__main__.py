"""``python -m xlatorch.compat [PYTHON OPTIONS] SCRIPT [ARGS...]`` (or ``-m MODULE``, ``-c CODE``).

Runs Python on the script exactly as ``python SCRIPT ARGS...`` would (``__main__``,
``sys.argv``, ``sys.path[0]``, exit status), with ``torch_xla``, ``torch_xla_py`` and
``lazy_tensor_core`` resolving to xlatorch, in the script and in every Python process it
starts (``xmp.spawn`` / ``torch_xla.launch`` workers, DataLoader workers of any start
method, ``subprocess`` children): the stub packages of ``front/`` lead ``PYTHONPATH``,
which children inherit, and their first import installs the aliases.

The runner replaces itself with that Python (``exec``, same process id) rather than
running the script inside this process, so that xlatorch is imported at the script's own
``import torch_xla``: a script that sets ``XLA_USE_BF16`` or ``PJRT_DEVICE`` in
``os.environ`` before that import is seen doing so, as it is in the processes it spawns.
``xlatorch/__init__.py`` hands a ``python -m xlatorch.compat`` process over to ``main``
before it imports PyTorch and JAX, so the hand-over costs no import.
"""

from __future__ import annotations

import os
import subprocess
import sys

USAGE = """usage: python -m xlatorch.compat [PYTHON OPTIONS] SCRIPT [ARGS...]
       python -m xlatorch.compat [PYTHON OPTIONS] -m MODULE [ARGS...]
       python -m xlatorch.compat [PYTHON OPTIONS] -c CODE [ARGS...]

Runs a program written for torch_xla, torch_xla_py or lazy_tensor_core on xlatorch, unmodified:
those module names resolve to xlatorch in it and in every process it starts."""


def _ignores_environment(options: list[str]) -> bool:
    """Whether Python options ``-I`` / ``-E`` (alone or in a cluster such as ``-uE``) are given."""
    for o in options:
        if o.startswith("--") or o[1:2] in ("X", "W"):
            continue
        if {"I", "E"} & set(o[1:]):
            return True
    return False


def _fail(message: str):
    sys.stderr.write(message + "\n")
    raise SystemExit(2)


def command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The Python command line and environment that run ``argv`` with the aliases.

    Exits with status 2 for a missing program or Python options that would ignore
    ``PYTHONPATH`` (``-I``, ``-E``); ``-h`` prints the usage and exits.
    """
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    options, i = [], 0
    while i < len(argv) and argv[i].startswith("-") and not argv[i].startswith(("-m", "-c")):
        options.append(argv[i])  # Python's own options come before SCRIPT / -m / -c
        i += 2 if argv[i] in ("-X", "-W") else 1  # these two take the next word as their value
    if i >= len(argv):
        _fail(USAGE)
    if _ignores_environment(options) or sys.flags.ignore_environment or sys.flags.isolated:
        _fail("xlatorch.compat: -I / -E make Python ignore PYTHONPATH, which carries the aliases")
    env = dict(os.environ)
    front = os.path.join(os.path.dirname(os.path.abspath(__file__)), "front")  # xlatorch.compat.FRONT_DIR
    env["PYTHONPATH"] = os.pathsep.join([front] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # This interpreter's own flags (-u, -X dev, -W ...) carry over, as multiprocessing carries them.
    return [sys.executable, *subprocess._args_from_interpreter_flags(), *argv], env


def main(argv: list[str] | None = None) -> None:
    """Replace this process with Python running ``argv`` (this module's command line)."""
    cmd, env = command(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execve(cmd[0], cmd, env)
    raise SystemExit(subprocess.call(cmd, env=env))  # no exec elsewhere: a child, whose status is ours


if __name__ == "__main__":
    main()
