"""``XlaFullyShardedDataParallel``: ZeRO-3 over the replicas of a multi-process job.

Each unit (an FSDP-wrapped module, not counting the units nested in it) keeps, on every rank,
1/N of each of its parameters: the parameter flattened, padded to a multiple of N, rank r's
slice. These shards are the only parameters the model reports, so an optimizer built on
``model.parameters()`` holds 1/N of the state. A forward gathers the unit's full parameters
(``xm.all_gather``, an IR collective) and sets them as plain attributes of the modules that
own them; the gather is an autograd function whose backward is ``xm.reduce_scatter`` (mean over
the replicas), so each rank's shard receives the average of every rank's gradient for its
slice. ``optimizer.step()`` then updates only the shard.

Freeing (``reshard_after_forward``): after the forward the attributes point at an empty
placeholder, and what autograd saves of the gathered parameters is replaced (saved-tensor
hooks) by a key; when the backward reaches the unit's outputs a hook gathers the shards again
and the keys resolve to that second gather. In the one XLA program of a step the forward's
gathered parameters are then dead once the forward's last use has run. Optimization barriers
tie each gather to the unit's inputs (forward) or its output gradient (backward), so XLA can
neither hoist it nor merge the backward's gather into the forward's.

Autograd saves a parameter by identity only when an op saves the tensor it was given (convs,
normalisations, matmul with a non-transposed weight); ``nn.Linear`` layers are patched to do
so (``utils.apply_xla_patch_to_nn_linear``). Ops that save a new view of a weight keep the
forward's gather alive until their backward (correct results, less memory saved).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import xlatorch.core.xla_model as xm
import xlatorch.runtime as xr
from xlatorch.distributed.fsdp.utils import apply_xla_patch_to_nn_linear
from xlatorch.distributed.fsdp.wrap import recursive_wrap

__all__ = ["XlaFullyShardedDataParallel", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SEP = "_FSDP_SHARD_SEPARATOR_"
_WRAPPED = "_fsdp_wrapped_module"
_ACTIVE = threading.local()  # .depth: FSDP forwards running on this thread (0: the next one is a root)


class _Param(NamedTuple):
    shape: torch.Size
    offset: int  # in the unit's gathered vector (flat units)
    numel: int


class _Unit:
    """One shard parameter and what it stands for: the distinct full parameters (``params``) and
    the module attributes that hold them (``slots``: module, attribute name, index in params)."""

    def __init__(self, shard: nn.Parameter, params: list[_Param], slots: list, dim0: bool, flat_info=None):
        self.shard, self.params, self.slots, self.dim0, self.flat_info = shard, params, slots, dim0, flat_info
        self.grad_acc = None  # full gradient summed locally under no_sync()

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The full parameters inside a gathered (padded) tensor."""
        if self.dim0:
            (p,) = self.params
            return [full if full.shape[0] == p.shape[0] else full.narrow(0, 0, p.shape[0])]
        return [full.narrow(0, p.offset, p.numel).view(p.shape) for p in self.params]


class _Gather(torch.autograd.Function):
    """All-gather of a unit's shards (cast to the compute dtype); backward: reduce-scatter of
    the full gradient, scaled by 1/N (the replicas' mean), in the shard's dtype."""

    @staticmethod
    def forward(ctx, shard, owner, unit):
        ctx.owner, ctx.unit, ctx.dtype = owner, unit, shard.dtype
        return xm.all_gather(shard.to(owner.compute_dtype), 0, groups=owner.sharding_groups)

    @staticmethod
    def backward(ctx, grad):
        return ctx.owner._reduce_grad(ctx.unit, grad, ctx.dtype), None, None


class _Key(NamedTuple):
    """What autograd keeps instead of a gathered parameter it saved (see ``_Regather``)."""

    regather: _Regather
    unit: int
    index: int


class _Regather:
    """One forward's saved-tensor hooks: gathered parameters become keys; in the backward a key
    is resolved against the second gather (made by the pre-backward hook, or here on demand)."""

    def __init__(self, owner: XlaFullyShardedDataParallel, gathered: list[list[torch.Tensor]]):
        self.owner = owner
        self.ids = {id(t): (u, i) for u, ts in enumerate(gathered) for i, t in enumerate(ts)}
        self.full = None  # [[tensor, ...] per unit]: the backward's gather, detached

    def pack(self, t):
        key = self.ids.get(id(t))
        return t if key is None else _Key(self, *key)

    @staticmethod
    def unpack(x):
        if type(x) is not _Key:
            return x
        r = x.regather
        if r.full is None:
            with torch.no_grad():
                r.full = r.owner._gather()
        return r.full[x.unit][x.index]


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if type(obj) is dict:
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _materialize(module: nn.Module, param_init_fn) -> None:
    """Modules built on the meta device get storage (on CPU) and their initialisation."""
    if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        return
    module.to_empty(device="cpu")
    if param_init_fn is not None:
        param_init_fn(module)
        return
    for m in module.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


class XlaFullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over the replicas of the job (torch_xla's FSDP).

    Build the optimizer after wrapping, on the wrapper's ``parameters()`` (the shards), and call
    ``optimizer.step()`` directly: gradients are already averaged (``xm.optimizer_step`` works
    too: it leaves shards alone). Wrap inner modules first (or pass ``auto_wrap_policy``) so
    each unit's full parameters exist only around its own forward and backward.

    Args:
      module: the module; its parameters may be on CPU, on the device or on the meta device.
      reshard_after_forward: free the gathered parameters after the forward and gather again
        in the backward (ZeRO-3); False keeps them until the backward is done (ZeRO-2).
      flatten_parameters: one shard per unit (trainable and frozen parameters apart) instead of
        one per parameter; the optimizer then sees one flat vector per unit.
      execute_sharding_on_init: sync after sharding, so the full parameters' memory goes now.
      optimization_barrier_in_forward / _in_backward: tie each gather to the unit's inputs /
        output gradient with an XLA optimization barrier (see the module docstring).
      sync_on_finalization: ``xm.mark_step()`` at the end of the root's backward.
      disable_reshard_on_root: the outermost unit keeps its parameters between forward and
        backward (they are needed at once).
      compute_dtype: dtype of the gathered parameters and of floating inputs (shards stay in
        their own dtype); buffer_dtype: floating buffers' dtype (default compute_dtype).
      fp32_reduce_scatter: reduce gradients in float32 whatever the compute dtype.
      sharding_groups, sharding_rank, sharding_world_size: shard within replica groups
        (lists of ordinals partitioning the job) instead of over every replica.
      shard_param_on_dim_0: shard along dimension 0 without flattening.
      auto_wrap_policy, auto_wrapper_callable: wrap submodules first (``fsdp.wrap``), with
        ``auto_wrapper_callable(module, **options)`` (default: this class).
      param_init_fn: initialises a module built on the meta device (default: each
        submodule's ``reset_parameters``).
      _shard_size_multiple: pad each flat parameter to a multiple of N times this (torch_xla
        uses 128 for TPU layouts; 1 here, so tiny parameters are not padded to 128 * N).
      _use_xla_patched_linear: patch ``nn.Linear`` (see the module docstring).

    ``pin_layout_in_collective_ops``, ``reduce_scatter_bucket_size_mb``,
    ``coalesce_all_gather_ops`` and ``_debug_*`` are accepted for torch_xla's signature; XLA
    chooses layouts and fuses collectives here.
    """

    def __init__(self, module: nn.Module, reshard_after_forward: bool = True, flatten_parameters: bool = False,
                 execute_sharding_on_init: bool = True, optimization_barrier_in_forward: bool = True,
                 optimization_barrier_in_backward: bool = True, sync_on_finalization: bool = False,
                 disable_reshard_on_root: bool = True, compute_dtype: torch.dtype | None = None,
                 buffer_dtype: torch.dtype | None = None, fp32_reduce_scatter: bool = False,
                 sharding_groups=None, sharding_rank: int | None = None, sharding_world_size: int | None = None,
                 shard_param_on_dim_0: bool = False, pin_layout_in_collective_ops: bool = True,
                 reduce_scatter_bucket_size_mb: int | None = 0, coalesce_all_gather_ops: bool = False,
                 auto_wrap_policy: Callable | None = None, auto_wrapper_callable: Callable | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, _shard_size_multiple: int = 1,
                 _use_xla_patched_linear: bool = True, **_debug: Any):  # fmt: skip
        if isinstance(module, XlaFullyShardedDataParallel):
            raise RuntimeError("Cannot wrap a module that is already wrapped with FSDP: wrap the inner modules "
                               "before the outer one")  # fmt: skip
        if getattr(module.forward, "__func__", None) is nn.Module.forward:
            raise RuntimeError("FSDP wraps modules that define forward (not nn.ModuleList / nn.ModuleDict), "
                               "and the wrapper itself must be called")  # fmt: skip
        for dt, what in ((compute_dtype, "compute_dtype"), (buffer_dtype, "buffer_dtype")):
            if dt is not None and dt not in FLOAT_DTYPES:
                raise ValueError(f"{what} must be one of {FLOAT_DTYPES}, not {dt}")
        super().__init__()
        options = dict(reshard_after_forward=reshard_after_forward, flatten_parameters=flatten_parameters,
                       execute_sharding_on_init=execute_sharding_on_init,
                       optimization_barrier_in_forward=optimization_barrier_in_forward,
                       optimization_barrier_in_backward=optimization_barrier_in_backward,
                       sync_on_finalization=sync_on_finalization, disable_reshard_on_root=disable_reshard_on_root,
                       compute_dtype=compute_dtype, buffer_dtype=buffer_dtype,
                       fp32_reduce_scatter=fp32_reduce_scatter, sharding_groups=sharding_groups,
                       sharding_rank=sharding_rank, sharding_world_size=sharding_world_size,
                       shard_param_on_dim_0=shard_param_on_dim_0,
                       pin_layout_in_collective_ops=pin_layout_in_collective_ops, param_init_fn=param_init_fn,
                       _shard_size_multiple=_shard_size_multiple,
                       _use_xla_patched_linear=_use_xla_patched_linear)  # fmt: skip
        if auto_wrap_policy is not None:
            if any(isinstance(m, XlaFullyShardedDataParallel) for m in module.modules()):
                raise ValueError("auto_wrap_policy wraps unwrapped modules only: this one holds an FSDP unit")
            recursive_wrap(module, auto_wrap_policy, auto_wrapper_callable or XlaFullyShardedDataParallel,
                           only_wrap_children=True, **options)  # fmt: skip
        self.reshard_after_forward = reshard_after_forward
        self.disable_reshard_on_root = disable_reshard_on_root
        self.flatten_parameters = flatten_parameters
        self.optimization_barrier_in_forward = optimization_barrier_in_forward
        self.optimization_barrier_in_backward = optimization_barrier_in_backward
        self.sync_on_finalization = sync_on_finalization
        self.compute_dtype = compute_dtype or torch.float32
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.sharding_groups = sharding_groups
        if sharding_groups is None:
            self.rank, self.world_size = xr.global_ordinal(), xr.world_size()
        elif sharding_rank is None or sharding_world_size is None:
            raise ValueError("sharding_rank and sharding_world_size must be given with sharding_groups")
        else:
            self.rank, self.world_size = sharding_rank, sharding_world_size
        self._shard_param_on_dim_0 = shard_param_on_dim_0 and not flatten_parameters
        self._shard_size_multiple = 1 if self._shard_param_on_dim_0 else _shard_size_multiple
        self._require_backward_grad_sync = True
        self._is_root = None  # known at the first forward
        self.xla_device = xm.xla_device()
        if _use_xla_patched_linear:
            apply_xla_patch_to_nn_linear(module)
        _materialize(module, param_init_fn)
        self._fsdp_wrapped_module = module
        self._placeholder = torch.empty(0, dtype=self.compute_dtype, device=self.xla_device)
        self._units: list[_Unit] = []
        self._shard_parameters(module)
        self._move_buffers(module)
        if execute_sharding_on_init:
            gc.collect()
            xm.mark_step()

    # ---- sharding ----------------------------------------------------------------------------

    def _shard_parameters(self, module: nn.Module) -> None:
        """Replace ``module``'s unsharded parameters by this unit's shards (registered here)."""
        index: dict[int, int] = {}
        params, names, slots = [], [], []
        for mname, m in module.named_modules():
            for n, p in list(m._parameters.items()):
                if p is None or getattr(p, "_is_sharded", False):
                    continue  # a nested unit's shard
                if not p.is_floating_point():
                    raise TypeError(f"FSDP shards floating-point parameters; {mname}.{n} is {p.dtype}")
                if id(p) not in index:
                    index[id(p)] = len(params)
                    params.append(p)
                    names.append(f"{mname}.{n}" if mname else n)
                slots.append((m, n, index[id(p)]))
        if self.flatten_parameters:
            groups = [[i for i, p in enumerate(params) if p.requires_grad],
                      [i for i, p in enumerate(params) if not p.requires_grad]]  # fmt: skip
            groups = [g for g in groups if g]
        else:
            groups = [[i] for i in range(len(params))]
        for k, g in enumerate(groups):
            where = {i: j for j, i in enumerate(g)}
            unit_slots = [(m, n, where[i]) for m, n, i in slots if i in where]
            if self.flatten_parameters:
                name = f"{_WRAPPED}.flat_param_{k}"
                info = ([names[i] for i in g], [params[i].shape for i in g], [params[i].numel() for i in g])
            else:
                name, info = f"{_WRAPPED}.{names[g[0]]}", None
            self._units.append(self._make_unit([params[i] for i in g], name, unit_slots, info))
        for m, n, _ in slots:
            del m._parameters[n]
            object.__setattr__(m, n, self._placeholder)

    def _make_unit(self, params: list, name: str, slots: list, flat_info) -> _Unit:
        n, mult = self.world_size, self.world_size * self._shard_size_multiple
        dim0 = self._shard_param_on_dim_0 and params[0].dim() > 0
        with torch.no_grad():
            if dim0:
                full = params[0].detach()
                pad = -full.shape[0] % n
                full = F.pad(full, [0, 0] * (full.dim() - 1) + [0, pad]) if pad else full
                size, metas = params[0].shape, [_Param(params[0].shape, 0, params[0].numel())]
            else:
                full = torch.cat([p.detach().reshape(-1) for p in params])
                full = F.pad(full, [0, -full.numel() % mult]) if full.numel() % mult else full
                offsets = [0, *itertools.accumulate(p.numel() for p in params)]
                metas = [_Param(p.shape, o, p.numel()) for p, o in zip(params, offsets)]
                size = torch.Size([offsets[-1]]) if flat_info is not None else params[0].shape
            rows = full.shape[0] // n
            shard = full[self.rank * rows : (self.rank + 1) * rows].clone().to(self.xla_device)
        p = nn.Parameter(shard, requires_grad=params[0].requires_grad)
        p._is_sharded, p._orig_size, p._orig_name = True, size, name
        p._name = f"_fsdp_shard.{name}".replace(".", _SEP)
        self.register_parameter(p._name, p)
        return _Unit(p, metas, slots, dim0, flat_info)

    @torch.no_grad()
    def _move_buffers(self, module: nn.Module) -> None:
        for m in module.modules():
            for n, b in list(m._buffers.items()):
                if b is None:
                    continue
                new = b.to(self.xla_device)
                if b.is_floating_point() and b.dtype != self.buffer_dtype and not hasattr(b, "_orig_dtype"):
                    new = new.to(self.buffer_dtype)
                    new._orig_dtype = b.dtype
                elif hasattr(b, "_orig_dtype"):
                    new._orig_dtype = b._orig_dtype
                m._buffers[n] = new

    # ---- gathering ---------------------------------------------------------------------------

    def _gather(self, anchors=()) -> list[list[torch.Tensor]]:
        """Every unit's full parameters (per unit, in ``params`` order). ``anchors``: tensors the
        gathers must wait for (through one optimization barrier with the shards)."""
        shards = [u.shard for u in self._units]
        anchors = [a for a in anchors if a.device.type == "xla"]
        if anchors:
            shards = [s.clone() for s in shards]
            xm.optimization_barrier_(shards + [a.detach().clone() for a in anchors])
        return [u.views(_Gather.apply(s, self, u)) for u, s in zip(self._units, shards)]

    def _install(self, gathered) -> None:
        for u, ts in zip(self._units, gathered):
            for m, n, i in u.slots:
                object.__setattr__(m, n, ts[i])

    def _free(self) -> None:
        for u in self._units:
            for m, n, _ in u.slots:
                object.__setattr__(m, n, self._placeholder)

    def _reduce_grad(self, unit: _Unit, grad: torch.Tensor, dtype: torch.dtype):
        if unit.grad_acc is not None:
            grad, unit.grad_acc = grad + unit.grad_acc, None
        if not self._require_backward_grad_sync:
            unit.grad_acc = grad  # no_sync(): keep the full gradient, reduce it with the next one
            return None
        g = grad.float() if self.fp32_reduce_scatter else grad
        out = xm.reduce_scatter("sum", g, 1.0 / self.world_size, 0, self.world_size, groups=self.sharding_groups)
        return out.to(dtype)

    # ---- forward and backward ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_ACTIVE, "depth", 0)
        self._is_root = depth == 0
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)
        grad = torch.is_grad_enabled()
        reshard = self.reshard_after_forward and not (self._is_root and self.disable_reshard_on_root)
        anchors = _tensors((args, kwargs), []) if self.optimization_barrier_in_forward else ()
        gathered = self._gather(anchors)
        self._install(gathered)
        regather = _Regather(self, gathered) if grad and reshard else None
        hooks = (torch.autograd.graph.saved_tensors_hooks(regather.pack, _Regather.unpack)
                 if regather else contextlib.nullcontext())  # fmt: skip
        del gathered
        _ACTIVE.depth = depth + 1
        try:
            with hooks:
                out = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            _ACTIVE.depth = depth
        if regather is not None:
            regather.ids = {}
        if reshard or not grad:
            self._free()
        if grad:
            self._hook_outputs(out, regather)
        return out

    def _hook_outputs(self, out, regather: _Regather | None) -> None:
        """On the first output gradient of the backward: gather again (when resharded) and
        queue the end-of-backward release."""
        state = {"fired": False}

        def pre_backward(g):
            if state["fired"]:
                return None
            state["fired"] = True
            if regather is not None:
                with torch.enable_grad():  # a recomputation (checkpoint_module) differentiates these
                    gathered = self._gather([g] if self.optimization_barrier_in_backward else ())
                self._install(gathered)
                regather.full = [[t.detach() for t in ts] for ts in gathered]
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish_backward(regather))
            return None

        for t in _tensors(out, []):
            if t.requires_grad:
                t.register_hook(pre_backward)

    def _finish_backward(self, regather: _Regather | None) -> None:
        self._free()
        if regather is not None:
            regather.full = None
        if self._is_root and self.sync_on_finalization:
            xm.mark_step()

    # ---- user API ----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (its parameters are plain attributes outside forward/backward)."""
        return self._fsdp_wrapped_module

    @property
    def sharded_params(self) -> list[nn.Parameter]:
        """This unit's shard parameters (nested units' not included)."""
        return [u.shard for u in self._units]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key):
        return self._fsdp_wrapped_module[key]

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, rank={self.rank}, flatten_parameters={self.flatten_parameters}, "
                f"reshard_after_forward={self.reshard_after_forward}, compute_dtype={self.compute_dtype}")  # fmt: skip

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients computed inside are accumulated locally (full size) and reduced with the
        first backward after the block: for gradient accumulation with fewer collectives."""
        units = [m for m in self.modules() if isinstance(m, XlaFullyShardedDataParallel)]
        before = [m._require_backward_grad_sync for m in units]
        for m in units:
            m._require_backward_grad_sync = False
        try:
            yield
        finally:
            for m, b in zip(units, before):
                m._require_backward_grad_sync = b

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
        """Scale every shard's gradient so that the whole model's gradient norm is at most
        ``max_norm`` (norms of shards combined with one all-reduce). Returns the total norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm_type = float(norm_type)
        groups = groups if groups is not None else self.sharding_groups
        if not grads:
            return torch.zeros((), device=self.xla_device)
        if math.isinf(norm_type):
            local = torch.stack([g.detach().abs().max().float() for g in grads]).max()
            total = xm.all_reduce(xm.REDUCE_MAX, local, groups=groups)
        else:
            local = torch.stack([g.detach().float().norm(norm_type) ** norm_type for g in grads]).sum()
            total = xm.all_reduce(xm.REDUCE_SUM, local, groups=groups) ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def get_original_names_and_sharded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(original name in the unwrapped model, shard) for every shard of this model."""
        out = []
        for name, m in self.named_modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                for p in m.sharded_params:
                    full = f"{name}.{p._orig_name}" if name else p._orig_name
                    out.append((full.replace(f"{_WRAPPED}.", ""), p))
        return out

    def get_shard_metadata(self) -> dict:
        """What ``consolidate_sharded_model_checkpoints`` needs besides the ranks' state dicts:
        per unit path, each shard's original name and size; for flattened units, the names,
        shapes and sizes of the parameters in the flat vector; buffers' original dtypes."""
        shard_info, flatten_info = {}, {}
        for name, m in self.named_modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                shard_info[name] = {u.shard._name: {"_orig_size": u.shard._orig_size,
                                                    "_orig_name": u.shard._orig_name} for u in m._units}  # fmt: skip
                for u in m._units:
                    if u.flat_info is not None:
                        flatten_info[f"{name}.{u.shard._orig_name}" if name else u.shard._orig_name] = u.flat_info
        buffer_info = {n: {"_orig_dtype": b._orig_dtype} for n, b in self.named_buffers() if hasattr(b, "_orig_dtype")}
        return {"shard_info": shard_info, "flatten_info": flatten_info, "buffer_info": buffer_info,
                "world_size": self.world_size, "rank": self.rank}  # fmt: skip
