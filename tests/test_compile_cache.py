"""The persistent compilation cache: a second process loads what the first compiled."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, torch
import xlatorch, xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
from examples.models import programs
p = programs(small=True)["mlp"]
torch.manual_seed(0)
model = p.make_model().to("xla")
opt = p.make_opt(model.parameters())
g = torch.Generator().manual_seed(1)
losses = []
for _ in range(3):
    x, y = (t.to("xla") for t in p.make_batch(g))
    opt.zero_grad()
    loss = p.loss_fn(model(x), y)
    loss.backward()
    opt.step()
    xm.mark_step()
    losses.append(loss.item())
print(json.dumps(dict(losses=losses, hits=met.counter_value("PersistentCacheHit") or 0,
                      writes=met.counter_value("PersistentCacheWrite") or 0,
                      errors=met.counter_value("PersistentCacheError") or 0,
                      compiles=met.counter_value("UncachedCompile"))))
"""


def _run(cache_dir, n=1):
    env = dict(os.environ, XLATORCH_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env) for _ in range(n)]  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_second_run_loads_every_graph_from_disk(tmp_path):
    (first,) = _run(tmp_path)
    assert first["hits"] == 0 and first["writes"] == first["compiles"] >= 1
    (second,) = _run(tmp_path)
    assert second["hits"] == second["compiles"] and second["writes"] == 0
    assert second["losses"] == first["losses"]


def test_damaged_entries_are_recompiled_and_replaced(tmp_path):
    (first,) = _run(tmp_path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == first["writes"]
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    (second,) = _run(tmp_path)
    assert second["errors"] == len(files) and second["writes"] == len(files) and second["hits"] == 0
    assert second["losses"] == first["losses"]
    (third,) = _run(tmp_path)
    assert third["hits"] == third["compiles"] and third["errors"] == 0


def test_processes_sharing_the_directory(tmp_path):
    runs = _run(tmp_path, n=2)  # both compile and write the same entries at once
    assert runs[0]["losses"] == runs[1]["losses"]
    (after,) = _run(tmp_path)
    assert after["hits"] == after["compiles"] and after["errors"] == 0


def test_cache_off(tmp_path):
    env_dir = ""  # XLATORCH_CACHE_DIR= turns the cache off
    (run,) = _run(env_dir)
    assert run["hits"] == 0 and run["writes"] == 0
