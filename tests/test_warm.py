"""tests/warm.py: a child of the warm server behaves as the fresh interpreter it stands for.

Each program runs both ways (``warm.run`` and ``subprocess.run``) and what it observes and how
it ends are compared; the programs import nothing heavy, so the real interpreter starts fast.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import atexit, json, os, sys, threading, time
def later():
    time.sleep(0.2)
    print("thread done", flush=True)
threading.Thread(target=later).start()  # not a daemon: the interpreter waits for it
atexit.register(print, "atexit ran")
main = sys.modules["__main__"]
print(json.dumps({"argv": sys.argv, "file": getattr(main, "__file__", None), "name": __name__,
                  "path0": sys.path[0], "cwd": os.getcwd(), "var": os.environ.get("WARM_PROBE"),
                  "spec": getattr(main.__spec__, "name", None), "orig": sys.orig_argv[1:]}))
sys.exit(int(os.environ.get("WARM_EXIT", "0")))
"""


def _both(args, **kw):
    kw = dict(capture_output=True, text=True, timeout=300, **kw)
    return warm.run(args, **kw), subprocess.run(args, **kw)


def _same(args, **kw):
    w, r = _both(args, **kw)
    assert (w.returncode, w.stdout, w.stderr) == (r.returncode, r.stdout, r.stderr)
    return w


@pytest.mark.parametrize("how", ["script", "-c", "-m"])
def test_a_program_sees_what_a_fresh_interpreter_gives_it(how, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = dict(os.environ, WARM_PROBE="x", WARM_EXIT="3", PYTHONPATH=str(tmp_path))
    target = {"script": ["probe.py"], "-c": ["-c", PROBE], "-m": ["-m", "probe"]}[how]
    w = _same([sys.executable, *target, "a", "b"], cwd=tmp_path, env=env)
    assert w.returncode == 3 and w.stdout.splitlines()[-2:] == ["thread done", "atexit ran"]
    assert json.loads(w.stdout.splitlines()[0])["argv"][-2:] == ["a", "b"]


@pytest.mark.parametrize(
    "code, status",
    [
        ("raise ValueError('boom')", 1),
        ("import sys; sys.exit('a message')", 1),
        ("import sys; sys.exit(None)", 0),
        ("raise KeyboardInterrupt", -signal.SIGINT),
        ("import os; os._exit(7)", 7),
    ],
)
def test_a_program_ends_as_python_ends_it(code, status):
    w = _same([sys.executable, "-c", code])
    assert w.returncode == status


def test_children_draw_their_own_random_numbers():
    code = "import random, numpy; print(random.random(), numpy.random.random())"
    a, b = (warm.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(2))
    assert a.returncode == b.returncode == 0 and a.stdout != b.stdout


def test_an_environment_read_as_python_starts_gets_a_real_interpreter():
    code = "print(hash('warm'))"
    env = dict(os.environ, PYTHONHASHSEED="7")
    w, r = _both([sys.executable, "-c", code], env=env)
    assert w.stdout == r.stdout and w.returncode == 0


def test_the_compat_runner_execs_in_place_as_a_fresh_interpreter_would(tmp_path):
    code = textwrap.dedent("""
        import sys, torch_xla
        print(sys.argv, sys.modules["__main__"].__name__, torch_xla.__name__)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    w = _same([sys.executable, "-m", "xlatorch.compat", "-c", code, "x"], cwd=tmp_path, env=env)
    assert w.returncode == 0 and w.stdout.split()[-1] == "torch_xla"


def test_a_killed_child_reports_its_signal():
    p = warm.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
                   stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout.readline() == "up\n"
    p.kill()
    assert p.wait(timeout=60) == -signal.SIGKILL
    p.stdout.close()
