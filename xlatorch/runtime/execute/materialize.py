"""Reading a device tensor: its graph run if its value is pending, then its data downloaded
(``to_cpu``) or kept on the device (``materialized``).
"""

from __future__ import annotations

import jax
import torch

from xlatorch.runtime.base import record
from xlatorch.runtime.base.topology import jax_device
from xlatorch.runtime.execute import settle
from xlatorch.runtime.execute.sync import sync
from xlatorch.runtime.execute.transfer import from_array
from xlatorch.runtime.ir.emit import emit_node
from xlatorch.runtime.ir.values import Data, Out
from xlatorch.runtime.trace import tensor
from xlatorch.runtime.trace.nodes import replay_on_cpu
from xlatorch.runtime.trace.strides import STORAGE_LAYOUT
from xlatorch.runtime.trace.tensor import XlaTensor, value_of

__all__ = ["to_cpu", "materialized", "to_other_device"]


def to_other_device(t: XlaTensor, dev: int) -> Data:
    """``t``'s value as device data on local device ``dev`` (a sync if pending, then one copy)."""
    v = materialized(t)
    return Data(jax.device_put(v.array, jax_device(dev)), v.aval, dev)


def to_cpu(t: XlaTensor, reason: str = "to_cpu") -> torch.Tensor:
    """Download a device tensor (a graph cut if it is pending, reported as ``reason``); a view
    is applied on CPU."""
    cpu = _base_to_cpu(t._st, reason)
    vw = t._vw  # read after the sync: it may have made a lone view a plain tensor
    if vw is not None:
        for step in vw:
            cpu = replay_on_cpu(step, cpu)
        return cpu.clone()
    return cpu


def _base_to_cpu(st, reason: str = "to_cpu") -> torch.Tensor:
    settle.settle()  # first: an undone step gives the storage its data from before it
    if type(st.value) is Out:
        sync(reason, st.dev, st)
        if type(st.value) is Out:  # a value whose earlier sync failed: raise its error
            sync_value(st.value)
    v = st.value
    if v.host is not None:  # held on the host too (execute/host.py): a copy, never the value itself
        cpu = v.host.clone()
    else:
        with record.TIMED("TransferFromDeviceTime"):
            cpu = from_array(v.array, v.aval[1])
    layout = STORAGE_LAYOUT.get(st)
    if layout is not None:  # an op's result laid out as on CPU (trace/strides.py): its views need it
        cpu = torch.empty_strided(cpu.shape, layout, dtype=cpu.dtype).copy_(cpu)
    return cpu


def materialized(t: XlaTensor):
    """The tensor's device data, running its graph if needed (a view: a copy of its elements)."""
    settle.settle()
    if t._vw is not None:  # a view's value is derived from its base on every read: copy it out
        t = torch.ops.aten.clone.default(t)
    v = value_of(t)
    if type(v) is not Data:
        sync("materialize", t._st.dev)
        v = value_of(t)
        if type(v) is Out:
            sync_value(v)
    return v


def sync_value(v: Out) -> None:
    """Compute one value that is not pending (only failed values are): raises their error."""
    emit_node(v.node.spec, v.node.args, v.node.info)
    raise AssertionError("unreachable: a non-pending value that is not failed")


tensor.TO_CPU = to_cpu  # tensor.tolist(), tensor.numpy()
