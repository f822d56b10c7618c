"""The profiler (``xp``) and ``xm.get_memory_info``: captures hold xlatorch's spans and ATen names."""

import collections
import gc
import glob
import gzip
import json
import os
import socket
import sys
import textwrap

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.debug.profiler as xp
from tests import warm


def _model(width):
    torch.manual_seed(0)
    dev = xm.xla_device()
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, 3))
    model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        x = torch.randn(8, width).to(dev)  # a host batch each step, as from a loader
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    return step


def _events(run_dir):
    with gzip.open(os.path.join(run_dir, "perfetto_trace.json.gz")) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _names(events):
    return collections.Counter(e["name"] for e in events)


def _misnested(events):
    """Spans that overlap a span of the same thread without nesting in it (viewers drop them)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    bad = []
    for spans in by_thread.values():
        stack = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1] + 0.01:  # 10 ns of rounding in the JSON's microseconds
                bad.append((name, stack[-1][2]))
            stack.append((start, end, name))
    return bad


def test_capture_of_three_training_steps(tmp_path):
    step = _model(13)  # a width no other test uses: the first step compiles
    with xp.trace(tmp_path) as cap:
        for i in range(3):
            with xp.StepTrace("train", step_num=i):
                with xp.Trace("forward_backward", batch=i):
                    loss = step()
        loss.item()
    assert not xp.ACTIVE
    assert os.path.dirname(cap.path) == str(tmp_path / "plugins" / "profile")
    assert glob.glob(os.path.join(cap.path, "*.xplane.pb"))  # for TensorBoard / XProf
    events = _events(cap.path)
    names = _names(events)
    assert names["xlatorch.compile"] >= 1
    assert names["xlatorch.execute"] == names["xlatorch.sync"] == names["xlatorch.mark_step"] == 3
    assert names["xlatorch.transfer_to_device"] >= 3 and names["xlatorch.transfer_from_device"] == 1
    assert names["xlatorch.trace"] >= 3  # op tracing between syncs
    assert names["train"] == 3 and names["forward_backward"] == 3
    assert sorted(e["args"]["step_num"] for e in events if e["name"] == "train") == ["0", "1", "2"]
    assert {e["args"].get("reason") for e in events if e["name"] == "xlatorch.sync"} == {"mark_step"}
    assert _misnested(events) == []

    def within(inner, outer):
        return any(o["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= o["ts"] + o["dur"] for o in outer)

    by = collections.defaultdict(list)
    for e in events:
        by[e["name"]].append(e)
    assert all(within(e, by["xlatorch.sync"]) for e in by["xlatorch.execute"] + by["xlatorch.compile"])
    assert all(within(e, by["xlatorch.mark_step"]) for e in by["xlatorch.sync"])
    assert all(within(e, by["train"]) for e in by["xlatorch.mark_step"])  # StepTrace ends with mark_step
    assert not any(within(e, by["xlatorch.sync"]) for e in by["xlatorch.trace"])
    # XLA's events for the kernels it ran, and the ATen op each HLO op came from: the capture
    # keeps the compiled HLO, whose op_name metadata is "jit(...)/aten::<op>/<primitive>" (on
    # CPU the kernel events themselves are named after XLA's fusions).
    assert any("hlo_op" in e.get("args", {}) for e in events)
    xplane = open(glob.glob(os.path.join(cap.path, "*.xplane.pb"))[0], "rb").read()
    for op in (b"aten::addmm", b"aten::relu", b"aten::threshold_backward", b"aten::mm"):
        assert b"/" + op + b"/" in xplane


def test_profiling_does_not_change_compiles(tmp_path):
    step = _model(11)
    for _ in range(3):
        step()
        xm.mark_step()
    met.clear_all()
    step()
    xm.mark_step()
    plain = (met.counter_value("UncachedCompile"), met.counter_value("CachedCompile"))
    met.clear_all()
    with xp.trace(tmp_path):
        step()
        xm.mark_step()
    assert (met.counter_value("UncachedCompile"), met.counter_value("CachedCompile")) == plain == (None, 1)


def test_trace_steps_captures_the_chosen_steps(tmp_path):
    step = _model(9)
    xp.trace_steps(tmp_path, start=1, stop=3)
    for _ in range(4):
        step()
        xm.mark_step()
    assert not xp.ACTIVE
    (run,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*"))
    assert _names(_events(run))["xlatorch.mark_step"] == 2
    with pytest.raises(ValueError, match="start < stop"):
        xp.trace_steps(tmp_path, start=2, stop=2)
    with pytest.raises(RuntimeError, match="no profiler trace"):
        xp.stop_trace()


def test_environment_one_liner(tmp_path):
    code = textwrap.dedent("""
        import torch, xlatorch
        import xlatorch.core.xla_model as xm
        x = torch.ones(4, 4).to("xla")
        for _ in range(3):
            x = x * 2
            xm.mark_step()
        print(x.sum().item())
    """)
    env = dict(os.environ, XLATORCH_PROFILE=str(tmp_path), XLATORCH_PROFILE_STEPS="0:2")
    out = warm.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "128.0"
    (run,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*"))
    names = _names(_events(run))
    # From the device's first use: the upload of x is in it, and two steps.
    assert names["xlatorch.transfer_to_device"] == 1 and names["xlatorch.mark_step"] == 2


def test_server_capture_from_a_thread(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    step = _model(7)
    xp.start_server(port)
    try:
        with pytest.raises(NotImplementedError, match="own server"):
            xp.trace("10.0.0.2:8466", str(tmp_path))
        thread = xp.trace_detached(f"localhost:{port}", str(tmp_path), duration_ms=1500)
        while thread.is_alive():
            step()
            xm.mark_step()
        thread.join()
    finally:
        xp.stop_server()
    assert not xp.ACTIVE
    (run,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*"))
    assert _names(_events(run))["xlatorch.execute"] >= 1


def test_memory_info():
    info = xm.get_memory_info(xm.xla_device())
    assert {"bytes_used", "bytes_limit", "peak_bytes_used", "kb_total", "kb_free"} <= set(info)
    assert 0 <= info["bytes_used"] <= info["peak_bytes_used"] and info["bytes_limit"] > 0
    assert info["kb_total"] == info["bytes_limit"] // 1024
    keep = torch.zeros(1, device="xla")  # noqa: F841 (held: only t's buffer may change below)
    xm.mark_step()  # releases the last execution's outputs (held for wait_device_ops)
    gc.collect()  # and earlier tests' models
    before = xm.get_memory_info("xla:0")["bytes_used"]
    t = torch.full((1024, 1024), 3.0, device="xla")  # 4 MB once materialised
    xm.mark_step()
    grown = xm.get_memory_info()["bytes_used"]
    assert grown - before >= 4 * 2**20 - 1024  # the sync may free a few scalars of earlier graphs
    assert xm.get_memory_info()["peak_bytes_used"] >= grown
    del t
    keep = torch.zeros(2, device="xla")  # noqa: F841 (a next execution: it releases the last one's outputs)
    xm.mark_step()
    gc.collect()
    assert xm.get_memory_info()["bytes_used"] < before + 1024  # back where it was (a few scalars aside)
    with pytest.raises(ValueError, match="needs an xla device"):
        xm.get_memory_info(torch.device("cpu"))
    with pytest.raises(ValueError, match="does not exist"):
        xm.get_memory_info("xla:64")
