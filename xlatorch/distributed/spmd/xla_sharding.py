"""torch_xla's SPMD annotations (``torch_xla.distributed.spmd``) on JAX shardings.

A ``Mesh`` names a logical arrangement of the job's devices; a partition spec says, per
tensor dimension, which mesh axes split it. They become a ``jax.sharding.NamedSharding``:
``mark_sharding`` on device data re-places it, on a pending value it becomes a
``with_sharding_constraint`` in the step's program (``xlatorch/runtime/multi/sharding.py``).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec

from xlatorch.runtime.multi import sharding as _sh
from xlatorch.runtime.trace.tensor import XlaTensor

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "set_global_mesh", "get_global_mesh", "mark_sharding",
           "clear_sharding", "get_sharding_spec", "XLAShard", "XLAShardedTensor", "ShardingSpec",
           "enable_manual_sharding", "disable_manual_sharding"]  # fmt: skip


class MeshError(ValueError, AssertionError):
    """A mesh that cannot be built (torch_xla raises ``AssertionError`` for these)."""


class Mesh:
    """A logical mesh of the job's devices (torch_xla's ``xs.Mesh``).

    Args:
      device_ids: global device ids ``0 .. N-1`` (every device of the job), in the order
        they fill the mesh (row-major).
      mesh_shape: the mesh's shape; its product is the number of devices.
      axis_names: one name per mesh axis (default ``"dim0"``, ``"dim1"``, ...).
    """

    def __init__(self, device_ids, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...] | None = None):
        ids = np.asarray(device_ids).reshape(-1)
        mesh_shape = tuple(int(s) for s in mesh_shape)
        n = len(_sh.devices())
        # torch_xla's checks, in its order and words (its tests expect AssertionError).
        if len(ids) != n:
            raise MeshError(f"Number of device IDs ({len(ids)}) must match the global number of devices ({n})")
        if axis_names is not None and len(axis_names) != len(mesh_shape):
            raise MeshError(f"Number of axis names ({len(axis_names)}) must match mesh dimensions ({len(mesh_shape)})")
        if axis_names is not None and len(set(axis_names)) != len(axis_names):
            raise MeshError(f"Axis names must be unique, got: {tuple(axis_names)}")
        if len(ids) != math.prod(mesh_shape):
            raise MeshError(f"Number of device IDs ({len(ids)}) must match mesh size ({math.prod(mesh_shape)})")
        if len(np.unique(ids)) != len(ids):
            raise MeshError(f"Device IDs must be unique, got: {ids.tolist()}")
        if not all(0 <= d < n for d in ids.tolist()):
            raise MeshError(f"Device IDs must be less than mesh size ({n}), got: {ids.tolist()}")
        self.device_ids = ids
        self.mesh_shape = mesh_shape
        self.axis_names = tuple(axis_names) if axis_names is not None else None
        self._jax = None

    def size(self) -> int:
        return len(self.device_ids)

    def shape(self) -> OrderedDict:
        """Axis name -> size."""
        return OrderedDict(zip(self._names(), self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> int | None:
        return self._names().index(name) if name in self._names() else None

    def _names(self) -> tuple[str, ...]:
        return self.axis_names or tuple(f"dim{i}" for i in range(len(self.mesh_shape)))

    def jax_mesh(self) -> jax.sharding.Mesh:
        """The ``jax.sharding.Mesh`` of the same devices and axes."""
        if self._jax is None:
            devs = _sh.devices()
            self._jax = jax.sharding.Mesh(np.array([devs[i] for i in self.device_ids]).reshape(self.mesh_shape),
                                          self._names())  # fmt: skip
        return self._jax

    def __repr__(self) -> str:
        return f"Mesh(shape={dict(self.shape())})"


class HybridMesh(Mesh):
    """A mesh over hosts (DCN) times the devices of each host (ICI): axis i has size
    ``ici_mesh_shape[i] * dcn_mesh_shape[i]``, and devices of one process stay together
    along the ICI part (JAX's ``create_hybrid_device_mesh``, each process a granule)."""

    def __init__(self, *, ici_mesh_shape: tuple[int, ...], dcn_mesh_shape: tuple[int, ...] | None = None,
                 axis_names: tuple[str, ...] | None = None):  # fmt: skip
        from jax.experimental import mesh_utils

        dcn = tuple(dcn_mesh_shape or (1,) * len(ici_mesh_shape))
        devs = _sh.devices()
        arranged = mesh_utils.create_hybrid_device_mesh(tuple(ici_mesh_shape), dcn, devs, process_is_granule=True)
        index = {d: i for i, d in enumerate(devs)}
        ids = np.vectorize(lambda d: index[d], otypes=[int])(arranged)
        super().__init__(ids.reshape(-1), tuple(a * b for a, b in zip(ici_mesh_shape, dcn)), axis_names)


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """Every device of the job along one axis."""
    n = len(_sh.devices())
    return Mesh(np.arange(n), (n,), (axis_name,) if axis_name else None)


_global = {"mesh": None}


def set_global_mesh(mesh: Mesh) -> None:
    _global["mesh"] = mesh


def get_global_mesh() -> Mesh | None:
    return _global["mesh"]


def _named(mesh: Mesh, partition_spec, ndim: int) -> NamedSharding:
    """The ``NamedSharding`` of a torch_xla partition spec (names or mesh axis indices, None,
    or tuples of them per tensor dimension)."""
    if len(partition_spec) != ndim:
        raise ValueError(f"xlatorch: partition spec {partition_spec} has {len(partition_spec)} entries for a "
                         f"{ndim}-d tensor")  # fmt: skip
    names = mesh._names()

    def axis(a):
        if a is None:
            return None
        if isinstance(a, tuple):
            return tuple(axis(x) for x in a)
        if isinstance(a, int):
            return names[a]
        if a not in names:
            raise ValueError(f"xlatorch: {a!r} is not an axis of the mesh {names}")
        return a

    return NamedSharding(mesh.jax_mesh(), PartitionSpec(*(axis(a) for a in partition_spec)))


@dataclass
class XLAShard:
    """One local shard, as torch_xla reports it: its data (a CPU tensor; a block of a
    dimension the mesh does not divide is padded with zeros to the size of the others), where
    it sits in the global tensor (``indices``: one slice per dimension, without the padding;
    ``Ellipsis`` for a replicated tensor), the device holding it and which copy of that block
    it is."""

    data: torch.Tensor
    indices: object
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """``data`` without the padding."""
        if self.indices is Ellipsis:
            return self.data
        return self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)]


class XLAShardedTensor:
    """A sharded tensor (what ``mark_sharding`` returns): ``global_tensor`` is the device
    tensor itself; torch functions given this object use it."""

    def __init__(self, global_tensor: XlaTensor, mesh: Mesh | None = None, partition_spec=None):
        self.global_tensor = global_tensor
        self.mesh = mesh
        self.partition_spec = partition_spec

    @property
    def sharding_spec(self) -> str:
        return get_sharding_spec(self.global_tensor)

    @property
    def sharding_type(self) -> ShardingType:
        """``ShardingType.TILED``, ``PARTIAL`` (tiled, replicated within tiles) or ``REPLICATED``."""
        return sharding_type_of(self.global_tensor) or ShardingType.REPLICATED

    @property
    def local_shards(self) -> list[XLAShard]:
        """This process's shards, one per local device (syncs if pending; downloads each)."""
        from xlatorch.runtime.execute.materialize import materialized
        from xlatorch.runtime.execute.transfer import from_array

        t = self.global_tensor
        arr = materialized(t).array
        dtype, shape = t.dtype, tuple(t.shape)
        sharding = _sh.sharding_of(t)
        name = lambda d: f"{d.platform.upper()}:{d.id}"  # noqa: E731
        if sharding is None or sharding.is_fully_replicated:
            return [XLAShard(from_array(x.data, dtype), Ellipsis, name(x.device), x.replica_id)
                    for x in arr.addressable_shards]  # fmt: skip
        if _sh.divides(sharding, shape):
            return [XLAShard(from_array(x.data, dtype), _bounded(x.index, shape), name(x.device), x.replica_id)
                    for x in arr.addressable_shards]  # fmt: skip
        # Uneven blocks (the data is held replicated): cut the padded tensor as torch_xla pads it.
        padded_shape = _sh.padded_shape(sharding, shape)
        whole = from_array(arr.addressable_shards[0].data, dtype)
        padded = whole.new_zeros(padded_shape)
        padded[tuple(slice(0, n) for n in shape)] = whole
        seen: dict = {}
        out = []
        for dev, index in sorted(sharding.devices_indices_map(padded_shape).items(), key=lambda kv: kv[0].id):
            key = tuple((sl.start, sl.stop) for sl in index)
            replica = seen[key] = seen.get(key, -1) + 1
            if dev.process_index == jax.process_index():
                out.append(XLAShard(padded[index].clone(), _bounded(index, shape), name(dev), replica))
        return out

    def __getattr__(self, name):
        return getattr(self.global_tensor, name)

    def __repr__(self) -> str:
        return f"XLAShardedTensor({self.global_tensor!r}, sharding_spec={self.sharding_spec!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        unwrap = lambda x: x.global_tensor if isinstance(x, XLAShardedTensor) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def sharding_type_of(t) -> ShardingType | None:
    """The kind of ``t``'s sharding, None when it has none (torch_xla's ``_get_xla_sharding_type``)."""
    s = _sh.sharding_of(t.global_tensor if isinstance(t, XLAShardedTensor) else t)
    if s is None:
        return None
    if s.is_fully_replicated:
        return ShardingType.REPLICATED
    partial = s._to_xla_hlo_sharding(t.dim()).replicate_on_last_tile_dim()
    return ShardingType.PARTIAL if partial else ShardingType.TILED


def _bounded(index, shape) -> list:
    """A shard's slices in the global tensor: explicit bounds, the padding cut off."""
    out = []
    for sl, n in zip(index, shape):
        start = 0 if sl.start is None else min(sl.start, n)
        stop = n if sl.stop is None else min(sl.stop, n)
        out.append(slice(start, stop, 1))
    return out


def _forward(name):
    def method(self, *args):
        return getattr(self.global_tensor, name)(*args)

    method.__name__ = name
    return method


# Python looks operators up on the type, not through __getattr__: they go to the global tensor.
for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul", "rmatmul", "pow",
              "neg", "getitem", "setitem", "len", "iter", "eq", "ne", "lt", "le", "gt", "ge"):  # fmt: skip
    setattr(XLAShardedTensor, f"__{_name}__", _forward(f"__{_name}__"))
XLAShardedTensor.__hash__ = object.__hash__


def _device_tensor(t) -> XlaTensor:
    if isinstance(t, XLAShardedTensor):
        t = t.global_tensor
    if type(t) is not XlaTensor:
        raise TypeError(f"xlatorch: mark_sharding takes a tensor on the xla device, got one on '{t.device}'")
    if not _sh.is_spmd():
        raise RuntimeError("xlatorch: sharding annotations need SPMD: call xr.use_spmd() first")
    return t


def mark_sharding(t, mesh: Mesh, partition_spec) -> XLAShardedTensor:
    """Shard ``t`` over ``mesh``: ``partition_spec[i]`` names the mesh axis (or axes, a tuple;
    None: not split) that splits dimension i.

    Device data is re-placed now (between devices, no host transfer) and enters later graphs
    with that sharding; a pending value gets a sharding constraint in its step's program.
    The tensor keeps the sharding: its later values (``t.add_(...)``, optimizer updates)
    are constrained to it. A different sharding of a graph's inputs is another program.
    """
    t = _device_tensor(t)
    _sh.annotate(t, _named(mesh, tuple(partition_spec), t.dim()))
    return XLAShardedTensor(t, mesh, tuple(partition_spec))


def clear_sharding(t) -> XlaTensor:
    """Remove ``t``'s annotation: its data becomes replicated on every device."""
    t = _device_tensor(t)
    _sh.clear(t)
    return t


def get_sharding_spec(t) -> str:
    """XLA's text of ``t``'s sharding (``{devices=[4,2]0,1,...}``), "" when it has none."""
    t = t.global_tensor if isinstance(t, XLAShardedTensor) else t
    return _sh.hlo_sharding_text(_sh.sharding_of(t), t.dim())


class ShardingSpec:
    """A mesh and a partition spec to apply later: ``pl.MpDeviceLoader(loader, device,
    input_sharding=xs.ShardingSpec(mesh, ("data", None)))`` shards each uploaded batch."""

    def __init__(self, mesh: Mesh, partition_spec: tuple, minibatch: bool = False):
        if minibatch:
            raise NotImplementedError("xlatorch: ShardingSpec(minibatch=True) (per-host batches) is not supported")
        self.mesh = mesh
        self.partition_spec = tuple(partition_spec)

    def can_apply(self, t: torch.Tensor) -> bool:
        return t.dim() == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        mark_sharding(t, self.mesh, self.partition_spec)
        return t


def enable_manual_sharding(*args, **kwargs):
    """Not supported: manual (per-device) regions need ``shard_map``, which lazy tracing does
    not express."""
    raise NotImplementedError("xlatorch: enable_manual_sharding is not supported (no manual-sharding regions)")


disable_manual_sharding = enable_manual_sharding


class ShardingType(enum.IntEnum):
    """XLA's kinds of sharding (``OpSharding.Type``), as torch_xla numbers them."""

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


class _ShardWithGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, mesh, partition_spec):
        ctx.mesh, ctx.partition_spec = mesh, partition_spec
        out = t.clone()
        mark_sharding(out, mesh, partition_spec)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        mark_sharding(grad, ctx.mesh, ctx.partition_spec)
        return grad, None, None


def mark_sharding_with_gradients(t, mesh: Mesh, partition_spec) -> torch.Tensor:
    """A copy of ``t`` sharded over ``mesh`` as ``mark_sharding`` shards, whose gradient in
    the backward is sharded the same way (not in place: for activations inside a model)."""
    t = t.global_tensor if isinstance(t, XLAShardedTensor) else t
    return _ShardWithGradients.apply(t, mesh, tuple(partition_spec))


__all__ += ["ShardingType", "mark_sharding_with_gradients"]


class MarkShardingFunction(torch.autograd.Function):
    """``mark_sharding`` as an autograd function (torch_xla's): the forward annotates its input
    in place and returns it; the backward annotates the gradient the same way.

    ``MarkShardingFunction.apply(t, mesh, partition_spec)``."""

    @staticmethod
    def forward(ctx, t, mesh, partition_spec):
        mark_sharding(t, mesh, partition_spec)
        ctx.mesh, ctx.partition_spec = mesh, partition_spec
        return t

    @staticmethod
    def backward(ctx, grad):
        mark_sharding(grad, ctx.mesh, ctx.partition_spec)
        return grad, None, None


__all__ += ["MarkShardingFunction"]


def annotate_custom_sharding(t, mesh: Mesh, partition_spec) -> XLAShardedTensor:
    """Constrain ``t``'s current value to the sharding of ``partition_spec`` over ``mesh`` inside
    the step's program (a ``with_sharding_constraint``), without re-placing its data or changing
    the sharding it keeps (unlike ``mark_sharding``): a hint to XLA's partitioner, e.g. a
    different sharding for one use of a tensor already sharded with ``mark_sharding``."""
    t = _device_tensor(t)
    if t.dim() != len(partition_spec):
        raise ValueError(f"xlatorch: partition spec length ({len(partition_spec)}) should be equal to the input "
                         f"rank ({t.dim()})")  # fmt: skip
    _sh.constrain(t, _named(mesh, tuple(partition_spec), t.dim()))
    return XLAShardedTensor(t, mesh, tuple(partition_spec))


def wrap_if_sharded(x):
    """``x`` as an ``XLAShardedTensor`` if it is an xla tensor with a sharding (annotated, or
    split data); anything else unchanged."""
    if type(x) is XlaTensor and _sh.is_sharded(x):
        return XLAShardedTensor(x)
    return x


def shard_as(a, b):
    """``(a, b)`` such that corresponding tensors of the two pytrees (same structure) are
    sharded alike, whichever sharding XLA's partitioner picks for them (JAX's ``shard_alike``
    inside the step's program; nothing syncs). Use at least one of the outputs."""
    from jax.experimental.shard_alike import shard_alike
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from xlatorch.core.xla_builder import call_jax

    a_flat, a_spec = tree_flatten(a)
    b_flat, b_spec = tree_flatten(b)
    if a_spec != b_spec:
        raise ValueError(f"xlatorch: shard_as takes two pytrees of the same structure, got {a_spec} and {b_spec}")
    outs_a, outs_b = [], []
    for x, y in zip(a_flat, b_flat):
        if x is None or y is None:
            if x is not None or y is not None:
                raise ValueError("xlatorch: shard_as: a leaf is None in one pytree only")
        else:
            x, y = call_jax(shard_alike, (x, y), name="shard_as")
        outs_a.append(x)
        outs_b.append(y)
    return tree_unflatten(outs_a, a_spec), tree_unflatten(outs_b, b_spec)


# One dot_general over the last dimension, with no reshapes: XLA's partitioner propagates the
# shardings of every leading dimension (torch's einsum flattens them into one for a matmul).
_EINSUMS: dict = {}


def _einsum(spec: str, *ts):
    if all(type(t) is XlaTensor for t in ts):
        import functools

        import jax.numpy as jnp

        from xlatorch.core.xla_builder import call_jax

        fn = _EINSUMS.get(spec)
        if fn is None:
            fn = _EINSUMS[spec] = functools.partial(jnp.einsum, spec)
        return call_jax(fn, ts, name="einsum")
    return torch.einsum(spec, *ts)


class XLAPatchedLinear(torch.autograd.Function):
    """``torch.nn.functional.linear`` as einsums (forward and backward), so the sharding of
    every leading dimension of the input carries through to the output. Autocast on the xla
    device casts its inputs to the autocast dtype, as for a linear layer."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="xla", cast_inputs=torch.get_autocast_dtype("xla"))
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        out = _einsum("...n,mn->...m", input, weight)
        return out if bias is None else out + bias

    @staticmethod
    @torch.amp.custom_bwd(device_type="xla")
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = _einsum("...m,mn->...n", grad_output, weight)
        if ctx.needs_input_grad[1]:
            grad_weight = _einsum("...m,...n->mn", grad_output, input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def xla_patched_nn_linear_forward(m: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``m(input)`` for a ``torch.nn.Linear`` ``m``, through ``XLAPatchedLinear``."""
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


class EinsumLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` computed by ``XLAPatchedLinear`` (einsums)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return xla_patched_nn_linear_forward(self, input)


def apply_xla_patch_to_nn_linear(module: torch.nn.Module) -> torch.nn.Module:
    """Make every ``torch.nn.Linear`` inside ``module`` an ``EinsumLinear``, in place: the same
    module objects, parameters and hooks, computed with einsums. Subclasses of ``nn.Linear``
    keep their own ``forward`` (replacing it would change what they compute). Returns ``module``."""
    for child in module.modules():
        if type(child) is torch.nn.Linear:
            child.__class__ = EinsumLinear
    return module


def apply_backward_optimization_barrier(m: torch.nn.Module) -> None:
    """After ``m``'s backward, pass its parameters' gradients and the gradients of its inputs
    through one XLA optimization barrier (a full backward hook): XLA then does not fuse this
    module's backward with the rest, which keeps the buffers of gradient collectives small."""
    from xlatorch.core.xla_model import optimization_barrier_

    def barrier(module, grad_input, grad_output):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        optimization_barrier_([g for g in grads + list(grad_input) if isinstance(g, torch.Tensor)])

    m.register_full_backward_hook(barrier)


__all__ += ["annotate_custom_sharding", "wrap_if_sharded", "shard_as", "XLAPatchedLinear",
            "xla_patched_nn_linear_forward", "apply_backward_optimization_barrier", "EinsumLinear",
            "apply_xla_patch_to_nn_linear"]  # fmt: skip
