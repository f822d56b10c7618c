"""A process ends with its own exit status, whatever the device is still doing.

Each test runs a program in a subprocess that ends while device work is in flight (its last
step's execution, a step closure, a thread's steps). Before xlatorch waited for that work at
exit, Python's finalization ended the threads waiting inside jaxlib with ``pthread_exit``
and the process aborted ("terminate called after throwing an instance of ''", status 134)
after all its work had succeeded. The programs make each step long (most of a second of matmuls) so
that it is still running when the program ends (milliseconds after it starts); their outcome
does not depend on how long.
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import threading, torch
import xlatorch.core.xla_model as xm
dev = xm.xla_device()

def long_step(t):  # 0.7 s of matmuls for a 2048 x 2048 t on 2 slow cores: running when the program ends
    for _ in range(5):
        t = t @ t * 0.001 + 1
    return t
"""


def _run(*parts: str):
    code = _PRELUDE + "".join(textwrap.dedent(p) for p in parts)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _no_abort(r) -> str:
    assert "terminate called" not in r.stderr and "FATAL" not in r.stderr, r.stderr[-3000:]
    return r.stderr


def test_a_program_that_ends_while_its_last_step_runs_exits_0():
    r = _run("""
        t = long_step(torch.ones(2048, 2048, device=dev))
        xm.mark_step()
        print("stepped")
    """)
    _no_abort(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "stepped"


def test_an_uncaught_exception_after_a_step_exits_1_with_its_traceback():
    r = _run("""
        t = long_step(torch.ones(2048, 2048, device=dev))
        xm.mark_step()
        raise ValueError("the program's own error")
    """)
    err = _no_abort(r)
    assert r.returncode == 1, err[-3000:]
    assert err.rstrip().endswith("ValueError: the program's own error")


def test_a_pending_async_step_closure_runs_before_the_process_exits_0():
    r = _run("""
        t = long_step(torch.ones(2048, 2048, device=dev))
        xm.add_step_closure(lambda t: print("closure got", tuple(t.shape)), args=(t,), run_async=True)
        xm.add_step_closure(lambda: print("closure ran"), run_async=True)  # neither waits for the step
        xm.mark_step()
    """)
    _no_abort(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["closure got (2048, 2048)", "closure ran"]


def test_an_async_step_closure_that_fails_at_exit_is_the_exit_status():
    r = _run("""
        t = long_step(torch.ones(2048, 2048, device=dev))
        def fail():
            raise KeyError("the closure failed")
        xm.add_step_closure(fail, run_async=True)
        xm.mark_step()
        print("stepped")
    """)
    err = _no_abort(r)
    assert r.stdout.strip() == "stepped"
    assert r.returncode == 1, err[-3000:]
    assert "KeyError: 'the closure failed'" in err


# A daemon thread that never ends trains while the main thread ends, once it has stepped.
_DAEMON = """
stepped = threading.Event()
def train():
    try:
        while True:
            step()
            xm.mark_step()
            stepped.set()
    finally:  # an error here: the main thread goes on, and the test sees the traceback
        stepped.set()
threading.Thread(target=train, daemon=True).start()
stepped.wait()
print("main done")
"""


def test_a_daemon_thread_stepping_when_the_program_ends_exits_0():
    r = _run(
        """
        t = torch.ones(2048, 2048, device=dev)
        def step():
            global t
            t = long_step(t)
        """,
        _DAEMON,
    )
    assert "Traceback" not in _no_abort(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "main done"


def test_a_daemon_thread_in_a_backward_pass_when_the_program_ends_exits_0():
    r = _run(
        """
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).to(dev)
        x = torch.ones(2048, 2048, device=dev)
        def step():  # the backward pass's ops run on autograd's device thread
            model(long_step(x)[:, :512]).sum().backward()
        """,
        _DAEMON,
    )
    assert "Traceback" not in _no_abort(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "main done"
