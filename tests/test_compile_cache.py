"""The persistent compilation cache: a second process loads what the first compiled, its
lowered programs too (runtime/lower/program_cache.py: nothing traced).

(tests/test_precision.py runs its modes in processes sharing one cache, LAPACK graphs
included: the cache must be safe for those too.)
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every graph of these scripts is served by the lowered-program cache, however small (its
# MIN_NODES is a policy of its own: test_a_graph_of_few_nodes_is_not_served).
_SERVE_ALL = r"""
from xlatorch.runtime.lower import program_cache
program_cache.MIN_NODES = 1
"""

# Counts the traces of graphs' lowerings (a program found on disk traces none).
_COUNT_TRACES = (
    _SERVE_ALL
    + r"""
from xlatorch.runtime.lower import executable
traces = [0]
def _counting(lower_fn):
    def make(*a, **k):
        fn = lower_fn(*a, **k)
        def traced(*args):
            traces[0] += 1
            return fn(*args)
        return traced
    return make
executable.lower_fn = _counting(executable.lower_fn)
"""
)

_PROGRAMS = ("Hit", "Miss", "Skip", "Corrupt")

_SCRIPT = (
    r"""
import json, time, torch
import xlatorch, xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
"""
    + _COUNT_TRACES
    + r"""
from examples.models import programs
p = programs(small=True)["gpt"]
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
                      misses=met.counter_value("PersistentCacheMiss") or 0,
                      compiles=met.counter_value("UncachedCompile"),
                      compile_s=met.metric_data("CompileTime")[1] / 1e9, traces=traces[0],
                      programs={k: met.counter_value("ProgramCache" + k) or 0
                                for k in ("Hit", "Miss", "Skip", "Corrupt")})))
"""
)


_GRAPHS = (
    _SERVE_ALL
    + r"""
import json, sys, torch
import xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
for n in map(int, sys.argv[1:]):  # one graph per length
    y = torch.arange(float(n), device="xla") * 3 + 1
    xm.mark_step()
    assert y.cpu()[-1].item() == 3 * n - 2
counts = {k: met.counter_value("PersistentCache" + k) or 0 for k in ("Hit", "Miss", "Eviction")}
counts.update({"Program" + k: met.counter_value("ProgramCache" + k) or 0 for k in ("Hit", "Miss")})
print(json.dumps(dict(counts, Corrupt=met.counter_value("ProgramCacheCorrupt") or 0)))
"""
)


def _run(cache_dir, n=1, script=_SCRIPT, args=(), **env):
    env = dict(os.environ, XLATORCH_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT, **env)
    procs = [warm.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) for _ in range(n)]  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """(the cache directory a first process filled, what that process printed): tests copy
    the directory before they use it."""
    path = tmp_path_factory.mktemp("cold")
    (first,) = _run(path)
    return path, first


def _copy(cold, to):
    shutil.copytree(cold[0], to)
    return cold[1]


def test_second_run_hits_every_graph(cold, tmp_path):
    first = _copy(cold, tmp_path / "c")
    assert first["hits"] == 0 and first["misses"] >= first["compiles"] >= 1
    assert first["programs"] == {"Hit": 0, "Miss": first["compiles"], "Skip": 0, "Corrupt": 0}
    assert first["traces"] == first["compiles"]
    assert os.listdir(tmp_path / "c" / "jax")
    (second,) = _run(tmp_path / "c")
    assert second["hits"] >= second["compiles"] and second["misses"] == 0
    # Every graph's program came from disk: nothing traced or lowered.
    assert second["programs"] == {"Hit": second["compiles"], "Miss": 0, "Skip": 0, "Corrupt": 0}
    assert second["traces"] == 0
    assert second["losses"] == first["losses"]
    assert second["compile_s"] < first["compile_s"]


def test_a_cache_off_run_gives_the_same_numbers(cold):
    """``XLATORCH_CACHE_DIR=`` turns the cache off; a program compiled through its exported
    form computes what ``jax.jit`` of the lowering does."""
    (off,) = _run("")
    assert off["hits"] == 0 and off["misses"] == 0
    assert off["programs"] == {k: 0 for k in _PROGRAMS} and off["traces"] == off["compiles"]
    assert cold[1]["losses"] == off["losses"]


_SCALARS = (
    r"""
import json, sys, torch
import xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
"""
    + _COUNT_TRACES
    + r"""
x = torch.arange(4.0, device="xla")
xm.mark_step()
out = []
for a, b in ((2.0, 2.0), (2.0, 3.0)):  # equal scalars (read once), then not (compiled apart)
    y = x * a + b
    xm.mark_step()
    out.append(y.cpu().tolist())
print(json.dumps(dict(out=out, traces=traces[0], unshared=met.counter_value("UnsharedScalarRecompile") or 0,
                      programs={k: met.counter_value("ProgramCache" + k) or 0 for k in ("Hit", "Miss")})))
"""
)


_DONATE = (
    r"""
import json, torch
import xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
"""
    + _COUNT_TRACES
    + r"""
w = torch.zeros(256, 256, device="xla")
xm.mark_step()
for _ in range(3):
    w.mul_(0.5).add_(1.0)  # an update in place: its old buffer is donated
    xm.mark_step()
print(json.dumps(dict(w=w[0, :3].cpu().tolist(), traces=traces[0], alias=met.metric_data("CompiledGraphAliasBytes")[1],
                      hits=met.counter_value("ProgramCacheHit") or 0)))
"""
)


def test_a_program_from_disk_still_donates(tmp_path):
    (first,) = _run(tmp_path, script=_DONATE)
    (second,) = _run(tmp_path, script=_DONATE)
    assert second["hits"] >= 1 and second["traces"] == 0
    assert first["alias"] == second["alias"] >= 256 * 256 * 4  # the update writes its old buffer
    assert first["w"] == second["w"] == [1.75] * 3


_UNREAD = (
    r"""
import json, torch
import xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
"""
    + _COUNT_TRACES
    + r"""
w = torch.ones(256, 256, device="xla")
v = torch.ones(4, device="xla")
xm.mark_step()
w = torch.zeros_like(w) + v.sum()  # the old w, donated, is not read: only its shape is
xm.mark_step()
print(json.dumps(dict(w=w[0, :3].cpu().tolist(), v=v.cpu().tolist(), traces=traces[0],
                      hits=met.counter_value("ProgramCacheHit") or 0)))
"""
)


def test_a_program_from_disk_runs_with_donated_data_it_does_not_read(tmp_path):
    (first,) = _run(tmp_path, script=_UNREAD)
    (second,) = _run(tmp_path, script=_UNREAD)
    assert second["hits"] >= 1 and second["traces"] == 0
    assert first["w"] == second["w"] == [4.0] * 3 and first["v"] == second["v"] == [1.0] * 4


def test_equal_scalars_programs_come_back_apart(tmp_path):
    """The sharing of equal scalars is part of the key: the shared program and the one
    reading each scalar apart are two entries, both found by the next process."""
    (first,) = _run(tmp_path, script=_SCALARS)
    assert first["out"] == [[2.0, 4.0, 6.0, 8.0], [3.0, 5.0, 7.0, 9.0]]
    assert first["unshared"] == 1 and first["programs"] == {"Hit": 0, "Miss": 3}  # arange, shared, apart
    (second,) = _run(tmp_path, script=_SCALARS)
    assert second["out"] == first["out"] and second["unshared"] == 1
    assert second["programs"] == {"Hit": 3, "Miss": 0} and second["traces"] == 0


_CHECKED = (
    _SERVE_ALL
    + r"""
import json, sys, torch
import xlatorch.core.xla_model as xm, xlatorch.debug.metrics as met
w = torch.arange(12.0).view(4, 3).to("xla")
i = torch.tensor([int(sys.argv[1])]).to("xla")
xm.mark_step()
try:
    y = torch.nn.functional.embedding(i.float().long(), w) * 2  # an index computed on the device: checked there
    xm.mark_step()
    out = y.cpu().tolist()
except IndexError as e:
    out = "IndexError: " + str(e)
print(json.dumps(dict(out=out, hits=met.counter_value("ProgramCacheHit") or 0)))
"""
)


def test_a_program_from_disk_keeps_its_checks(tmp_path):
    """The on-device checks' table comes back with the program: an index out of range in a
    graph found on disk raises CPU's error, naming the op."""
    (first,) = _run(tmp_path, script=_CHECKED, args=(1,))
    assert first["out"] == [[6.0, 8.0, 10.0]] and first["hits"] == 0
    (second,) = _run(tmp_path, script=_CHECKED, args=(7,))
    assert second["hits"] >= 1
    assert second["out"].startswith("IndexError: index out of range in self") and "aten::embedding" in second["out"]


_KEY = (
    _SERVE_ALL
    + r"""
import hashlib, json, sys, torch
import xlatorch.core.xla_model as xm
from xlatorch.runtime.lower import program_cache
keys = []
graph_key = program_cache.graph_key
def recording(req):
    text = graph_key(req)
    keys.append(hashlib.sha256(text.encode()).hexdigest())
    return text
program_cache.graph_key = recording
x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to("xla")
y = (x @ x.t()).softmax(-1)[:, 2:].sum(0) * 0.5
y = torch.nn.functional.embedding(torch.tensor([1, 3], device="xla"), x)[:, :6] + y
xm.mark_step()
print(json.dumps(dict(keys=keys, out=y.cpu().tolist())))
"""
)


def test_the_key_is_the_same_in_another_process(tmp_path):
    """No address, id or hash seed in the key: two processes (other hash seeds, other cache
    directories) key the same graphs alike."""
    (a,) = _run(tmp_path / "a", script=_KEY, PYTHONHASHSEED="1")
    (b,) = _run(tmp_path / "b", script=_KEY, PYTHONHASHSEED="2")
    assert a["keys"] and a["keys"] == b["keys"]
    assert a["out"] == b["out"]


def test_a_corrupt_entry_is_a_miss(tmp_path):
    """A truncated or altered entry is counted, deleted and compiled again; never a crash.
    (Written again byte for byte, the entry is the one a first run writes, which the next
    process hits: ``test_a_hit_only_reads_its_entry``.)"""
    _run(tmp_path, script=_GRAPHS, args=(7,))
    (entry,) = [f for f in (tmp_path / "jax").iterdir() if f.name.startswith("xlatorch-program-")]
    blob = entry.read_bytes()
    for broken in (blob[: len(blob) // 2], blob[:100] + bytes([blob[100] ^ 1]) + blob[101:], b""):
        entry.write_bytes(broken)
        (run,) = _run(tmp_path, script=_GRAPHS, args=(7,))  # the script checks its numbers
        assert run["Corrupt"] == 1 and run["ProgramMiss"] == 1 and run["ProgramHit"] == 0
        assert entry.read_bytes() == blob  # written again


def test_an_entry_for_another_key_is_never_run(monkeypatch):
    """Two graphs whose digests collide (every name made equal here): the second finds the
    first's entry, compares the key stored in it and compiles its own."""
    import torch

    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    from xlatorch.runtime.lower import cache, program_cache

    monkeypatch.setattr(program_cache, "_name", lambda text: "xlatorch-program-collision")
    monkeypatch.setattr(program_cache, "MIN_NODES", 1)
    monkeypatch.setattr(cache, "CACHE", {})
    met.clear_all()
    a = torch.arange(5.0, device="xla") * 2
    xm.mark_step()
    b = torch.arange(5.0, device="xla") - 2
    xm.mark_step()
    assert a.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0] and b.cpu().tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0]
    assert met.counter_value("ProgramCacheMiss") == 2 and not met.counter_value("ProgramCacheHit")


def test_a_key_holding_an_object_is_not_served():
    """A graph whose key holds what has no stable text (an object) skips the layer, counted."""
    import types

    import xlatorch.debug.metrics as met
    from xlatorch.runtime.ir.ops import SPECS
    from xlatorch.runtime.lower import program_cache

    met.clear_all()
    spec = SPECS["add.Tensor"]
    req = types.SimpleNamespace(spmd=None, dev=0, key=((((spec, (((4,), "f"), object())), ()),),))
    assert program_cache.graph_key(req) is None and met.counter_value("ProgramCacheSkip") == 1
    req.key = ((((spec, (((4,), 1.5),)), ()),),)
    assert program_cache.graph_key(req) is not None


def test_an_op_whose_emitter_was_replaced_is_not_served(monkeypatch):
    """An emitter put in place of the registry's at run time (a wrapper, a debugging patch)
    keeps its graphs out of the layer: the op's stored program would otherwise run in its
    place, or its program be stored under the op's name."""
    import types

    import torch

    import xlatorch.debug.metrics as met
    from xlatorch.runtime.ir.ops import SPECS
    from xlatorch.runtime.lower import cache, program_cache

    spec = SPECS["tanh.default"]
    req = types.SimpleNamespace(spmd=None, dev=0, key=((((spec, (((4,), "f"),)), ()),),))
    assert program_cache.graph_key(req) is not None
    monkeypatch.setattr(program_cache, "MIN_NODES", 1)
    x = torch.linspace(-1, 1, 8)
    close = dict(rtol=1e-6, atol=1e-6)  # tanh's last bit may differ from CPU's
    torch.testing.assert_close(torch.tanh(x.to("xla")).cpu(), torch.tanh(x), **close)  # its program, now on disk
    orig = spec.emit
    monkeypatch.setattr(spec, "emit", lambda out, *a: orig(out, *a) * 2)
    monkeypatch.setattr(cache, "CACHE", {})
    met.clear_all()
    assert program_cache.graph_key(req) is None and met.counter_value("ProgramCacheSkip") == 1
    torch.testing.assert_close(torch.tanh(x.to("xla")).cpu(), torch.tanh(x) * 2, **close)  # the replacement runs
    monkeypatch.undo()
    assert program_cache.graph_key(req) is not None


def test_a_graph_of_few_nodes_is_not_served(monkeypatch):
    """Below ``MIN_NODES`` a graph is traced and lowered as without the layer (loading it would
    cost what that does, and exporting it costs its first run); from there it is served."""
    import torch

    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    from xlatorch.runtime.lower import cache, program_cache

    monkeypatch.setattr(cache, "CACHE", {})
    met.clear_all()
    x = torch.arange(9.0, device="xla")
    y = x * 3 + 1  # 2 nodes
    xm.mark_step()
    assert not met.counter_value("ProgramCacheMiss") and not met.counter_value("ProgramCacheHit")
    for _ in range(program_cache.MIN_NODES):
        y = y * 3 + 1
    xm.mark_step()
    assert (met.counter_value("ProgramCacheMiss") or 0) + (met.counter_value("ProgramCacheHit") or 0) == 1
    want = torch.arange(9.0) * 3 + 1
    for _ in range(program_cache.MIN_NODES):
        want = want * 3 + 1
    torch.testing.assert_close(y.cpu(), want)


def test_processes_sharing_the_directory(tmp_path):
    runs = _run(tmp_path, n=2)  # both compile and write the same entries at once
    assert runs[0]["losses"] == runs[1]["losses"]
    (after,) = _run(tmp_path)
    assert after["hits"] >= after["compiles"] and after["misses"] == 0


def test_a_cache_moved_elsewhere_hits(cold, tmp_path):
    """The key does not hold the cache's path (JAX's XLA caches would put it in the compile
    options): a CI cache restored under another home still hits."""
    first = _copy(cold, tmp_path / "a")  # copied from where it was written
    assert first["misses"] >= first["compiles"] >= 1
    (copied,) = _run(tmp_path / "a")
    assert copied["hits"] >= copied["compiles"] and copied["misses"] == 0
    shutil.move(tmp_path / "a", tmp_path / "b")
    (moved,) = _run(tmp_path / "b")
    assert moved["hits"] >= moved["compiles"] and moved["misses"] == 0
    assert first["losses"] == moved["losses"] == copied["losses"]


def test_the_cache_on_disk_is_bounded_and_keeps_the_newest(tmp_path):
    """A graph of this kind leaves about 7 kB (its executable, 3.9 kB, and its lowered program,
    3.2 kB): a bound of 24 kB holds three. Each of two processes writes three; the oldest go
    (eviction runs when a write passes the bound), the directory never holds more than the
    bound, and what survives still hits."""
    entries = tmp_path / "jax"
    limit = 24_000

    def size():
        return sum(f.stat().st_size for f in entries.iterdir() if f.name.endswith("-cache"))

    evictions = 0
    for first in (100, 200):
        (run,) = _run(tmp_path, script=_GRAPHS, args=(first, first + 1, first + 2), XLATORCH_CACHE_MAX_BYTES=str(limit))
        assert run["Miss"] == 3 and run["Hit"] == 0
        assert 0 < size() <= limit, size()
        evictions += run["Eviction"]
    assert evictions >= 3  # the second process's three graphs cannot fit beside the first's
    assert not [f for f in os.listdir(entries) if f.endswith(".tmp")]  # written whole, renamed
    (newest,) = _run(tmp_path, script=_GRAPHS, args=(202, 201), XLATORCH_CACHE_MAX_BYTES=str(limit))
    assert newest["Hit"] == 2 and newest["Miss"] == 0 and newest["ProgramHit"] == 2
    (oldest,) = _run(tmp_path, script=_GRAPHS, args=(100,), XLATORCH_CACHE_MAX_BYTES=str(limit))
    assert oldest["Hit"] == 0 and oldest["Miss"] == 1 and oldest["ProgramMiss"] == 1
    assert size() <= limit


def test_a_hit_only_reads_its_entry(tmp_path):
    """No lock file, no access-time file, nothing written by a hit (JAX's own bound writes
    both on every hit)."""
    _run(tmp_path, script=_GRAPHS, args=(7,))

    def files():
        return {f.name: f.stat().st_mtime_ns for f in (tmp_path / "jax").iterdir()}

    before = files()
    assert before and all(n.endswith("-cache") for n in before)
    (again,) = _run(tmp_path, script=_GRAPHS, args=(7,))
    assert again["Hit"] == 1 and again["Miss"] == 0 and again["ProgramHit"] == 1 and again["Corrupt"] == 0
    assert files() == before


def test_the_in_memory_cache_is_bounded_and_evicted_graphs_come_back_from_disk():
    import torch

    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    from xlatorch.runtime.lower import cache

    def run(n):
        y = torch.arange(float(n), device="xla") * 3 + 1
        xm.mark_step()
        return y

    old = cache.CACHE_SIZE
    cache.CACHE.clear()  # graphs of earlier tests would be evicted first
    cache.set_cache_size(3)
    try:
        met.clear_all()
        for n in (101, 102, 103, 104, 105):  # five graphs (one per shape)
            run(n)
        assert len(cache.CACHE) <= 3
        assert met.counter_value("CompileCacheEviction") == 2
        run(105)  # the newest stays warm
        assert met.counter_value("UncachedCompile") == 5
        hits = met.counter_value("PersistentCacheHit") or 0
        y = run(101)  # evicted: compiled again, from the persistent cache
        assert met.counter_value("UncachedCompile") == 6
        assert (met.counter_value("PersistentCacheHit") or 0) == hits + 1
        torch.testing.assert_close(y.cpu(), torch.arange(101.0) * 3 + 1)
        assert cache.CACHE_SIZE == 3 and not met.counter_value("CompileCacheGrown")  # a limit set is kept
    finally:
        cache.set_cache_size(old)
        cache._fixed[0] = False


def test_a_loop_over_more_graphs_than_the_limit_gets_room_for_them(monkeypatch):
    """A program cycling through more graphs than the in-memory limit (a long dynamic-cache
    generate(): one stage per length) would drop each just before it comes back and compile
    every one at every round: each graph met again after it was dropped raises the limit by
    one, so the second round compiles only those and the third nothing. A sweep of shapes that
    never come back does not raise it."""
    import torch

    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met
    from xlatorch.runtime.lower import cache

    monkeypatch.setattr(cache, "CACHE", {})
    monkeypatch.setattr(cache, "CACHE_SIZE", 4)
    monkeypatch.setattr(cache, "CACHE_SIZE_MAX", 32)
    monkeypatch.setattr(cache, "_fixed", [False])
    monkeypatch.setattr(cache, "_dropped", {})

    def run(n):
        y = torch.arange(float(n), device="xla") * 3 + 1
        xm.mark_step()
        return y

    met.clear_all()
    compiles = []
    for _ in range(3):
        before = met.counter_value("UncachedCompile") or 0
        ys = [run(n) for n in range(201, 211)]  # ten graphs, one per shape
        compiles.append((met.counter_value("UncachedCompile") or 0) - before)
    assert compiles == [10, 6, 0], compiles  # the six dropped in round 0 come back once
    assert cache.CACHE_SIZE == 10 and met.counter_value("CompileCacheGrown") == 6
    for n, y in zip(range(201, 211), ys):
        torch.testing.assert_close(y.cpu(), torch.arange(float(n)) * 3 + 1)
    for n in range(301, 321):  # a sweep: every shape new, none met again
        run(n)
    assert cache.CACHE_SIZE == 10 and len(cache.CACHE) == 10
    monkeypatch.setattr(cache, "CACHE_SIZE_MAX", 12)
    for n in range(201, 211):  # dropped by the sweep: the limit grows only up to its maximum
        run(n)
    assert cache.CACHE_SIZE == 12 and len(cache.CACHE) == 12
    monkeypatch.setattr(cache, "CACHE_SIZE_MAX", 32)
    monkeypatch.setattr(cache, "_host_room", lambda: False)  # the host short of memory: no more
    for n in range(301, 311):
        run(n)
    assert cache.CACHE_SIZE == 12


def test_host_memory_counts_a_containers_limit(tmp_path, monkeypatch):
    """Inside a container with a memory limit, the host's available and total memory are the
    container's (the executable cache grows only while a quarter of it is free)."""
    from xlatorch.runtime.base import memory
    from xlatorch.runtime.lower import cache

    limit, use = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(str(4 << 30))
    use.write_text(str(3 << 30) + "\n")
    monkeypatch.setattr(memory, "CGROUP_FILES", ((str(limit), str(use)),))
    free, total = memory.host_memory()
    assert total == 4 << 30 and free <= 1 << 30
    assert free * 4 >= total and cache._host_room()  # exactly a quarter left
    use.write_text(str((3 << 30) + 1))
    assert not cache._host_room()
    limit.write_text("max")  # no limit: the host's own figures
    free, total = memory.host_memory()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
