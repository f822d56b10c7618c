"""``StableHLOGraphModule``: a program bundle that runs on the xla device.

Calling it runs the StableHLO bytecode itself, not the PyTorch program it came from: the
bytecode becomes a ``jax.export.Exported`` and is called as one node of the lazy graph
(``call_jax``), so a loaded program runs in a process that never saw the model, and its call
is compiled with the rest of the step at the next sync. Weights and constants are moved to
the device once per module.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from xlatorch.runtime.base.dtypes import to_jax
from xlatorch.runtime.trace.jax_calls import call_jax
from xlatorch.runtime.trace.tensor import XlaTensor
from xlatorch.stablehlo.bundle import StableHLOFunc, StableHLOModelBundle, VariableType, load_bundle, save_bundle
from xlatorch.stablehlo.modules import portable
from xlatorch.stablehlo.options import StableHLOExportOptions

__all__ = ["StableHLOGraphModule", "exported_of"]


class StableHLOGraphModule:
    """A :class:`StableHLOModelBundle` to call, save and inspect (torch_xla's class).

    ``module(*args)`` runs the first function (``forward``) on the xla device; CPU tensors
    are moved there, and the results are xla tensors in the exported program's output
    structure. The arguments must have the shapes and dtypes the program was exported for.
    """

    def __init__(self, bundle: StableHLOModelBundle):
        if not bundle.stablehlo_funcs:
            raise ValueError("xlatorch.stablehlo: a StableHLOModelBundle needs at least one function")
        self._bundle = bundle
        self._name_to_stablehlo = {f.meta.name: f for f in bundle.stablehlo_funcs}
        self._default_method = bundle.stablehlo_funcs[0].meta.name
        self._runners: dict = {}  # name -> function of JAX arrays calling the bytecode
        self._on_device: dict = {}  # (kind, key) -> (host array, its device tensor)

    @property
    def meta(self):
        """The default function's ``StableHLOFunctionMeta``."""
        return self._func(None).meta

    def _func(self, method_name) -> StableHLOFunc:
        name = self._default_method if method_name is None else method_name
        if name not in self._name_to_stablehlo:
            raise ValueError(f"xlatorch.stablehlo: no method {name!r}; this program has "
                             f"{sorted(self._name_to_stablehlo)}")  # fmt: skip
        return self._name_to_stablehlo[name]

    def get_stablehlo_bytecode(self, method_name: str | None = None) -> bytes:
        """The function as StableHLO bytecode (a portable artifact, as saved)."""
        return self._func(method_name).bytecode

    def get_stablehlo_text(self, method_name: str | None = None) -> str | None:
        """The function as StableHLO text (None when exported without text)."""
        return self._func(method_name).text

    def save(self, directory_path: os.PathLike | str, options: StableHLOExportOptions | None = None) -> None:
        """Write the bundle under ``directory_path`` (see ``xlatorch.stablehlo.bundle``)."""
        options = options or StableHLOExportOptions()
        save_bundle(self._bundle, directory_path, save_weights=options.save_weights)

    @classmethod
    def load(cls, directory_path: os.PathLike | str) -> StableHLOGraphModule:
        """Read a saved program (``save`` / ``save_as_stablehlo``; torch_xla's directories too)."""
        return cls(load_bundle(directory_path))

    def evaluate(self, method_name: str, args, kwargs=None):
        """Run function ``method_name`` on ``args``: one node of the lazy graph (no sync)."""
        func = self._func(method_name)
        meta = func.meta
        args = tuple(args)
        # The positions are those of torch.export's flattening: pytree leaves of (args, kwargs),
        # the keyword arguments in the exported order.
        kwargs = dict(kwargs or {})
        if kwargs and meta.input_pytree_spec is not None:
            spec = pytree.treespec_loads(meta.input_pytree_spec)
            kids = spec.children()
            if len(kids) == 2 and kids[1].type is dict:
                order = list(kids[1].context)
                kwargs = {k: kwargs[k] for k in order if k in kwargs} | kwargs
        flat = pytree.tree_flatten((args, kwargs))[0]
        call_args = []
        for loc, sig in zip(meta.input_locations, meta.input_signature):
            if loc.type_ is VariableType.INPUT_ARG:
                if loc.position >= len(flat):
                    raise TypeError(f"xlatorch.stablehlo: {meta.name} takes at least {loc.position + 1} inputs "
                                    f"(flattened), got {len(flat)}")  # fmt: skip
                call_args.append(_input(flat[loc.position], sig, loc.position))
            elif loc.type_ is VariableType.PARAMETER:
                if loc.name not in self._bundle.state_dict:
                    raise KeyError(f"xlatorch.stablehlo: the program has no weight {loc.name!r} (saved without "
                                   "weights? put it in module._bundle.state_dict)")  # fmt: skip
                call_args.append(self._state(("p", loc.name), self._bundle.state_dict[loc.name], sig))
            else:
                call_args.append(self._state(("c", loc.position), self._bundle.additional_constants[loc.position], sig))
        runner = self._runners.get(meta.name)
        if runner is None:
            exported = exported_of(func)
            runner = self._runners[meta.name] = lambda arrays: exported.call(*arrays)
        outs = call_jax(runner, (call_args,), name=f"stablehlo.{meta.name}")
        outs = list(outs)
        if meta.output_pytree_spec is not None:
            return pytree.tree_unflatten(outs, pytree.treespec_loads(meta.output_pytree_spec))
        return outs

    def _state(self, key, host, sig) -> torch.Tensor:
        """A weight or constant on the device: moved once, again only when the bundle's array changes."""
        found = self._on_device.get(key)
        if found is not None and found[0] is host:
            return found[1]
        t = _input(host, sig, key[1])
        self._on_device[key] = (host, t)
        return t

    def __call__(self, *args, **kwargs):
        """``evaluate`` the default function (``forward``)."""
        return self.evaluate(self._default_method, args, kwargs)


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"xlatorch.stablehlo: unknown dtype {name!r} in a function's signature")
    return dt


def _input(x, sig, where) -> torch.Tensor:
    """``x`` (a tensor, numpy array or Python number) as an xla tensor of ``sig``'s dtype, checked."""
    dtype = _torch_dtype(sig.dtype)
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "V" or x.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            x = torch.from_numpy(_c_order(x).view(f"u{x.dtype.itemsize}")).view(dtype)
        else:
            x = torch.from_numpy(_c_order(x))
    elif not isinstance(x, torch.Tensor):
        x = torch.tensor(x, dtype=dtype)
    if list(x.shape) != list(sig.shape) or x.dtype != dtype:
        raise ValueError(f"xlatorch.stablehlo: input {where!r} is {str(x.dtype).removeprefix('torch.')}"
                         f"{list(x.shape)}; the program was exported for {sig.dtype}{list(sig.shape)}")  # fmt: skip
    if type(x) is not XlaTensor:
        x = x.detach().to("xla")
    return x


def _c_order(x: np.ndarray) -> np.ndarray:
    # (not np.ascontiguousarray: it makes 0-d arrays 1-d)
    return x if x.flags.c_contiguous and x.flags.writeable else x.copy(order="C")


def _aval(sig):
    return jax.core.ShapedArray(tuple(sig.shape), to_jax(_torch_dtype(sig.dtype)))


def exported_of(func: StableHLOFunc) -> jax.export.Exported:
    """``func``'s bytecode as a ``jax.export.Exported`` of flat arrays (its avals from the meta).

    The bytecode may be a StableHLO portable artifact (what xlatorch and torch_xla write) or
    plain MLIR bytecode / text of a StableHLO module (converted to a portable artifact here).
    """
    code = portable(func.bytecode, f"the bytecode of function {func.meta.name!r}")
    meta = func.meta
    ins = tuple(_aval(s) for s in meta.input_signature)
    outs = tuple(_aval(s) for s in meta.output_signature)
    n, m = len(ins), len(outs)
    platform = jax.default_backend()
    # Not platform-checked: the module was lowered for the exporting process's platform, and
    # StableHLO without custom calls runs on any; a call that does not is XLA's error.
    return jax.export.Exported(
        fun_name=meta.name, in_tree=jax.tree_util.tree_structure(((0,) * n, {})), in_avals=ins,
        out_tree=jax.tree_util.tree_structure((0,) * m), out_avals=outs, _has_named_shardings=False,
        _in_named_shardings=(None,) * n, _out_named_shardings=(None,) * m, in_shardings_hlo=(None,) * n,
        out_shardings_hlo=(None,) * m, nr_devices=1, platforms=(platform,), ordered_effects=(),
        unordered_effects=(), disabled_safety_checks=(jax.export.DisabledSafetyCheck.platform(),),
        mlir_module_serialized=code, calling_convention_version=jax.export.maximum_supported_calling_convention_version,
        module_kept_var_idx=tuple(range(n)), uses_global_constants=False, _get_vjp=None,
    )  # fmt: skip
