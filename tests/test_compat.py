"""``python -m xlatorch.compat``: the seeds' snippets run unmodified, with their original imports.

Each seed's snippets run as one script (tests/compat_snippets.py) through the runner in a
subprocess; what they computed is compared here with the same computation in eager
PyTorch on CPU. Also: worker processes (``xmp.spawn``, DataLoader workers started with
``spawn`` and ``forkserver``, ``subprocess`` children) see the aliases; the script runs as
``python SCRIPT`` would run it; and a plain ``python`` process gets none of it.
"""

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import compat_snippets as snip
import compat_snippets_004 as snip4
import pytest
import torch
import torch.nn.functional as F

from tests import warm
from xlatorch.compat import __main__ as runner
from xlatorch.compat import aliases

TOL = dict(rtol=1e-4, atol=1e-5)
NOT_XLA = "RuntimeError: Input tensor is not an XLA tensor: torch.FloatTensor"
PRECISION_VARS = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "LTC_USE_BF16", "LTC_DOWNCAST_BF16", "CPU_NUM_DEVICES")


def _run(tmp_path, name, text, *args, env=None, status=0):
    """Run ``text`` as ``tmp_path/<name>.py`` through the runner; returns the process and what
    the script saved to its first argument (a path relative to the script's directory)."""
    (tmp_path / f"{name}.py").write_text(text)
    e = {k: v for k, v in os.environ.items() if k not in PRECISION_VARS}
    e.update(env or {})
    with warm.Popen([sys.executable, "-m", "xlatorch.compat", f"{name}.py", f"{name}.out", *args], cwd=tmp_path,
                    env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        stdout, stderr = proc.communicate(timeout=300)
    p = SimpleNamespace(pid=proc.pid, returncode=proc.returncode, stdout=stdout, stderr=stderr)
    assert p.returncode == status, f"exit status {p.returncode}\n{p.stdout}\n{p.stderr}"
    out = tmp_path / f"{name}.out"
    return p, (torch.load(out, weights_only=False) if out.exists() else None)


def _prelude() -> dict:
    ns: dict = {}
    exec(snip.PRELUDE + snip4.MNIST_NET, ns)
    return ns


def _close(got, want):
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    else:
        torch.testing.assert_close(got, want, **TOL)


def _sgd(model, initial, steps, lr, momentum=0.0) -> dict:
    """Eager CPU training from ``initial``: each step's loss is the mean of its batches' losses
    (one batch per replica: the all-reduced mean of their gradients)."""
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for batches in steps:
        opt.zero_grad()
        loss = sum(F.nll_loss(model(x), y) for x, y in batches) / len(batches)
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _check_tensor_snippets(out, stdout):
    assert out["device"] == "xla:0" and "device='xla:0'" in stdout
    _close(out["add"], out["t0"] + out["t1"])
    _close(out["mm"], out["t0"] @ out["t1"])
    _close(out["l_out"], F.linear(out["l_in"], out["linear"]["weight"], out["linear"]["bias"]))
    assert out["cpu_linear_error"].startswith(NOT_XLA)


def _one_batch_steps(ns):
    return [[b] for b in ns["train_loader"]]


def test_seed_000_torch_xla_1x(tmp_path):
    p, out = _run(tmp_path, "seed000", snip.SEED_000)
    _check_tensor_snippets(out, p.stdout)
    # The guide's "Getting Started" and multiprocessing snippets never move MNIST() to the
    # device: a CPU module on device data, the error the guide itself names.
    assert out["getting_started_error"].startswith(NOT_XLA) and "aten::convolution" in out["getting_started_error"]
    assert out["mp_error"].startswith(NOT_XLA)
    ns = _prelude()
    assert out["dp_devices"] == ["xla:0"]
    want = _sgd(ns["MNIST"](), out["dp_initial"], _one_batch_steps(ns), ns["lr"], ns["momentum"])
    _close(out["dp_final"], want)
    _close(out["loaded"], out["saved"])
    assert out["loaded_device"] == "xla:0"
    _close(out["view_loaded"], out["view_saved"] + 1)  # the loaded view still aliases its base


def test_seed_001_api_guide(tmp_path):
    _, out = _run(tmp_path, "seed001", snip.SEED_001)
    ns = _prelude()
    want = _sgd(ns["MNIST"](), out["initial"], _one_batch_steps(ns), ns["lr"], ns["momentum"])
    _close(out["final"], want)
    _close(out["loaded"], out["saved"])
    assert out["loaded_device"] == "xla:0"
    assert all(v.device.type == "cpu" for v in out["xm_saved"].values())
    _close(dict(out["xm_saved"]), want)
    _close(out["xser_loaded"], want)


def test_seed_001_spawned_workers_see_the_aliases(tmp_path):
    # xmp.spawn(_mp_fn, args=()) with two processes: each re-runs the script as __mp_main__,
    # whose torch_xla imports resolve to xlatorch there too.
    p, _ = _run(tmp_path, "seed001mp", snip.SEED_001_MP, env={"CPU_NUM_DEVICES": "2"})
    res = [torch.load(tmp_path / f"seed001mp.out.{i}", weights_only=False) for i in range(2)]
    assert [r["index"] for r in res] == [0, 1]
    assert [r["main"] for r in res] == ["__mp_main__"] * 2
    assert len({r["pid"] for r in res} | {p.pid}) == 3  # two workers besides the launcher
    ns = _prelude()
    batches = list(ns["train_loader"])
    rounds = [batches[i : i + 2] for i in range(0, len(batches), 2)]  # replica r takes batch r of each round
    want = _sgd(ns["MNIST"](), res[0]["initial"], rounds, ns["lr"], ns["momentum"])
    for r in res:
        _close(r["initial"], res[0]["initial"])
        _close(r["final"], want)


def test_seed_002_lazy_tensor_core(tmp_path):
    p, out = _run(tmp_path, "seed002", snip.SEED_002)
    _check_tensor_snippets(out, p.stdout)  # ltm.lazy_device() is the xla device (README: 'xla:0')
    ns = _prelude()
    want = _sgd(ns["MNIST"](), out["initial"], _one_batch_steps(ns), ns["lr"], ns["momentum"])
    _close(out["final"], want)
    _close(out["loaded"], out["saved"])
    assert out["loaded_device"] == "xla:0"
    _close(dict(out["ltm_saved"]), want)
    _close(out["xser_loaded"], want)
    assert out["mark_steps"] >= len(ns["train_loader"])


def test_seed_003_torch_xla_py(tmp_path):
    p, out = _run(tmp_path, "seed003", snip.SEED_003)
    assert out["device"] == "xla:0" and "device='xla:0'" in p.stdout
    _close(out["x_sum"], out["x"].sum())
    ns = _prelude()
    want = _sgd(ns["MNIST"](), out["initial"], _one_batch_steps(ns), ns["lr"], ns["momentum"])
    _close(out["final"], want)
    assert "Metric: CompileTime" in out["report"] and "Metric: CompileTime" in p.stdout
    # The guide's clip_grad_norm_ without .item(), against PyTorch's own on the same gradients.
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in out["grads"]]
    for q, g in zip(params, out["grads"]):
        q.grad = g.clone()
    assert torch.nn.utils.clip_grad_norm_(params, 0.01) > 0.01  # the gradients were clipped
    _close(out["clipped"], [q.grad for q in params])


def test_seed_004_single_device(tmp_path):
    _, out = _run(tmp_path, "seed004", snip4.SEED_004)
    assert out["model_device"] == out["data_device"] == "xla:0"
    ns = _prelude()
    batch = next(iter(ns["train_loader"]))
    model = ns["MNIST"]()
    model.load_state_dict(out["step_initial"])
    assert out["step_loss"] == pytest.approx(F.nll_loss(model(batch[0]), batch[1]).item(), rel=1e-5)
    _close(out["step_final"], _sgd(model, out["step_initial"], [[batch]], ns["lr"]))
    torch.manual_seed(1)
    net = ns["MNISTNet"]()
    loader = torch.utils.data.DataLoader(ns["synthetic_mnist"](16), batch_size=8)
    want = _sgd(net, {k: v.clone() for k, v in net.state_dict().items()}, [[b] for b in loader], ns["lr"])
    _close(out["recap_final"], want)
    if importlib.util.find_spec("xlatorch.amp.syncfree") is None:  # xlatorch.amp is not built yet
        assert out["amp_error"].startswith("ImportError: cannot import name 'syncfree' from 'xlatorch.amp'")
    else:
        assert out["amp_error"] is None and out["syncfree"] == "xlatorch.amp.syncfree"
    _close(dict(out["xm_saved"]), want)
    _close(out["cpu_saved"], want)
    _close(out["reloaded"], want)
    assert out["reloaded_device"] == "xla:0"


def test_seed_004_launch(tmp_path):
    # torch_xla.launch(_mp_mnist_fn, args=(args,)) with one device: the replica runs in the
    # launcher (the two-process path is test_seed_001_spawned_workers_see_the_aliases).
    text = snip4.SEED_004_LAUNCH.replace("synthetic_mnist(256)", "synthetic_mnist(128)")
    p, _ = _run(tmp_path, "seed004launch", text, env={"CPU_NUM_DEVICES": "1"})
    assert "Process 0 (Global Ordinal 0): Starting training on CPU..." in p.stdout
    assert "Process 0: Training finished!" in p.stdout
    got = torch.load(tmp_path / "seed004launch.out.0", weights_only=False)
    ns = _prelude()
    torch.manual_seed(42)  # the seed _mp_mnist_fn sets; the loader's shuffles draw from it next
    net = ns["MNISTNet"]()
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    loader = torch.utils.data.DataLoader(ns["synthetic_mnist"](128), batch_size=64, shuffle=True)
    steps = [[b] for _ in range(2) for b in loader]
    _close(got["final"], _sgd(net, initial, steps, lr=0.01, momentum=0.5))


RUNNER_CHECK = """
import os
import subprocess
import sys

os.environ["LTC_USE_BF16"] = "1"  # set by the script before the import: xlatorch must see it

import torch
import torch.utils.data
import torch_xla
import torch_xla.core.xla_model as xm
import lazy_tensor_core.core.lazy_model as ltm

import xlatorch.core.xla_model


class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        import torch_xla.core.xla_model as worker_xm

        return {"pid": os.getpid(), "xm": worker_xm.__name__}


def error_of(statement):
    try:
        exec(statement)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    t = torch.randn(64, device=ltm.lazy_device())
    child = "import importlib.util; print(importlib.util.find_spec('torch_xla').origin)"
    torch.save({
        "name": __name__, "argv": sys.argv, "file": __file__, "path0": sys.path[0], "pid": os.getpid(),
        "torch_xla": repr(torch_xla), "same_xm": xm is xlatorch.core.xla_model, "device": str(torch_xla.device()),
        "dtype": str(t.dtype), "t": t.cpu(),
        "workers": {ctx: next(iter(torch.utils.data.DataLoader(Probe(), num_workers=1, multiprocessing_context=ctx)))
                    for ctx in ("spawn", "forkserver")},
        "child": subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip(),
        "gru": error_of("import torch_xla.experimental.unbounded_dynamism_export"),
        "fsdp": error_of("import torch_xla.distributed.fsdp.wrap; "
                         "assert torch_xla.distributed.fsdp is sys.modules['xlatorch.distributed.fsdp']"),
        "spmd": error_of("import torch_xla.distributed.spmd; "
                         "assert torch_xla.distributed.spmd is sys.modules['xlatorch.distributed.spmd']"),
        "ltc_xm": error_of("import lazy_tensor_core.core.xla_model"),
        "ltc_dir": sorted(n for n in dir(ltm) if n.startswith("lazy")),
    }, sys.argv[1])
    sys.exit(int(sys.argv[2]))
"""


def _fake_torch_xla(tmp_path):
    """A directory holding a package named torch_xla (a real torch_xla, as far as imports go)."""
    (tmp_path / "site" / "torch_xla").mkdir(parents=True)
    (tmp_path / "site" / "torch_xla" / "__init__.py").write_text("MARK = 'the real torch_xla'\n")
    return str(tmp_path / "site")


def test_runner_runs_the_script_as_python_would(tmp_path):
    # A torch_xla on PYTHONPATH does not win inside the runner: the aliases lead the path.
    p, out = _run(tmp_path, "runner_check", RUNNER_CHECK, "7", env={"PYTHONPATH": _fake_torch_xla(tmp_path)}, status=7)
    assert out["name"] == "__main__"
    assert out["argv"] == ["runner_check.py", "runner_check.out", "7"]
    assert out["file"] == str(tmp_path / "runner_check.py")
    assert out["path0"] == os.path.realpath(tmp_path)
    assert out["pid"] == p.pid  # the runner became the script's Python (exec)
    assert "front door to xlatorch" in out["torch_xla"] and out["same_xm"] and out["device"] == "xla:0"
    # LTC_USE_BF16 set by the script before its import: stored in bfloat16, reported as float32.
    assert out["dtype"] == "torch.float32"
    assert torch.equal(out["t"], out["t"].bfloat16().float()) and out["t"].abs().sum() > 0
    for ctx, got in out["workers"].items():
        assert got["xm"] == ["xlatorch.core.xla_model"], ctx
        assert got["pid"].item() != p.pid, ctx
    assert out["child"] == os.path.join(os.path.dirname(aliases.__file__), "front", "torch_xla", "__init__.py")
    assert out["gru"].startswith(
        "ModuleNotFoundError: No module named 'torch_xla.experimental.unbounded_dynamism_export'"
    )
    assert "xlatorch.experimental.unbounded_dynamism_export" in out["gru"]
    assert out["fsdp"] is None  # torch_xla.distributed.fsdp is xlatorch's module
    assert out["spmd"] is None  # torch_xla.distributed.spmd is xlatorch's module (no error)
    assert out["ltc_xm"].startswith("ModuleNotFoundError: No module named 'lazy_tensor_core.core.xla_model'")
    assert out["ltc_dir"] == ["lazy_device", "lazy_device_hw"]


PLAIN_CHECK = """
import importlib
import sys

import xlatorch
import xlatorch.compat
import xlatorch.compat.aliases as aliases

assert not aliases.installed()
for name in ("torch_xla", "torch_xla_py.xla_model", "lazy_tensor_core.core.lazy_model"):
    try:
        importlib.import_module(name)
        print(name, "imported")
    except ModuleNotFoundError as e:
        print(name, "missing:", e)
sys.path.insert(0, sys.argv[1])
import torch_xla
print("torch_xla:", torch_xla.MARK)
"""


def test_plain_python_gets_no_aliases(tmp_path):
    site = _fake_torch_xla(tmp_path)
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = warm.run([sys.executable, "-c", PLAIN_CHECK, site], env=e, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "torch_xla missing: No module named 'torch_xla'",
        "torch_xla_py.xla_model missing: No module named 'torch_xla_py'",
        "lazy_tensor_core.core.lazy_model missing: No module named 'lazy_tensor_core'",
        "torch_xla: the real torch_xla",
    ]


def test_alias_table_targets_exist():
    for old, new in aliases.ALIASES.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}"
    assert aliases.target_of("torch_xla.core.xla_model") == "xlatorch.core.xla_model"
    assert aliases.target_of("torch_xla.runtime") == "xlatorch.runtime"
    assert aliases.target_of("torch_xla_py.data_parallel") == "xlatorch.distributed.data_parallel"
    assert aliases.target_of("lazy_tensor_core.core.lazy_model") == "xlatorch.compat.lazy_model"
    assert aliases.target_of("numpy") is None
    finder = aliases.AliasFinder()
    assert finder.find_spec("numpy") is None
    with pytest.raises(ModuleNotFoundError, match="torch_xla_py.utils"):
        finder.find_spec("torch_xla_py.utils")


def test_runner_command_line():
    cmd, env = runner.command(["-X", "dev", "train.py", "-E"])
    assert cmd[0] == sys.executable and cmd[-4:] == ["-X", "dev", "train.py", "-E"]  # -E after the script is its own
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("compat", "front"))
    for bad in (["-E", "train.py"], ["-uI", "train.py"], [], ["-u"]):
        with pytest.raises(SystemExit) as e:
            runner.command(bad)
        assert e.value.code == 2, bad
