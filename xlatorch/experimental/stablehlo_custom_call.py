"""``torch_xla.experimental.stablehlo_custom_call``: StableHLO ``custom_call`` ops on xla tensors,
and the host-offloading ops built on them.

``stablehlo_custom_call`` records one node of the lazy graph whose lowering is a
``stablehlo.custom_call`` to ``call_target`` (a JAX primitive lowered with JAX's own
``custom_call`` emitter): the program holds the call; running it needs a target XLA knows
(built in, or registered with ``jax.ffi.register_ffi_target``), else the compile says so.

``place_to_host`` / ``place_to_device`` (``torch.ops.xla.place_to_host`` / ``place_to_device``)
are XLA's ``annotate_device_placement`` calls (``_xla_buffer_placement`` = ``pinned_host`` /
``device``): on TPU and GPU, XLA's host offloader keeps the value in host memory between them;
on CPU, host memory is the device's, and the values pass unchanged. Their gradient passes
through unchanged; on CPU tensors they are the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jax import core as _core
from jax._src.interpreters import mlir as _mlir
from jax._src.lib.mlir import ir as _ir
from jax.extend.core import Primitive

from xlatorch.core.xla_builder import call_jax
from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.trace.dispatch import RUNTIME_OPS

__all__ = ["extract_custom_call_outputs_shape_dtype", "place_to_device", "place_to_host", "stablehlo_custom_call"]

_custom_call_p = Primitive("xlatorch_stablehlo_custom_call")
_custom_call_p.multiple_results = True


def _abstract_eval(*args, call_target, out_avals, has_side_effect, backend_config, api_version, frontend_attributes):
    return [_core.ShapedArray(shape, dtype) for shape, dtype in out_avals]


def _lower(ctx, *args, call_target, out_avals, has_side_effect, backend_config, api_version, frontend_attributes):
    types = [_mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
    op = _mlir.custom_call(call_target, result_types=types, operands=list(args), backend_config=backend_config,
                           has_side_effect=has_side_effect, api_version=api_version)  # fmt: skip
    if frontend_attributes:
        attrs = {k: _ir.StringAttr.get(v) for k, v in frontend_attributes}
        op.attributes["mhlo.frontend_attributes"] = _ir.DictAttr.get(attrs)
    return op.results


_custom_call_p.def_abstract_eval(_abstract_eval)
_mlir.register_lowering(_custom_call_p, _lower)


def _bind(*arrays, **params):
    return tuple(_custom_call_p.bind(*arrays, **params))


def stablehlo_custom_call(
    args: Sequence[torch.Tensor],
    call_target: str,
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[torch.dtype],
    has_side_effect: bool = False,
    backend_config: str | bytes = "",
    api_version: int = 0,
    frontend_attributes: dict[str, str] | None = None,
):
    """A ``stablehlo.custom_call @call_target(args)`` with results of ``output_shapes`` /
    ``output_dtypes``, recorded as one node of the lazy graph (no sync).

    Args:
      args: the operands (xla tensors).
      call_target: the custom call's target name.
      output_shapes, output_dtypes: one per result.
      has_side_effect: XLA must not remove or duplicate the call.
      backend_config: the opaque string the target receives.
      api_version: the custom call API version (``mhlo.api_version``; 0: the default).
      frontend_attributes: ``mhlo.frontend_attributes`` of the op (strings).

    Returns:
      The result tensor, or a list of them when there are several.
    """
    params = dict(
        call_target=call_target,
        out_avals=tuple((tuple(int(d) for d in s), to_jax(dt)) for s, dt in zip(output_shapes, output_dtypes)),
        has_side_effect=bool(has_side_effect),
        backend_config=backend_config,
        api_version=int(api_version),
        frontend_attributes=tuple(sorted((frontend_attributes or {}).items())),
    )
    if len(params["out_avals"]) != len(output_shapes):
        raise ValueError("stablehlo_custom_call: output_shapes and output_dtypes differ in length")
    key = ("stablehlo_custom_call", *params.items())
    outs = call_jax(_bind, tuple(args), params, name=f"custom_call@{call_target}", override_hash=key)
    return outs[0] if len(output_shapes) == 1 else list(outs)


def extract_custom_call_outputs_shape_dtype(n: torch.fx.Node):
    """``(shapes, dtypes)`` of an FX node's results, from its ``meta['val']``."""
    val = n.meta["val"]
    if isinstance(val, torch.Tensor):
        return [val.shape], [val.dtype]
    if not all(isinstance(t, torch.Tensor) for t in val):
        raise ValueError(f"stablehlo_custom_call: node {n.name} has results that are not tensors")
    return tuple(t.shape for t in val), tuple(t.dtype for t in val)


# Host offloading.


def _placement(t: torch.Tensor, where: str) -> torch.Tensor:
    return stablehlo_custom_call([t], "annotate_device_placement", [t.shape], [t.dtype], has_side_effect=True,
                                 frontend_attributes={"_xla_buffer_placement": where})  # fmt: skip


@torch.library.custom_op("xla::place_to_host", mutates_args=())
def place_to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` kept in host memory (XLA's ``annotate_device_placement`` to ``pinned_host``) until
    ``place_to_device``; the identity on values and gradients."""
    return t.clone()  # a CPU tensor is in host memory already (xla tensors take RUNTIME_OPS)


@torch.library.custom_op("xla::place_to_device", mutates_args=())
def place_to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` brought back to device memory (``annotate_device_placement`` to ``device``); the
    identity on values and gradients."""
    return t.clone()


for _op in (place_to_host, place_to_device):
    _op.register_fake(lambda t: torch.empty_like(t))
    _op.register_autograd(lambda ctx, grad: grad)

RUNTIME_OPS.update({
    torch.ops.xla.place_to_host.default: lambda t: _placement(t, "pinned_host"),
    torch.ops.xla.place_to_device.default: lambda t: _placement(t, "device"),
})  # fmt: skip
