"""torch_xla's current API generation (issue 16 §2): top-level names, ``xr``, ``xm``."""

import threading

import pytest
import torch

import xlatorch
import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
import xlatorch.runtime as xr
from xlatorch.core import step_closures
from xlatorch.runtime.trace.tensor import pending_storages


def _executions() -> int:
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0


def test_top_level_devices_and_seed():
    assert xlatorch.devices() == [torch.device("xla", i) for i in range(xlatorch.device_count())]
    assert xlatorch.device_count() == torch.xla.device_count() >= 1
    assert xlatorch.real_devices() == [f"{xr.device_type()}:{i}" for i in range(xlatorch.device_count())]
    xlatorch.manual_seed(123)
    a = torch.randn(5, device="xla").cpu()
    xlatorch.manual_seed(123)
    b = torch.randn(5, device="xla").cpu()
    c = torch.randn(5, device="xla").cpu()
    torch.testing.assert_close(a, b)
    assert not torch.equal(b, c)


def test_step_syncs_on_entry_and_exit_even_when_the_body_raises():
    before = torch.ones(3, device="xla") * 2
    steps = met.counter_value("MarkStep") or 0
    with xlatorch.step():
        assert not pending_storages()  # what was pending ran on entry
        after = before + 1
        assert pending_storages()
    assert not pending_storages()
    assert met.counter_value("MarkStep") == steps + 2
    with pytest.raises(ValueError), xlatorch.step():
        y = after * 3
        raise ValueError("in the step")
    assert not pending_storages()
    torch.testing.assert_close(y.cpu(), torch.full((3,), 9.0))


def test_runtime_names():
    assert xr.device_type() == "CPU"
    assert xr.global_runtime_device_count() >= xr.addressable_runtime_device_count() >= 1
    assert xr.local_ordinal() == 0 and xr.process_index() == 0 and xr.local_process_count() >= 1
    xr.set_device_type("CPU")  # what it already is: fine
    with pytest.raises(RuntimeError, match="before the device's first use"):
        xr.set_device_type("TPU")
    with pytest.raises(ValueError, match="unknown device type"):
        xr.set_device_type("FPGA")


def test_step_closures_read_the_step_without_another_execution():
    w = torch.ones(4, device="xla")
    xm.mark_step()
    seen, order = [], []
    runs = _executions()
    for i in range(3):
        w = w * 2
        loss = w.sum()
        xm.add_step_closure(lambda t, i=i: seen.append((i, t.item())), args=(loss,))
        xm.add_step_closure(order.append, args=(f"sync{i}",))
        assert not seen or seen[-1][0] == i - 1  # not before its step's end
        xm.mark_step()
    assert seen == [(0, 8.0), (1, 16.0), (2, 32.0)]
    assert order == ["sync0", "sync1", "sync2"]
    assert _executions() == runs + 3  # one execution per step; .item() in a closure is a transfer


def test_async_step_closures_run_off_thread_in_order_and_report_errors():
    done, threads = [], set()

    def record(i):
        threads.add(threading.get_ident())
        done.append(i)

    for i in range(5):
        xm.add_step_closure(record, args=(i,), run_async=True)
        xm.mark_step()
    step_closures.wait()
    assert done == list(range(5)) and threading.get_ident() not in threads

    def fail():
        raise KeyError("closure failed")

    xm.add_step_closure(fail, run_async=True)
    xm.mark_step()
    with pytest.raises(KeyError, match="closure failed"):
        step_closures.wait()


def test_is_xla_tensor():
    assert xm.is_xla_tensor(torch.ones(1, device="xla"))
    assert not xm.is_xla_tensor(torch.ones(1)) and not xm.is_xla_tensor(3)


def test_reduce_scatter_bucketized_in_one_process():
    ts = [torch.randn(4, 3) for _ in range(3)]
    got = xm.reduce_scatter_bucketized(xm.REDUCE_SUM, [t.to("xla") for t in ts], 0.5, 0, 1, bucket_cap_mb=0)
    for g, t in zip(got, ts):
        torch.testing.assert_close(g.cpu(), t * 0.5)
    outs = [torch.zeros(4, 3, device="xla") for _ in ts]
    assert xm.reduce_scatter_bucketized(xm.REDUCE_SUM, [t.to("xla") for t in ts], 1.0, 0, 1, output=outs) is outs
    torch.testing.assert_close(outs[2].cpu(), ts[2])


def test_broadcast_master_param_in_one_process_keeps_the_parameters():
    model = torch.nn.Linear(3, 2).to("xla")
    before = [p.detach().cpu().clone() for p in model.parameters()]
    xm.broadcast_master_param(model)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach().cpu(), b)
