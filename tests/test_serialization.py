"""Saving and loading: torch.save of device tensors (views included), xm.save, xser."""

import collections
import io
import os
import pickle
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.utils.serialization as xser
from tests import warm
from xlatorch.runtime.execute.serialization import replay

DEV = xm.xla_device()
Point = collections.namedtuple("Point", ["x", "y"])


def _zip_storages(path) -> int:
    return sum(1 for n in zipfile.ZipFile(path).namelist() if "/data/" in n and not n.endswith("serialization_id"))


# --- torch.save / torch.load of device tensors ---------------------------------------


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_values_dtypes_requires_grad(tmp_path, dtype):
    cpu = (torch.randn(3, 4) * 10).to(dtype)
    x = cpu.to(DEV)
    grad = dtype.is_floating_point
    if grad:
        x.requires_grad_()
        cpu.requires_grad_()
    torch.save((x, cpu), tmp_path / "t.pt")
    lx, lc = torch.load(tmp_path / "t.pt")  # the default, weights_only=True, as in the guide
    assert lx.device == DEV and lc.device.type == "cpu"
    assert lx.dtype == lc.dtype == dtype and lx.requires_grad == lc.requires_grad == grad
    assert lx.is_leaf and torch.equal(lx.detach().cpu(), lc.detach())


def test_guide_snippet_save_load_tensors(tmp_path, capsys):
    t0 = torch.randn(2, 2, device=xm.xla_device())
    t1 = torch.randn(2, 2, device=xm.xla_device())
    tensors = (t0, t1)
    torch.save(tensors, tmp_path / "tensors.pt")
    tensors = torch.load(tmp_path / "tensors.pt")
    print(tensors)
    assert capsys.readouterr().out.count("device='xla:0'") == 2
    assert torch.equal(tensors[0].cpu(), t0.cpu()) and torch.equal(tensors[1].cpu(), t1.cpu())


def _views(x):
    """A tensor and aliases of it: a view, a view of a view, a detach, a multi-output view."""
    v = x[0:2]
    vv = x.t()[1][1:3]
    return {"x": x, "v": v, "vv": vv, "d": x.detach(), "sp": list(x.split(2, 1))}


def test_view_with_base_saved_together_aliases_after_load(tmp_path):
    cpu = torch.arange(12.0).reshape(3, 4)
    torch.save(_views(cpu), tmp_path / "cpu.pt")
    torch.save(_views(cpu.to(DEV)), tmp_path / "xla.pt")  # torch_xla raises "sharing a view" here
    assert _zip_storages(tmp_path / "xla.pt") == 1  # the storage is written once
    want, got = torch.load(tmp_path / "cpu.pt"), torch.load(tmp_path / "xla.pt")
    for k in want:
        for w, g in zip(want[k] if k == "sp" else [want[k]], got[k] if k == "sp" else [got[k]]):
            assert g.device == DEV and torch.equal(g.cpu(), w)
    # Writes through a loaded view, a view of a view and a detach reach the loaded base.
    for d in (want, got):
        d["v"][1].add_(100)
        d["vv"].mul_(-1)
        d["d"][0, 0] = 7
    for k in ("x", "v", "vv", "d"):
        assert torch.equal(got[k].cpu(), want[k]), k
    assert torch.equal(got["sp"][0].cpu(), want["sp"][0]) and torch.equal(got["sp"][1].cpu(), want["sp"][1])
    got["x"].add_(1)  # and the base's writes reach the views
    assert torch.equal(got["vv"].cpu(), want["vv"] + 1)


def test_guide_snippet_view_saves_instead_of_raising(tmp_path):
    t = torch.randn(2, 2, device=xm.xla_device())
    t_view = t[0:2]
    tensors = (t, t_view)
    torch.save(tensors, tmp_path / "tensors.pt")
    lt, lv = torch.load(tmp_path / "tensors.pt")
    lv[0, 0] = 42.0
    assert lt[0, 0].item() == 42.0 and torch.equal(lt.cpu(), lv.cpu())


def test_pending_base_and_view_share_one_storage(tmp_path):
    x = torch.ones(4, 4, device=DEV)
    xm.mark_step()
    y = x * 3  # pending: the first reduce syncs, the second must still find the same storage
    torch.save([y, y[1], y.detach()], tmp_path / "p.pt")
    assert _zip_storages(tmp_path / "p.pt") == 1
    a, b, c = torch.load(tmp_path / "p.pt")
    b.zero_()
    assert a.sum().item() == 36.0 and c.sum().item() == 36.0


def test_view_saved_alone_and_module_parameters(tmp_path):
    x = torch.arange(6.0).to(DEV).reshape(2, 3)
    torch.save(x.t()[2], tmp_path / "v.pt")
    assert torch.equal(torch.load(tmp_path / "v.pt").cpu(), torch.arange(6.0).reshape(2, 3).t()[2])
    m = torch.nn.Linear(3, 2).to(DEV)
    torch.save(m, tmp_path / "m.pt")
    m2 = torch.load(tmp_path / "m.pt", weights_only=False)
    assert isinstance(m2.weight, torch.nn.Parameter) and m2.weight.device == DEV and m2.weight.requires_grad
    assert torch.equal(m2.weight.cpu(), m.weight.cpu())


def test_saved_view_steps_must_be_aten_views():
    base = torch.zeros(3)
    for name in ("aten::add.Tensor", "builtins::eval", "aten::__class__", 3):
        with pytest.raises(RuntimeError, match="not an ATen view op"):
            replay(base, ((name, (), {}, 0),))


# --- xm.save ----------------------------------------------------------------------------


def _nested(make):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3))
    model[1].weight = torch.nn.Parameter(model[0].weight.t().contiguous())
    model = make(model)
    w = make(torch.arange(8.0))
    return {
        "state": model.state_dict(),
        "list": [w, (w[2:4], 5, "s")],
        "point": Point(w, w.detach()),
        "od": collections.OrderedDict(a=w * 2, b=None),
    }


def test_xm_save_nested_structure_to_cpu(tmp_path):
    torch.manual_seed(0)
    want = _nested(lambda m: m)
    torch.manual_seed(0)
    xm.save(_nested(lambda m: m.to(DEV)), tmp_path / "x.pt", master_only=True)
    torch.save(want, tmp_path / "e.pt")
    with torch.serialization.safe_globals([Point]):
        got, eager = torch.load(tmp_path / "x.pt"), torch.load(tmp_path / "e.pt")
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    flat_eager, spec_eager = torch.utils._pytree.tree_flatten(eager)
    assert spec_got == spec_eager and type(got["state"]) is collections.OrderedDict
    assert isinstance(got["point"], Point)
    for g, e in zip(flat_got, flat_eager):
        if isinstance(e, torch.Tensor):
            assert g.device.type == "cpu" and g.dtype == e.dtype and torch.equal(g, e)
        else:
            assert g == e
    # Aliases stay aliases, as in eager: one storage, views write through.
    assert _zip_storages(tmp_path / "x.pt") == _zip_storages(tmp_path / "e.pt")
    got["list"][1][0].fill_(-1)
    assert got["list"][0][2].item() == -1 and got["point"].y[3].item() == -1
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "x.pt").st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.pt", "x.pt"]  # no temporary left


def test_xm_save_to_file_object_and_non_master_noop(tmp_path, monkeypatch):
    buf = io.BytesIO()
    x = torch.ones(2, device=DEV)
    xm.save({"x": x}, buf)
    assert torch.load(io.BytesIO(buf.getvalue()))["x"].device.type == "cpu"
    monkeypatch.setattr(xm, "is_master_ordinal", lambda local=True: False)
    xm.save({"x": x}, tmp_path / "n.pt")
    xser.save({"x": x}, tmp_path / "s")
    assert not (tmp_path / "n.pt").exists() and list(tmp_path.iterdir()) == []
    xm.save({"x": x}, tmp_path / "n.pt", master_only=False)
    assert torch.load(tmp_path / "n.pt")["x"].tolist() == [1.0, 1.0]


# --- crash safety -----------------------------------------------------------------------

_CHILD = """
import sys, torch, xlatorch, xlatorch.core.xla_model as xm, xlatorch.utils.serialization as xser
big = {f"w{i}": torch.full((32 << 20,), float(i + 1), device="xla") for i in range(4)}  # 512 MB
xm.mark_step()
sys.stdout.write("ready\\n"); sys.stdout.flush()
(xm.save if sys.argv[1] == "xm" else xser.save)(big, sys.argv[2])
"""


def _generations(path):
    tdir = path + ".tensors"
    return set(os.listdir(tdir)) if os.path.isdir(tdir) else set()


def _in_progress(kind, path, old_gens):
    d, name = os.path.split(path)
    if kind == "xm":  # the temporary file beside the target, with data in it
        return any(e.name.startswith(f".{name}.") and e.stat().st_size > (1 << 20) for e in os.scandir(d))
    # xser: a new generation holding a written tensor file and the next one started
    return any(len(os.listdir(os.path.join(path + ".tensors", g))) >= 2 for g in _generations(path) - old_gens)


@pytest.mark.parametrize("kind", ["xm", "xser"])
@pytest.mark.parametrize("previous", [True, False])
def test_killed_mid_save_leaves_previous_checkpoint(tmp_path, kind, previous):
    path = str(tmp_path / "ckpt.pt")
    save, load = (xm.save, torch.load) if kind == "xm" else (xser.save, xser.load)
    old = {"w0": torch.arange(5.0).to(DEV)}
    if previous:
        save(old, path)
        before = open(path, "rb").read()
    old_gens = _generations(path)
    child = warm.Popen([sys.executable, "-c", _CHILD, kind, path], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 30
        while not _in_progress(kind, path, old_gens):
            assert child.poll() is None, "the save finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    if previous:
        assert open(path, "rb").read() == before  # the old file, whole
        got = load(path)
        assert list(got) == ["w0"] and got["w0"].device.type == "cpu" and got["w0"].tolist() == old["w0"].tolist()
        if kind == "xser":
            save(old, path)  # the next save removes the killed save's generation
            assert len(_generations(path)) == 1 and not old_gens & _generations(path)
    else:
        assert not os.path.exists(path)  # nothing, rather than a truncated file


# --- xser ---------------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 10, bias=False)
        self.tie()

    def tie(self):  # again after .to(device), which unties parameters (as in torch_xla)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(self.norm(self.lin(self.emb(idx)).relu()))


def test_xser_round_trip_into_load_state_dict(tmp_path):
    torch.manual_seed(0)
    cpu = _Net()
    model = _Net().to(DEV)
    model.tie()
    model.load_state_dict(cpu.state_dict())
    idx = torch.randint(0, 10, (6,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(idx.to(DEV)).sum().backward()  # a step, so the state differs from the init
    opt.step()
    xm.mark_step()
    model.eval()
    before = model(idx.to(DEV)).cpu()
    xser.save(model.state_dict(), tmp_path / "m.xser")
    state_dict = xser.load(tmp_path / "m.xser")
    assert type(state_dict) is collections.OrderedDict and all(v.device.type == "cpu" for v in state_dict.values())
    assert state_dict["out.weight"].data_ptr() == state_dict["emb.weight"].data_ptr()  # tied, stored once
    assert len(os.listdir(next((tmp_path / "m.xser.tensors").iterdir()))) == len(state_dict) - 1
    fresh = _Net().to(DEV)
    fresh.tie()
    fresh.load_state_dict(state_dict)
    fresh.eval()
    assert torch.equal(fresh(idx.to(DEV)).cpu(), before)
    cpu.load_state_dict(state_dict)  # the same checkpoint, on eager CPU
    cpu.eval()
    torch.testing.assert_close(cpu(idx), before)


def test_xser_values_views_and_non_tensor_data(tmp_path):
    x = torch.arange(12.0).to(DEV).reshape(3, 4)
    data = {"x": x, "vv": x.t()[1][1:3], "c": torch.ones(2, dtype=torch.int64), "n": [1, "two", None],
            "p": Point(torch.nn.Parameter(torch.zeros(2, device=DEV)), 3.5)}  # fmt: skip
    xser.save(data, tmp_path / "d")
    with pytest.raises(pickle.UnpicklingError, match="Point"):
        xser.load(tmp_path / "d")  # weights_only by default, as torch.load
    got = xser.load(tmp_path / "d", weights_only=False)
    assert got["n"] == [1, "two", None] and got["p"].y == 3.5
    assert isinstance(got["p"].x, torch.nn.Parameter) and got["p"].x.requires_grad
    assert torch.equal(got["x"], x.cpu()) and got["c"].dtype == torch.int64
    got["vv"].fill_(0)  # aliasing survives, on CPU
    assert got["x"][1:3, 1].tolist() == [0.0, 0.0]


_MEMORY = """
import gc, os, sys, torch, xlatorch, xlatorch.core.xla_model as xm, xlatorch.utils.serialization as xser

def status(key):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(key))

def extra(save):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    save()
    return status("VmHWM") - before

sd = {f"w{i}": torch.full((2 << 20,), float(i), device="xla") for i in range(16)}  # 16 x 8 MB
xm.mark_step()
d = sys.argv[1]
x = extra(lambda: xser.save(sd, os.path.join(d, "x")))
t = extra(lambda: torch.save({k: v.cpu() for k, v in sd.items()}, os.path.join(d, "t.pt")))
print(x, t)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_xser_save_peak_host_memory_near_largest_tensor(tmp_path):
    out = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    xser_extra, torch_extra = map(int, out.stdout.split())
    model, largest = 128 << 20, 8 << 20
    mb = 2**20
    print(f"\nextra peak host memory saving a {model // mb} MB model (16 x 8 MB): "
          f"xser.save {xser_extra / mb:.1f} MB, torch.save of .cpu() copies {torch_extra / mb:.1f} MB")  # fmt: skip
    assert xser_extra < 3 * largest and xser_extra < model / 4, (xser_extra, torch_extra)
    assert torch_extra > model * 3 / 4  # the comparison measures what it claims to


@pytest.mark.parametrize("map_location,where", [
    (None, "xla"), ("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("xla", "xla"), ({"xla:0": "cpu"}, "cpu"),
    (lambda storage, loc: storage, "cpu"),
])  # fmt: skip
def test_torch_load_honours_map_location(tmp_path, map_location, where):
    w = torch.randn(4, 3)
    sd = {"w": w.to("xla"), "row": None}
    sd["row"] = sd["w"][1]  # a view: aliasing survives wherever the tensors land
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    got = torch.load(path, map_location=map_location)  # weights_only=True, torch's default
    assert got["w"].device.type == where and got["row"].device.type == where
    torch.testing.assert_close(got["w"].cpu(), w)
    torch.testing.assert_close(got["row"].cpu(), w[1])
    with torch.no_grad():
        got["row"].fill_(7.0)
    assert got["w"][1].cpu().eq(7.0).all()


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_file_saved_before_the_runtime_was_split_into_stages_loads(weights_only):
    """``tests/data/saved_by_flat_runtime.pt`` was written by ``torch.save`` under the flat
    runtime (its pickle names ``xlatorch.runtime.serialization._rebuild`` and
    ``xlatorch.runtime.tensor._rebuild_xla``): ``{"w": arange(12).reshape(3, 4), "row": w[1],
    "t": w.t(), "p": Parameter(ones(2))}``, all on the device."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "saved_by_flat_runtime.pt")
    s = torch.load(path, weights_only=weights_only)
    w = torch.arange(12.0).reshape(3, 4)
    assert {k: v.device.type for k, v in s.items()} == dict.fromkeys(("w", "row", "t", "p"), "xla")
    torch.testing.assert_close(s["w"].cpu(), w, rtol=0, atol=0)
    torch.testing.assert_close(s["t"].cpu(), w.t(), rtol=0, atol=0)
    torch.testing.assert_close(s["p"].detach().cpu(), torch.ones(2), rtol=0, atol=0)
    assert s["p"].requires_grad
    s["row"].add_(100)  # the view still aliases its base, as when it was saved
    torch.testing.assert_close(s["w"].cpu()[1], w[1] + 100, rtol=0, atol=0)
    torch.testing.assert_close(s["t"].cpu()[:, 1], w[1] + 100, rtol=0, atol=0)
