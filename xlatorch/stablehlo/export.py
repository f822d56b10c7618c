"""``torch.export`` programs to StableHLO bundles: trace lazily, lower, ``jax.export``.

The exported program's graph runs once on the xla device under :class:`XLAExportInterpreter`,
lazily (nothing executes, nothing compiles): its flat inputs are the weights, buffers and
lifted constants, then the user inputs. The ATen graph this records is lowered by the same
ops.yaml emitters a training step uses, and ``jax.export`` turns that into a StableHLO
module whose ``main`` takes one argument per device-data leaf of the graph; the graph's
Python numbers become constants of the module (``inline_all_constant``, the default) or more
arguments. Dynamic dimensions are specialised to the example inputs' sizes.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from xlatorch.runtime.base import topology
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.execute.lowered import graph_of
from xlatorch.runtime.execute.materialize import materialized
from xlatorch.runtime.execute.transfer import to_device
from xlatorch.runtime.ir.emit import hlo_scopes
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.lower.function import lower_fn, plan
from xlatorch.runtime.plan.collect import pack
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, wrap
from xlatorch.stablehlo.bundle import (
    InputLocation,
    StableHLOFunc,
    StableHLOFunctionMeta,
    StableHLOModelBundle,
    VariableSignature,
)
from xlatorch.stablehlo.graph_module import StableHLOGraphModule
from xlatorch.stablehlo.modules import artifact_version, module_text
from xlatorch.stablehlo.options import StableHLOExportOptions

__all__ = ["XLAExportInterpreter", "exported_program_to_stablehlo", "save_as_stablehlo",
           "save_torch_model_as_stablehlo"]  # fmt: skip


class XLAExportInterpreter(torch.fx.Interpreter):
    """Runs an exported program's graph on the xla device (torch_xla's class).

    Ops that create tensors (a ``device=`` keyword) create them on ``device``; a Python float
    passed where the op's schema takes a Tensor becomes a 0-d tensor of the default dtype (as
    eager PyTorch would make it), not a double scalar. Ops in a namespace of
    ``custom_ops_allowed_in_graph`` raise NotImplementedError (no ``stablehlo.custom_call``
    lowering here). ``gm_serializer`` is accepted for torch_xla's signature and unused.
    """

    def __init__(self, module, device, custom_ops_allowed_in_graph=(), gm_serializer=None):
        super().__init__(module)
        self._device = device
        self.tensor_id_to_dynamic_dims: dict = {}
        self.custom_ops_allowed_in_graph = set(custom_ops_allowed_in_graph or ())
        self.gm_serializer = gm_serializer

    def call_function(self, target, args: tuple, kwargs: dict) -> Any:
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return _assert_metadata(*args, **kwargs)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": self._device}
        schema = getattr(target, "_schema", None)
        if schema is not None:
            args = tuple(
                torch.tensor(a) if type(a) is float and isinstance(s.type, torch.TensorType) else a
                for a, s in zip(args, schema.arguments)
            ) + tuple(args[len(schema.arguments) :])
        return super().call_function(target, args, kwargs)

    def run_node(self, n) -> Any:
        if n.op == "call_function" and getattr(n.target, "namespace", None) in self.custom_ops_allowed_in_graph:
            raise NotImplementedError(f"xlatorch.stablehlo: {n.target} would be a stablehlo.custom_call "
                                      "(custom_ops_allowed_in_graph), which xlatorch does not export")  # fmt: skip
        return super().run_node(n)


def _assert_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None):
    """``aten._assert_tensor_metadata`` (torch.export's check of a value's metadata) on the
    device tensor's own metadata: no CPU fallback. Strides and device are not checked: device
    tensors are contiguous and on the export's device by construction."""
    if dtype is not None and a.dtype != dtype:
        raise AssertionError(f"xlatorch.stablehlo: a tensor of the program has dtype {a.dtype}, expected {dtype}")
    if size is not None and tuple(a.shape) != tuple(size):
        raise AssertionError(f"xlatorch.stablehlo: a tensor of the program has shape {tuple(a.shape)}, expected "
                             f"{tuple(size)}")  # fmt: skip


def _to_device(x):
    """``x`` as an xla tensor holding device data (never a pending value): each input is then
    exactly one argument of ``main``, found by its data."""
    if not isinstance(x, torch.Tensor):
        return x
    if type(x) is XlaTensor or x.device.type == "xla":
        return wrap(materialized(x.detach()))
    return wrap(to_device(x.detach()))


def _example(ep, options) -> tuple[tuple, dict]:
    args, kwargs = options.override_tracing_arguments, options.override_tracing_kwargs
    if args is None:
        if not ep.example_inputs:
            raise ValueError("xlatorch.stablehlo: the exported program has no example inputs; pass "
                             "StableHLOExportOptions(override_tracing_arguments=args)")  # fmt: skip
        args, kwargs = ep.example_inputs
    elif len(args) == 2 and isinstance(args[0], (tuple, list)) and isinstance(args[1], dict) and kwargs is None:
        args, kwargs = args  # xlatorch's older (args, kwargs) form
    return tuple(args), dict(kwargs or {})


def _sig(shape, dtype) -> VariableSignature:
    return VariableSignature(shape=[int(d) for d in shape], dtype=str(dtype).removeprefix("torch."))


def _host(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        import ml_dtypes

        np_dt = {torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
                 torch.float8_e5m2: ml_dtypes.float8_e5m2}[t.dtype]  # fmt: skip
        return t.contiguous().view(torch.uint8).numpy().view(np_dt).reshape(t.shape)
    return t.numpy()


def _exported_program_to_stablehlo_bundle(ep, options: StableHLOExportOptions) -> StableHLOModelBundle:
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(
            "xlatorch.stablehlo.exported_program_to_stablehlo expects a torch.export.ExportedProgram "
            f"(torch.export.export(model, args)), got {type(ep).__name__}"
        )
    if topology.SPMD[0]:
        raise NotImplementedError("xlatorch.stablehlo: exporting under SPMD (use_spmd) is not supported")
    args, kwargs = _example(ep, options)
    flat = ep._graph_module_flat_inputs(args, kwargs)
    flat_dev = [_to_device(x) for x in flat]
    sig = ep.graph_signature
    fallbacks = {k: v for k, v in COUNTERS.items() if k.startswith("aten::")}
    interp = XLAExportInterpreter(ep.graph_module, torch.device("xla"), options.custom_ops_allowed_in_graph)
    with torch.no_grad():
        res = interp.run(*flat_dev, enable_io_processing=False)
    ran_on_cpu = sorted(k for k, v in COUNTERS.items() if k.startswith("aten::") and v > fallbacks.get(k, 0))
    if ran_on_cpu:
        raise RuntimeError("xlatorch.stablehlo: this model contains ops with no lowering (they ran on CPU and "
                           f"cannot be exported): {', '.join(ran_on_cpu)}")  # fmt: skip
    kinds = [s.kind for s in sig.output_specs]
    outs = [r for r, k in zip(res, kinds) if k == torch.export.graph_signature.OutputKind.USER_OUTPUT]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise NotImplementedError("xlatorch.stablehlo: programs returning non-tensor values are not supported")

    # Which argument of main each device-data leaf is.
    user_kind = torch.export.graph_signature.InputKind.USER_INPUT
    where: dict = {}  # id(device data) -> InputLocation
    state_dict: dict = {}
    n_user = 0
    user_sigs = []
    for spec, x, xd in zip(sig.input_specs, flat, flat_dev):
        if spec.kind == user_kind:
            loc = InputLocation.input_arg(n_user)
            n_user += 1
            user_sigs.append((loc, _sig(x.shape, x.dtype) if isinstance(x, torch.Tensor) else
                              VariableSignature(shape=[], dtype=type(x).__name__)))  # fmt: skip
        elif isinstance(x, torch.Tensor):
            loc = InputLocation.parameter(spec.target)
            state_dict[spec.target] = x
        else:
            continue
        if isinstance(xd, torch.Tensor):
            where.setdefault(id(value_of(xd)), loc)

    nodes, leaves, root_refs = graph_of(outs, "xlatorch.stablehlo")
    if any(n.spec in COLLECTIVES for n in nodes):
        raise NotImplementedError("xlatorch.stablehlo: graphs with collectives are not supported")
    packed, leaf_kinds = pack(leaves)
    fn = lower_fn(plan(nodes, leaves), leaf_kinds, root_refs, hlo_scopes(nodes))
    data = [v for v in leaves if type(v) is Data]
    locations, in_sigs, constants = [], [], []
    for v in data:
        loc = where.get(id(v))
        if loc is None:  # a tensor the program made: saved with it
            loc = InputLocation.constant(len(constants))
            constants.append(np.asarray(jax.device_get(v.array)))
        locations.append(loc)
        in_sigs.append(_sig(v.aval[0], v.aval[1]))
    avals = [jax.ShapeDtypeStruct(v.aval[0], to_jax(v.aval[1])) for v in data]
    n_data, n_out = len(data), len(root_refs)
    if options.inline_all_constant:

        def main(*arrays):  # the numbers are constants of the module
            return tuple(fn(list(arrays), packed)[:n_out])  # [:n_out]: no on-device check rows

    else:  # as torch_xla: 0 and 1 stay constants, every other number is an argument of main
        slots = []  # per packed group: each value's numpy scalar, or its argument's index
        for p in packed:
            row = []
            for x in p:
                if x == 0 or x == 1:
                    row.append(x)
                    continue
                row.append(len(avals))
                locations.append(InputLocation.constant(len(constants)))
                constants.append(np.asarray(x))
                in_sigs.append(VariableSignature(shape=[], dtype=str(p.dtype)))
                avals.append(jax.ShapeDtypeStruct((), p.dtype))
            slots.append(row)

        def main(*arrays):
            groups = [[arrays[x] if type(x) is int else x for x in row] for row in slots]
            return tuple(fn(list(arrays[:n_data]), groups)[:n_out])

    exported = jax.export.export(jax.jit(main, keep_unused=True))(*avals)
    code = exported.mlir_module_serialized
    text = None
    if options.include_human_readable_text:
        text = module_text(code, debug_info=options.include_debug_info or options.export_node_metadata)
    used = {loc.position for loc in locations if loc.type_.value == "input_arg"}
    meta = StableHLOFunctionMeta(
        name="forward",
        stablehlo_version=artifact_version(code),
        input_signature=in_sigs,
        output_signature=[_sig(o.shape, o.dtype) for o in outs],
        input_locations=locations,
        unused_inputs=[(loc, s) for loc, s in user_sigs if loc.position not in used],
        input_pytree_spec=pytree.treespec_dumps(ep.call_spec.in_spec) if ep.call_spec.in_spec else None,
        output_pytree_spec=pytree.treespec_dumps(ep.call_spec.out_spec) if ep.call_spec.out_spec else None,
    )
    weights = {k: _host(t) for k, t in state_dict.items()} if options.export_weights else {}
    return StableHLOModelBundle(state_dict=weights, additional_constants=constants,
                                stablehlo_funcs=[StableHLOFunc(meta, code, text)])  # fmt: skip


def exported_program_to_stablehlo(exported_model, options: StableHLOExportOptions | None = None):
    """Lower ``exported_model`` (from ``torch.export.export``) to StableHLO.

    Records the program once on the xla device with its example inputs (or
    ``options.override_tracing_arguments`` / ``override_tracing_kwargs``) and lowers the
    recorded graph as a sync would, then to a StableHLO portable artifact; neither compiles
    nor runs anything. Returns a :class:`StableHLOGraphModule`: calling it runs the StableHLO
    on the device, with the example inputs' shapes and dtypes.

    Raises:
      TypeError: ``exported_model`` is not an ``ExportedProgram``.
      RuntimeError: an op of the program has no lowering (it would run on CPU).
    """
    return StableHLOGraphModule(
        _exported_program_to_stablehlo_bundle(exported_model, options or StableHLOExportOptions())
    )


def save_as_stablehlo(exported_model, stablehlo_dir: os.PathLike | str, options: StableHLOExportOptions | None = None):
    """Export ``exported_model`` (``exported_program_to_stablehlo``) and write it under
    ``stablehlo_dir`` (created if missing): StableHLO bytecode and meta in ``functions/``,
    weights in ``data/`` (unless ``options.save_weights`` is False), constants in
    ``constants/``, and a ``version`` file. ``StableHLOGraphModule.load(stablehlo_dir)``
    reads it back, in any process."""
    options = options or StableHLOExportOptions()
    exported_program_to_stablehlo(exported_model, options).save(stablehlo_dir, options)


def save_torch_model_as_stablehlo(torchmodel: torch.nn.Module, args: tuple, path: os.PathLike | str,
                                  options: StableHLOExportOptions | None = None) -> None:  # fmt: skip
    """``torch.export.export(torchmodel, args)`` then :func:`save_as_stablehlo` to ``path``,
    traced with ``args``."""
    exported = torch.export.export(torchmodel, tuple(args))
    options = options or StableHLOExportOptions()
    options.override_tracing_arguments = tuple(args)
    save_as_stablehlo(exported, path, options)
