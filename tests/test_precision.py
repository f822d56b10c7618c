"""Precision modes (XLA_USE_BF16, XLA_DOWNCAST_BF16 and their LTC_ spellings).

The mode is read once, at import, so each mode runs this file as a script in a fresh
interpreter (``probe``): it reports device results, reported dtypes and the dtypes of
the runtime's device buffers as JSON, and the tests check them against CPU PyTorch.
"""

import copy
import functools
import json
import math
import os
import sys

import pytest
import torch

MODE_VARS = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "LTC_USE_BF16", "LTC_DOWNCAST_BF16")

# mode -> (environment, storage dtype of float32, of float64)
MODES = {
    "default": ({}, torch.float32, torch.float64),
    "XLA_USE_BF16": ({"XLA_USE_BF16": "1"}, torch.bfloat16, torch.bfloat16),
    "LTC_USE_BF16": ({"LTC_USE_BF16": "1"}, torch.bfloat16, torch.bfloat16),
    "XLA_DOWNCAST_BF16": ({"XLA_DOWNCAST_BF16": "1"}, torch.bfloat16, torch.float32),
    "LTC_DOWNCAST_BF16": ({"LTC_DOWNCAST_BF16": "1"}, torch.bfloat16, torch.float32),
}
TRAIN_MODES = ("default", "XLA_USE_BF16", "LTC_USE_BF16")
# float64 values that float32 or bfloat16 storage rounds (and one that every dtype holds).
F64_VALUES = [1 + 2**-30, 1 + 2**-20, 1 + 2**-10, 3.0]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4, 16, generator=g),
        "b": torch.randn(16, 3, generator=g),
        "c": torch.randn(4, 3, generator=g),
        "h": torch.randn(5, generator=g).bfloat16(),
        "spd": torch.eye(4) * 4 + (lambda m: m @ m.T)(torch.randn(4, 4, generator=g)),
    }


# Ops whose JAX kernels take float32/float64 only: stored bfloat16 is widened for them.
WIDENED = {
    "inv": lambda x: torch.linalg.inv(x["spd"]),
    "cholesky": lambda x: torch.linalg.cholesky(x["spd"]),
    "eigvalsh": lambda x: torch.linalg.eigvalsh(x["spd"]),
    "rfft": lambda x: torch.view_as_real(torch.fft.rfft(x["a"])),
    "view_as_complex": lambda x: torch.view_as_real(torch.view_as_complex(x["c"][:, :2].contiguous()) * 2),
}


def probe(train: bool) -> dict:
    """Run in the mode's subprocess: what the device computes, reports and stores."""
    import xlatorch
    import xlatorch.debug.metrics as met
    from xlatorch.runtime.execute.materialize import materialized

    def stored(t):  # the dtype of the runtime's device buffer (a view's value is its clone's)
        return str(materialized(t if t._vw is None else t.clone()).array.dtype)

    def desc(t):
        cpu = t.cpu()
        return {"dtype": str(t.dtype), "cpu_dtype": str(cpu.dtype), "stored": stored(t), "values": cpu.tolist()}

    x = {k: v.to("xla") for k, v in _inputs().items()}
    met.clear_all()
    out = {
        "input": desc(x["a"]),
        "mm": desc(x["a"] @ x["b"]),
        "add": desc(x["a"][:, :3] + x["c"]),
        "bf16_add": desc(x["h"] + x["h"] * 3),
        "f64": desc(torch.tensor(F64_VALUES, dtype=torch.float64).to("xla")),
        "to_f64": desc(x["a"].double()),
        "to_f64_and_back": desc(x["a"].double().float()),
        "factory": desc(torch.tensor([1 + 2**-10, 2.0], device="xla")),
        "item": torch.tensor(1 + 2**-10, device="xla").item(),
        "int_fill": torch.full((2,), 301.0, dtype=torch.int64, device="xla").tolist(),
        "nan_signbit": torch.signbit(torch.tensor([math.nan, -math.nan]).to("xla")).tolist(),
        "widened": {name: desc(fn(x)) for name, fn in WIDENED.items()},
    }
    out["fallbacks"] = met.executed_fallback_ops()
    if train:
        out["train"] = _train(xlatorch, met, stored)
    return out


def _train(xlatorch, met, stored):
    """A small MLP regression with SGD on the device and on CPU (float32), same start."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.5
    xla_model = copy.deepcopy(cpu_model).to("xla")
    losses = {}
    met.clear_all()
    for name, model, dev in (("cpu", cpu_model, "cpu"), ("xla", xla_model, "xla")):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        xd, yd = x.to(dev), y.to(dev)
        losses[name], compiles = [], []
        for _ in range(8):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xd), yd)
            loss.backward()
            opt.step()
            if dev == "xla":
                xlatorch.sync()
                compiles.append(met.counter_value("UncachedCompile") or 0)
            losses[name].append(loss.item())
    w = next(xla_model.parameters())
    return {
        "losses": losses,
        "compiles": compiles,
        "fallbacks": met.executed_fallback_ops(),
        "param": {"dtype": str(w.dtype), "stored": stored(w), "cpu_dtype": str(w.cpu().dtype)},
    }


@functools.cache
def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MODE_VARS}
    env.update(MODES[mode][0])
    args = [sys.executable, os.path.abspath(__file__)] + (["--train"] if mode in TRAIN_MODES else [])
    from tests import warm  # not at the top: this file runs as a script, where tests/ is not a package

    res = warm.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _values(d: dict, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(d["values"], dtype=dtype)


@pytest.mark.parametrize("mode", MODES)
def test_float32_reports_float32_and_is_stored_per_mode(mode):
    r, f32_storage = _run(mode), MODES[mode][1]
    for key in ("input", "mm", "add", "to_f64_and_back", "factory"):
        d = r[key]
        assert (d["dtype"], d["cpu_dtype"]) == ("torch.float32", "torch.float32"), key
        assert d["stored"] == _name(f32_storage), key


@pytest.mark.parametrize("mode", MODES)
def test_float32_math_is_done_in_the_storage_dtype(mode):
    r, f32_storage = _run(mode), MODES[mode][1]
    x = _inputs()
    a, b, c = x["a"], x["b"], x["c"]

    def want(fn):  # the computation on CPU in the storage dtype, reported as float32
        return fn(*(t.to(f32_storage) for t in (a, b, c))).float()

    mm, add = _values(r["mm"]), _values(r["add"])
    if f32_storage == torch.float32:
        torch.testing.assert_close(mm, a @ b)
        torch.testing.assert_close(add, a[:, :3] + c, rtol=0, atol=0)
        assert _values(r["input"]).equal(a)
        assert r["factory"]["values"][0] == torch.tensor(1 + 2**-10).item()
        return
    # bfloat16: exactly CPU's bfloat16 result (inputs are rounded when uploaded, each op
    # rounds its result), visibly different from the float32 one.
    assert mm.equal(want(lambda a, b, c: a @ b))
    assert add.equal(want(lambda a, b, c: a[:, :3] + c))
    assert _values(r["input"]).equal(a.bfloat16().float()) and not _values(r["input"]).equal(a)
    assert not torch.allclose(mm, a @ b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(add, a[:, :3] + c, rtol=1e-4, atol=1e-5)
    assert r["factory"]["values"] == [1.0, 2.0]  # 1 + 2**-10 has no bfloat16 value
    assert r["item"] == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_float64_is_stored_per_mode(mode):
    r, _, f64_storage = _run(mode), *MODES[mode][1:]
    for key in ("f64", "to_f64"):
        d = r[key]
        assert (d["dtype"], d["cpu_dtype"], d["stored"]) == ("torch.float64", "torch.float64", _name(f64_storage))
    want = torch.tensor(F64_VALUES, dtype=torch.float64).to(f64_storage).double()
    assert _values(r["f64"], torch.float64).equal(want)
    # float32 -> float64 on the device: the reported dtype changes, the values are the stored float32's.
    assert _values(r["to_f64"], torch.float64).equal(_values(r["input"]).double())


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_tensors_are_bfloat16_in_every_mode(mode):
    d = _run(mode)["bf16_add"]
    assert (d["dtype"], d["cpu_dtype"], d["stored"]) == ("torch.bfloat16", "torch.bfloat16", "bfloat16")
    h = _inputs()["h"]
    assert _values(d, torch.bfloat16).equal(h + h * 3)


@pytest.mark.parametrize("mode", MODES)
def test_linalg_fft_and_complex_work_on_narrowed_storage(mode):
    r, f32_storage = _run(mode), MODES[mode][1]
    x = _inputs()
    tol = {} if f32_storage == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, fn in WIDENED.items():
        d = r["widened"][name]
        assert (d["dtype"], d["cpu_dtype"], d["stored"]) == ("torch.float32", "torch.float32", _name(f32_storage))
        torch.testing.assert_close(_values(d), fn(x), **tol, msg=name)
    assert r["fallbacks"] == []


@pytest.mark.parametrize("mode", MODES)
def test_nan_keeps_its_sign_when_stored(mode):
    # PyTorch's own vectorised float -> bfloat16 makes every NaN negative; uploads must not.
    assert _run(mode)["nan_signbit"] == [False, True]


@pytest.mark.parametrize("mode", MODES)
def test_python_floats_stay_exact_for_integer_results(mode):
    # 301.0 has no bfloat16 value: a Python number is rounded only where it meets a float tensor.
    assert _run(mode)["int_fill"] == [301, 301]


@pytest.mark.parametrize("ltc, xla", [("LTC_USE_BF16", "XLA_USE_BF16"), ("LTC_DOWNCAST_BF16", "XLA_DOWNCAST_BF16")])
def test_ltc_spellings_match_xla(ltc, xla):
    # lazy_tensor_core's names: the same results, bit for bit (training included for USE_BF16).
    assert _run(ltc) == _run(xla)


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_mlp_training(mode):
    t, f32_storage = _run(mode)["train"], MODES[mode][1]
    assert t["fallbacks"] == []
    assert t["compiles"][1] == t["compiles"][-1], t["compiles"]  # steady state: no recompiles
    assert t["param"] == {"dtype": "torch.float32", "stored": _name(f32_storage), "cpu_dtype": "torch.float32"}
    got, want = t["losses"]["xla"], t["losses"]["cpu"]
    assert got[-1] < 0.5 * got[0], got
    if f32_storage == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:  # bfloat16 keeps ~3 significant digits: close to float32 training, not equal
        torch.testing.assert_close(got, want, rtol=5e-2, atol=1e-2)
        assert got != want


@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("true", True), ("True", True), ("2", True), ("0", False), ("false", False),
     ("", False), ("yes", False)],
)  # fmt: skip
def test_env_flag_reads_like_torch_xla(monkeypatch, value, on):
    from xlatorch.runtime.base.dtypes import env_flag

    monkeypatch.setenv("XLA_USE_BF16", value)
    assert env_flag("XLA_USE_BF16") is on


def test_use_bf16_wins_over_downcast_for_float64():
    from xlatorch.runtime.base.dtypes import storage_map

    use = {torch.float32: torch.bfloat16, torch.float64: torch.bfloat16}
    assert storage_map(True, True) == storage_map(True, False) == use
    assert storage_map(False, True) == {torch.float32: torch.bfloat16, torch.float64: torch.float32}
    assert storage_map(False, False) == {}


if __name__ == "__main__":
    print(json.dumps(probe(train="--train" in sys.argv)))
