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


def _get_xla_sharding_type(tensor) -> int | None:
    """The kind of ``tensor``'s sharding as torch_xla numbers it (``xs.ShardingType``), None
    when it has none."""
    from xlatorch.distributed.spmd.xla_sharding import sharding_type_of

    kind = sharding_type_of(tensor)
    return None if kind is None else int(kind)


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
             f"XLAData: {'None' if pending else type(v).__name__}"]  # fmt: skip
    if not pending and getattr(v, "array", None) is not None:
        lines.append(f"Data Handle: {'Deleted' if v.array.is_deleted() else 'Live'}")  # donated away, or not
    from xlatorch.runtime.base import topology

    if topology.SPMD[0]:  # as torch_xla prints an SPMD tensor: its sharding, and its data's shards
        spec = _get_xla_sharding_spec(tensor)
        lines.append(f"ShardingSpec: {spec or 'None'}")
        arr = getattr(v, "array", None) if not pending else None
        if arr is not None and not arr.is_deleted():
            lines += ["XLAShardedData", "Data Device: SPMD:0", f"OpSharding: {spec or '{replicated}'}",
                      f"NumShards: {len(arr.sharding.device_set)}"]  # fmt: skip
    return "\n".join([*lines, "}"])


# ---------------------------------------------------------------------------------------
# Buffer donation, dynamic marks, dot_general, device data of a graph, TPU custom calls.
# ---------------------------------------------------------------------------------------


def _device_data(tensor):
    from xlatorch.runtime.ir.values import Data
    from xlatorch.runtime.trace.tensor import XlaTensor, value_of

    if type(tensor) is not XlaTensor:
        return None
    v = value_of(tensor)
    return v if type(v) is Data else None


def _set_buffer_donation(tensor, should_donate: bool) -> bool:
    """Mark the device buffer that ``tensor`` holds donatable (or not): a later sync whose
    program reads it may hand it to an output of the same shape and dtype (XLA writes that
    output in place), even though ``tensor`` still holds it; ``tensor`` (and every tensor on
    that buffer) cannot be read after that sync. The mark belongs to the buffer: a tensor's
    new value (``t += 1``, a sync's output) is not marked.

    Returns False, marking nothing, when ``tensor`` holds no device data (a pending value).
    Counted as ``XlaSetBufferDonation``.
    """
    data = _device_data(tensor)
    if data is None:
        return False
    data.donor = bool(should_donate)
    _xla_increment_counter("XlaSetBufferDonation")
    return True


def _get_buffer_donation(tensor) -> bool:
    """Whether ``tensor`` holds device data marked donatable (``_set_buffer_donation``)."""
    data = _device_data(tensor)
    return data is not None and data.donor


def _xla_mark_dynamic(tensor, dim: int) -> None:
    """Record that dimension ``dim`` of ``tensor`` is dynamic (torch_xla's unbounded dynamism
    for StableHLO export), in ``tensor._xla_dynamic_dims``. xlatorch lowers static shapes
    only: the program keeps the dimension's present size, so its values are exact for that
    size; a warning says so. For a program over dynamic sizes, export with ``torch.export``'s
    ``dynamic_shapes``. Counted as ``XlaMarkDynamic``."""
    import warnings

    if not _is_xla(tensor):
        raise RuntimeError(f"_xla_mark_dynamic: expected a tensor on the xla device, got one on '{tensor.device}'")
    d = dim + tensor.dim() if dim < 0 else dim
    if not 0 <= d < tensor.dim():
        raise IndexError(f"_xla_mark_dynamic: dimension {dim} out of range for a {tensor.dim()}-d tensor")
    _xla_increment_counter("XlaMarkDynamic")
    dims = getattr(tensor, "_xla_dynamic_dims", set())
    dims.add(d)
    tensor._xla_dynamic_dims = dims
    warnings.warn(f"xlatorch lowers static shapes only: dimension {d} marked dynamic keeps its size "
                  f"{tensor.shape[d]} in the program", stacklevel=2)  # fmt: skip


def _is_xla(tensor) -> bool:
    from xlatorch.runtime.trace.tensor import XlaTensor

    return type(tensor) is XlaTensor


def _dot_general_jax(lhs, rhs, dimension_numbers, preferred_element_type=None):
    import jax

    return jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)


def _xla_dot_general(lhs, rhs, dimension_numbers, precision_config=None, preferred_element_type=None):
    """XLA's DotGeneral (``jax.lax.dot_general``) of two xla tensors, recorded as one node (no
    sync); differentiable through ``jax.vjp``.

    Args:
      lhs, rhs: the operands (on the xla device).
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``;
        negative dimensions count from the end; ``()`` for no batch dimensions.
      precision_config: must be None (as in torch_xla).
      preferred_element_type: the result's dtype (a ``torch.dtype``), e.g. ``torch.int32``
        for int8 operands; default: the operands' promoted dtype.
    """
    from xlatorch.core.xla_builder import j2t_autograd
    from xlatorch.runtime.base.dtypes import to_jax

    if precision_config is not None:
        raise RuntimeError("_xla_dot_general: precision_config is not supported; leave it None (default precision)")
    for t, position in ((lhs, "first"), (rhs, "second")):
        if not _is_xla(t):
            kind = f"{t.device.type.upper()}{t.type().rsplit('.', 1)[-1].removesuffix('Tensor')}Type"  # CPUBFloat16Type
            raise RuntimeError(f"Expected input tensor ({position} argument) to be an actual XLA tensor. "
                               f"Got: {kind}. Consider moving it ({position} argument) to XLA.")  # fmt: skip
    contracting, batch = (tuple(dimension_numbers) + ((), ()))[:2]
    batch = tuple(batch) or ((), ())
    norm = [[[d % t.dim() for d in dims] for dims, t in zip(pair, (lhs, rhs))] for pair in (contracting, batch)]
    dims = tuple(tuple(tuple(d) for d in pair) for pair in norm)
    pref = None if preferred_element_type is None else to_jax(preferred_element_type)
    return j2t_autograd(_dot_general_jax)(lhs, rhs, dims, pref)


def _xla_tpu_custom_call(inputs, payload: str, output_shapes, output_dtypes):
    """torch_xla's call of a compiled Pallas (Mosaic) kernel by its serialized ``payload``:
    only TPU runs Mosaic kernels. On other platforms this raises, saying what to use instead."""
    import jax

    platform = jax.devices()[0].platform
    if platform != "tpu":
        raise RuntimeError(
            f"_xla_tpu_custom_call runs a Mosaic (Pallas TPU) kernel, which only a TPU can run; this "
            f"process runs on '{platform}'. Call the Pallas kernel's JAX function with "
            "xlatorch.core.xla_builder.call_jax instead (JAX runs Pallas kernels on GPU, or "
            "interpreted with interpret=True on CPU)."
        )
    raise NotImplementedError(
        "_xla_tpu_custom_call: xlatorch does not take serialized Mosaic payloads; call the Pallas "
        "kernel's JAX function with xlatorch.core.xla_builder.call_jax"
    )


def _get_tensors_xla_device_data_node(output_tensors, uncloned_tensors=()) -> tuple[list[int], list]:
    """The device-data inputs of the graph computing ``output_tensors``: ``(tensor ids,
    tensors)``, one per distinct buffer, in the graph's order. Each is the tensor of
    ``uncloned_tensors`` holding that buffer if there is one, else a live tensor holding it (a
    scan of the heap: for tracing tools, not for every step), else a new tensor on it. Does
    not sync. Tensors off the xla device are skipped."""
    import gc

    from xlatorch.runtime.execute.lowered import graph_of
    from xlatorch.runtime.ir.values import Data
    from xlatorch.runtime.trace.tensor import Storage, wrap

    outs = [t for t in output_tensors if _is_xla(t)]
    _, leaves, _ = graph_of(outs, "_XLAC._get_tensors_xla_device_data_node")
    datas = [v for v in leaves if type(v) is Data]
    by_data = {id(_device_data(t)): t for t in uncloned_tensors if _device_data(t) is not None}
    missing = {id(d) for d in datas} - by_data.keys()
    if missing:
        holders = {}
        for st in gc.get_referrers(*[d for d in datas if id(d) in missing]):
            if type(st) is Storage and id(st.value) in missing:
                holders.setdefault(id(st.value), st)
        for key, st in holders.items():
            t = next((r() for r in st.refs if r() is not None and r()._st is st and r()._vw is None), None)
            if t is not None:
                by_data[key] = t
    tensors = [by_data[id(d)] if id(d) in by_data else wrap(d) for d in datas]
    return [_xla_get_tensor_id(t) for t in tensors], tensors


def _is_placecholder(tensor) -> bool:
    """Whether ``tensor`` holds a device buffer that has no value (torch_xla's spelling): a
    placeholder (``xla_builder.create_placeholder_tensor``) or a buffer donated away."""
    data = _device_data(tensor)
    return data is not None and data.array.is_deleted()


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
