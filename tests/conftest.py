import atexit
import compileall
import multiprocessing
import os
import shutil
import sys
import tempfile
import zlib

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
# The persistent compilation cache of a test run lives and dies with it (subprocesses share it).
if "XLATORCH_CACHE_DIR" not in os.environ:
    os.environ["XLATORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="xlatorch-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XLATORCH_CACHE_DIR"], True)
# Under PYTHONDONTWRITEBYTECODE (some containers set it) no import writes bytecode, so every
# process a test starts compiled the project's ~200 modules from source: 3.2 s against 4.1 s
# for ``import xlatorch`` (medians of ten, alternating). Written here once (an unchanged file
# is skipped), into the usual __pycache__ folders; imports read them whatever the variable says.
if sys.dont_write_bytecode:  # otherwise imports write it themselves
    for _folder in ("xlatorch", "generated", "tests", "examples", "bench", "codegen", "tools"):
        compileall.compile_dir(os.path.join(_ROOT, _folder), quiet=2)

import xlatorch  # noqa: E402,F401
import xlatorch.debug.metrics as met  # noqa: E402
from tests import warm  # noqa: E402

# Jobs that tests start in this process (``xmp.spawn(..., start_method="forkserver")``) fork
# their workers from one server per test process that has imported torch, Dynamo and JAX
# (not xlatorch: its import reads the job's variables): a ``spawn`` worker spends 5-6 s of
# CPU importing them, a job's two at once. ``spawn``, the default, stays in the guide's own
# program (test_distributed's ``test_guide_mnist_with_two_processes[spawn]``), the guides'
# snippets (test_compat) and test_faults' killed launcher (which tries all three methods);
# test_multihost's launchers, warm children with no backend started, ``fork`` theirs.
multiprocessing.set_forkserver_preload(list(warm.PRELOAD))

# ``torch.manual_seed`` queues a seed for CUDA, XPU and MTIA until they start, formatting the
# Python stack at each call (``torch/cuda/__init__.py: _lazy_call``): 1.9 ms a call under
# pytest's stack, and OpInfo's sample generators seed about five times a test. Without those
# devices the queued seed is never applied, so the test run does not queue it.
for _backend in (torch.cuda, torch.xpu, torch.mtia):
    if not _backend.is_available():
        _backend.manual_seed_all = lambda seed: None


def _dispatch_state() -> tuple:
    """The calling thread's dispatch state a test must leave as it found it (a leaked key,
    mode or vmap level makes a later test fail far from its cause)."""
    c = torch._C
    return (str(c._dispatch_tls_local_include_set()), str(c._dispatch_tls_local_exclude_set()),
            c._functorch.peek_interpreter_stack() is None, c._len_torch_function_stack(),
            c._len_torch_dispatch_stack(), torch.is_grad_enabled())  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_metrics(request):
    import xlatorch.core.xla_model as xm

    xm.mark_step()
    met.clear_all()
    # Random inputs depend on the test, not on which tests ran before it in this process (an
    # OpInfo's error input of random probabilities was refused for a negative one, or not).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    before = _dispatch_state()
    yield
    after = _dispatch_state()
    torch.set_default_device(None)
    from xlatorch.runtime.execute import settle

    try:
        settle.settle()  # a failed on-device check the test left unread fails that test, not the next
    finally:
        settle._THREAD[0] = None  # a test's threads do not make the next test read its checks at once
    assert after == before, "the test leaked dispatch state (keys, modes, vmap levels, grad mode)"


@pytest.fixture
def fresh_dynamo():
    """torch.compile's tests start and end with Dynamo's caches and counters empty."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def debug_level_0(monkeypatch):
    """Debug level 0 and no source-line flags whatever the environment says; records cleared."""
    import xlatorch.debug as xd
    from xlatorch.debug import knob

    monkeypatch.setattr(knob, "_IR_DEBUG", False)
    monkeypatch.setattr(knob, "_HLO_DEBUG", False)
    prev = xd.get_level()
    xd.set_level(0)
    xd.clear()
    yield
    xd.set_level(prev)


@pytest.fixture
def no_cached_executables(monkeypatch):
    """No executable compiled by an earlier test is reused: a test that breaks a lowering
    meets it whatever ran before it in this process."""
    from xlatorch.runtime.lower import cache

    monkeypatch.setattr(cache, "CACHE", {})


def pytest_addoption(parser):
    parser.addoption("--opinfo-full", action="store_true", help="run every OpInfo sample (CI runs a few per op)")
