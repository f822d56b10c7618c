"""``torch_xla._XLAC``: the C extension's functions that
guides call directly, on xlatorch's Python runtime. Only these exist here; any other
name raises ``AttributeError``."""

from __future__ import annotations

from xlatorch.debug import dump
from xlatorch.debug import metrics as _met


def _xla_metrics_report() -> str:
    """The metrics report, as ``met.metrics_report()`` (no sync)."""
    return _met.metrics_report()


def _get_xla_tensors_text(tensors) -> str:
    """The IR of the pending graph behind ``tensors`` (``xd.ir_text``; no sync, no compile)."""
    return dump.ir_text(tensors)


def _get_xla_tensors_hlo(tensors) -> str:
    """The HLO text a sync of ``tensors`` would compile (``xd.hlo_text``; no sync)."""
    return dump.hlo_text(tensors, dialect="hlo")


# ---------------------------------------------------------------------------------------
# The _XLAC functions torch_xla's tests and user scripts call most (issue 29 §4).
# ---------------------------------------------------------------------------------------


def _get_xla_sharding_spec(tensor) -> str:
    """XLA's text of ``tensor``'s sharding (``{devices=[4,1]0,1,2,3}``), "" when it has none."""
    from xlatorch.distributed.spmd import get_sharding_spec

    return get_sharding_spec(tensor)


def _xla_get_default_device() -> str:
    """The default xla device's name (``'xla:0'``)."""
    return "xla:0"


def _xla_sync_multi(tensors, devices=None, wait: bool = True, sync_xla_data: bool = True) -> None:
    """Compute ``tensors`` now (a sync of the pending graph); ``wait``: until they are ready."""
    import xlatorch.core.xla_model as xm

    xm.mark_step(wait=wait)


def _xla_increment_counter(name: str, value: int = 1) -> None:
    """Add ``value`` to counter ``name`` (as ``met.counter_value`` reads it)."""
    from xlatorch.runtime.base.record import COUNTERS

    COUNTERS[name] += value


def _get_executed_fallback_ops() -> list[str]:
    """The ATen ops that ran on CPU since the counters were cleared (``met.executed_fallback_ops``)."""
    return _met.executed_fallback_ops()


def _xla_set_mat_mul_precision(precision: str) -> None:
    """``torch_xla.backends.set_mat_mul_precision``."""
    from xlatorch.backends import set_mat_mul_precision

    set_mat_mul_precision(precision)


def _xla_get_mat_mul_precision() -> str:
    """``torch_xla.backends.get_mat_mul_precision``."""
    from xlatorch.backends import get_mat_mul_precision

    return get_mat_mul_precision()


def _pending(tensor) -> bool:
    from xlatorch.runtime.ir.values import Out
    from xlatorch.runtime.trace.tensor import value_of

    return type(value_of(tensor)) is Out


def _check_tensor_need_materialization(tensors) -> list[bool]:
    """For each tensor, whether its value is still pending (a sync would compute it)."""
    return [_pending(t) for t in tensors]


def _xla_get_tensor_id(tensor) -> int:
    """A number naming ``tensor``'s storage, unique in this process (views share it)."""
    return tensor._st.sid


def _get_graph_hash(tensors) -> bytes:
    """A hash of the graph computing ``tensors``: equal for graphs that compile to the same
    program (the compile cache's key), in this process. Does not sync."""
    from xlatorch.runtime.execute.lowered import graph_of

    nodes, leaves, root_refs = graph_of(tensors, "_XLAC._get_graph_hash")
    key = (tuple(n.key for n in nodes), root_refs, tuple(getattr(v, "sig", None) for v in leaves))
    return hash(key).to_bytes(8, "little", signed=True)


def _get_xla_tensor_debug_info(tensor) -> str:
    """What xlatorch holds for ``tensor``: its id, device, shape, and whether its value is
    device data or a pending IR value (and that node)."""
    from xlatorch.runtime.trace.tensor import value_of

    v = value_of(tensor)
    pending = _pending(tensor)
    dt = str(tensor.dtype).removeprefix("torch.")
    lines = ["XLATensor {", f"TensorID: {_xla_get_tensor_id(tensor)}", f"Device: {tensor.device}",
             f"XLA Shape: {dt}{list(tensor.shape)}", f"ValueNode: {v if pending else 'None'}",
             f"XLAData: {'None' if pending else type(v).__name__}", "}"]  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The distributed runtime and preemption notices (torch_xla's distributed checkpoints).
# ---------------------------------------------------------------------------------------


def _ensure_xla_coordinator_initialized(global_rank: int, world_size: int, master_addr: str,
                                        master_port: int | None = None) -> None:  # fmt: skip
    """Join the job's distributed runtime if it has several processes (one process: nothing to do)."""
    if world_size > 1:
        from xlatorch.runtime.base import topology

        topology.initialize()


def _activate_preemption_sync_manager() -> None:
    """Record ``SIGTERM`` as a preemption notice instead of ending the process."""
    from xlatorch.runtime.base import preemption

    preemption.activate()


def _deactivate_preemption_sync_manager() -> None:
    from xlatorch.runtime.base import preemption

    preemption.deactivate()


def _sync_point_reached(step: int) -> bool:
    """Whether a preemption notice (``SIGTERM``) arrived: checkpoint at this step."""
    from xlatorch.runtime.base import preemption

    return preemption.reached(step)
