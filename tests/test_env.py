"""Environment variables: one parser (``xlatorch/runtime/base/config.py``), checked at import.

A value a variable does not accept stops ``import xlatorch`` with an error that names the
variable and what it accepts; switches take ``false``/``off``/``no`` as well as ``0``. A
platform that cannot start and a profile directory that cannot be written say so clearly;
the profile's never stops the program. Programs run in subprocesses: the environment is read
when xlatorch is imported.
"""

import glob
import os
import re
import sys
import textwrap

import pytest

from tests import warm
from xlatorch.runtime.base import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STEPS = """
import torch, xlatorch
import xlatorch.core.xla_model as xm
print("imported", flush=True)
x = torch.ones(4, 4).to("xla")
for i in range(8):
    x = x * 2
    xm.mark_step()
print("result", x.sum().item())
"""


_OURS = re.compile(r"(XLATORCH|XLA|PJRT|LTC|PT_XLA)_|CPU_NUM_DEVICES$")


def _run(code: str, **env):
    e = {k: v for k, v in os.environ.items() if not _OURS.match(k) or k in ("XLA_FLAGS", "XLATORCH_CACHE_DIR")}
    e.update(env, PYTHONPATH=ROOT)
    return warm.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                    timeout=300)  # fmt: skip


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("XLATORCH_EXECUTABLE_CACHE_SIZE", "-5", "a whole number >= 1"),
        ("XLATORCH_EXECUTABLE_CACHE_SIZE", "bogus", "a whole number >= 1"),
        ("XLATORCH_CHECKS", "bogus", "sync, or 1/0, true/false, yes/no or on/off"),
        ("XLATORCH_HOIST_BIRTHS", "maybe", "1/0, true/false, yes/no or on/off"),
        ("XLATORCH_PROFILE_STEPS", "5:2", "START:STOP"),
        ("XLATORCH_RENDEZVOUS_TIMEOUT", "soon", "a number of seconds > 0"),
    ],
)  # fmt: skip
def test_a_value_not_accepted_stops_the_import_naming_the_variable(name, value, accepted):
    r = _run(_STEPS, **{name: value})
    assert r.returncode == 1 and "imported" not in r.stdout, r.stdout + r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: xlatorch: {name}={value!r} is not accepted: expected "), last
    assert accepted in last, last


_SWITCHES_CODE = """
    import gc, signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a background job ignores it)
    import torch, xlatorch
    from xlatorch.runtime.base import config
    from xlatorch.runtime.plan import births
    deferred = signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    print(births.ENABLED, gc.get_freeze_count() > 0, deferred, config.CHECKS)
"""
_SWITCHES = ("XLATORCH_HOIST_BIRTHS", "XLATORCH_GC_FREEZE", "XLATORCH_DEFER_SIGINT", "XLATORCH_CHECKS")


def test_switches_are_on_by_default():
    r = _run(_SWITCHES_CODE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True"] * 4


@pytest.mark.parametrize("off", ["0", "false", "False", "off", "no"])
def test_switches_turn_off_with_any_false_word(off):
    r = _run(_SWITCHES_CODE, **dict.fromkeys(_SWITCHES, off))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False"] * 4


def test_the_modules_a_first_step_imports_are_frozen_at_import():
    # torch imports Dynamo and DTensor lazily, JAX its MLIR dialects: at a program's first step
    # anyway. Imported after the freeze, their objects stayed in the collector's view and every
    # full collection walked them (25-50 ms against 0.6 after a first step).
    code = """
        import gc, types
        import torch, xlatorch
        import torch._dynamo.variables.builder as b  # a module of Dynamo's
        seen = [f for f in gc.get_objects() if type(f) is types.FunctionType]
        print(sum(f.__module__ == b.__name__ for f in seen), len(seen) < 20000)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["0", "True"], r.stdout


def test_each_variable_is_parsed_once_by_its_table_entry(monkeypatch):
    cases = {
        "XLA_USE_BF16": [("yes", False), ("2", True), ("TRUE", True), ("", False)],  # torch_xla's reading
        "XLATORCH_DEBUG": [("2", 2), ("on", 1), ("off", 0), ("", None)],
        "XLATORCH_CACHE_DIR": [("", ""), ("/c", "/c")],  # empty: the cache is off
        "XLATORCH_XLA_OPTIONS": [("", {}), ("a=1, b=false, c=x", {"a": 1, "b": False, "c": "x"})],
        "XLATORCH_PROFILE_STEPS": [("2:4", (2, 4)), ("", (0, 5))],
        "PJRT_DEVICE": [("gpu", "GPU"), (" cpu ", "CPU")],
        "XLATORCH_COORDINATOR": [("host:1234", "host:1234")],
    }
    for name, pairs in cases.items():
        for value, want in pairs:
            monkeypatch.setenv(name, value)
            assert config.env(name) == want, (name, value)
    monkeypatch.setenv("XLATORCH_XLA_OPTIONS", "fusion")
    with pytest.raises(ValueError, match="XLATORCH_XLA_OPTIONS: 'fusion' is not name=value"):
        config.env("XLATORCH_XLA_OPTIONS")
    monkeypatch.delenv("XLATORCH_XLA_OPTIONS")
    monkeypatch.setenv("XLATORCH_COORDINATOR", "host")
    with pytest.raises(ValueError, match="XLATORCH_COORDINATOR='host' is not accepted: expected HOST:PORT"):
        config.check()


def test_every_variable_xlatorch_names_is_in_the_table():
    names = set()
    for path in glob.glob(os.path.join(ROOT, "xlatorch", "**", "*.py"), recursive=True):
        if path.endswith(os.path.join("core", "xla_env_vars.py")):  # torch_xla's list of names, as constants
            continue
        names |= set(re.findall(r"\b(?:XLATORCH|XLA|PJRT|LTC|PT_XLA)_[A-Z0-9_]+\b", open(path).read()))
    table = open(os.path.join(ROOT, "docs", "README.md")).read().split("## Environment variables")[1]
    names |= set(re.findall(r"`((?:XLATORCH|XLA|PJRT|LTC|PT_XLA|CPU)_[A-Z0-9_]+)", table))
    names -= {"XLA_FLAGS", "XLA_LIB"}  # XLA's own, read by XLA; xm.XLA_LIB is torch's op library
    assert names <= set(config.VARS), sorted(names - set(config.VARS))


def _has_cuda() -> bool:
    from jax._src import hardware_utils, xla_bridge

    xla_bridge._discover_and_register_pjrt_plugins()
    return "cuda" in xla_bridge._backend_factories and hardware_utils.has_visible_nvidia_gpu()


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("name", ["CUDA", "GPU"])
def test_a_cuda_device_that_is_not_there_is_a_clear_error(name):
    r = _run(_STEPS, PJRT_DEVICE=name)
    assert r.returncode == 1 and "AssertionError" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: xlatorch: PJRT_DEVICE={name} asks for a CUDA device, but none is available")
    assert "pip install -e '.[cuda]'" in last and "PJRT_DEVICE=CPU" in last


def test_an_unwritable_profile_directory_is_reported_and_the_program_goes_on(tmp_path):
    (tmp_path / "file").write_text("")
    profile = tmp_path / "file" / "profile"  # under a file: no one can write there, root included
    r = _run(_STEPS, XLATORCH_PROFILE=str(profile))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["imported", "result 4096.0"]
    assert f"xlatorch: XLATORCH_PROFILE={profile}: a profile cannot be written to" in r.stderr


def test_a_profile_that_cannot_be_written_when_it_stops_is_reported_and_the_program_goes_on(tmp_path):
    profile = tmp_path / "profile"
    # The directory becomes a file while the steps are captured.
    swap = f"import shutil; shutil.rmtree({str(profile)!r}); open({str(profile)!r}, 'w')"
    code = _STEPS.replace("    xm.mark_step()\n", f"    xm.mark_step()\n    if i == 1:\n        {swap}\n")
    r = _run(code, XLATORCH_PROFILE=str(profile))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["imported", "result 4096.0"]
    assert f"xlatorch: the profile could not be written to {profile}" in r.stderr


def test_start_trace_checks_its_directory_at_once(tmp_path):
    import xlatorch.debug.profiler as xp

    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="a profile cannot be written to"):
        xp.start_trace(tmp_path / "file" / "profile")
    assert not xp.ACTIVE
