"""Cross-replica collectives as IR nodes.

``all_reduce``, ``all_gather``, ``reduce_scatter`` and ``all_to_all`` build ordinary
lazy nodes, so they join the step's one computation. A graph holding any of them
is compiled as an SPMD program over the global device mesh (one device per
replica, ``runtime/execute/sync.py``) and each lowering runs inside ``shard_map`` with the
replica axis ``AXIS``: XLA's own collectives, no host round trip.

Replica ``groups`` (lists of ordinals partitioning the world) are lowered with one
all-gather plus a static membership table, which works for every reduce type.
``pin_layout`` is accepted for torch_xla's signatures; XLA chooses layouts here.
These functions are ``xm``'s (``core/xla_model.py`` re-exports them).

Under ``torch.compile`` they are traceable: Dynamo puts ``all_reduce``, ``all_gather`` and
``reduce_scatter`` into its graph as calls (``xlatorch/dynamo.py``), and given a tracer's
tensors (fake or functional ones on the xla device) they call the ops ``xlatorch::all_reduce``,
``xlatorch::all_gather``, ``xlatorch::reduce_scatter``, whose fake kernels give the shapes.
AOTAutograd records those ops, and a compiled graph holding one lowers it with the same
emitters, as a collective (``TRACED``; ``runtime/trace/fx.py``). Real device tensors take the
direct path (no dispatch), and so does a world of one replica, traced or not.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.topology import global_ordinal, thread_replicas, world_size
from xlatorch.runtime.ir.ops import STATIC, TENSOR, TENSOR_LIST, Info, OpSpec, signature
from xlatorch.runtime.ir.values import Node, Out
from xlatorch.runtime.trace.dispatch import RUNTIME_OPS
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, wrap, write

__all__ = [
    "AXIS",
    "SPECS",
    "reduce_gradients",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "collective_permute",
    "send",
    "recv",
    "REDUCE_TYPES",
    "TRACED",
]

AXIS = "replicas"
REDUCE_TYPES = ("sum", "mul", "and", "or", "min", "max")


def _groups(groups) -> tuple | None:
    """Replica groups as a tuple of tuples (None: one group of every replica), validated."""
    if not groups:
        return None
    gs = tuple(tuple(int(r) for r in g) for g in groups)
    flat = sorted(r for g in gs for r in g)
    if flat != list(range(world_size())) or len({len(g) for g in gs}) != 1:
        raise ValueError(f"xlatorch: replica groups {groups} must partition ordinals 0..{world_size() - 1} "
                         f"into groups of equal size")  # fmt: skip
    return None if len(gs) == 1 else gs


def _members(groups, n):
    """(n, group size) table: row i lists the ordinals in replica i's group."""
    table = np.zeros((n, len(groups[0])), dtype=np.int32)
    for g in groups:
        for r in g:
            table[r] = g
    return jnp.asarray(table)


def _combine(stacked, reduce_type):
    """Reduce axis 0 of ``stacked`` (one slice per replica) with ``reduce_type``."""
    if reduce_type == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if reduce_type == "mul":
        return stacked.prod(0, dtype=stacked.dtype)
    if reduce_type == "min":
        return stacked.min(0)
    if reduce_type == "max":
        return stacked.max(0)
    if reduce_type == "and":
        return stacked.astype(bool).all(0).astype(stacked.dtype) if stacked.dtype != jnp.bool_ else stacked.all(0)
    return stacked.astype(bool).any(0).astype(stacked.dtype) if stacked.dtype != jnp.bool_ else stacked.any(0)


def _opaque(x):
    """``x`` hidden from XLA's simplifier: an all-reduce of a constant (a replica contributing
    zeros) would otherwise be folded away on that replica only, and the others would wait."""
    return lax.optimization_barrier(x)


def _reduce_one(x, reduce_type, groups):
    x = _opaque(x)
    if groups is None and x.dtype != jnp.bool_:
        if reduce_type == "sum":
            return lax.psum(x, AXIS)
        if reduce_type == "max":
            return lax.pmax(x, AXIS)
        if reduce_type == "min":
            return lax.pmin(x, AXIS)
    stacked = lax.all_gather(x, AXIS)  # (replicas, *x.shape)
    if groups is not None:
        stacked = jnp.take(stacked, _members(groups, stacked.shape[0])[lax.axis_index(AXIS)], axis=0)
    return _combine(stacked, reduce_type)


def _emit_all_reduce(out, xs, reduce_type, scale, groups):
    res = []
    for x in xs:
        r = _reduce_one(x, reduce_type, groups)
        res.append(r if scale == 1.0 else (r * scale).astype(r.dtype))
    return res


def _emit_all_gather(out, x, dim, groups):
    stacked = lax.all_gather(_opaque(x), AXIS)
    if groups is not None:
        stacked = jnp.take(stacked, _members(groups, stacked.shape[0])[lax.axis_index(AXIS)], axis=0)
    d = dim % max(x.ndim, 1)
    return jnp.concatenate(list(stacked), axis=d) if x.ndim else stacked


def _emit_reduce_scatter(out, xs, reduce_type, scale, dim, shard_count, groups):
    res = []
    for x in xs:
        d = dim % x.ndim
        if reduce_type == "sum" and groups is None and x.dtype != jnp.bool_:
            # XLA's reduce-scatter: each replica receives only its slice (an all-reduce would hold
            # the whole sum on every replica first, which FSDP's gradients cannot afford).
            r = lax.psum_scatter(_opaque(x), AXIS, scatter_dimension=d, tiled=True)
            res.append(r if scale == 1.0 else (r * scale).astype(r.dtype))
            continue
        r = _reduce_one(x, reduce_type, groups)
        r = r if scale == 1.0 else (r * scale).astype(r.dtype)
        size = x.shape[d] // shard_count
        if groups is None:
            pos = lax.axis_index(AXIS)
        else:
            pos = jnp.argmax(_members(groups, world_size())[lax.axis_index(AXIS)] == lax.axis_index(AXIS))
        res.append(lax.dynamic_slice_in_dim(r, pos * size, size, axis=d))
    return res


def _emit_broadcast(out, x, root):
    return lax.all_gather(_opaque(x), AXIS)[root]


def _emit_all_to_all(out, x, split_dimension, concat_dimension, split_count):
    return lax.all_to_all(_opaque(x), AXIS, split_dimension % x.ndim, concat_dimension % x.ndim, tiled=True)


def _emit_collective_permute(out, x, pairs, keep):
    got = lax.ppermute(_opaque(x), AXIS, pairs)  # XLA's CollectivePermute: zeros where nothing arrives
    if not keep:
        return got
    # send/recv: a replica that receives nothing keeps its own value (the sender gets its input back)
    targets = np.zeros(world_size(), dtype=bool)
    targets[[t for _, t in pairs]] = True
    return jnp.where(jnp.asarray(targets)[lax.axis_index(AXIS)], got, x)


def _spec(name, emit, arg_names, returns):
    kinds = (TENSOR_LIST if arg_names[0] == "inputs" else TENSOR,) + (STATIC,) * (len(arg_names) - 1)
    return OpSpec(name, None, emit, arg_names, kinds, (False,) * len(arg_names), returns)


# The lowered collectives; runtime/execute/sync.py compiles a graph containing any of them as SPMD.
_ALL_REDUCE = _spec("xla::all_reduce", _emit_all_reduce, ["inputs", "reduce_type", "scale", "groups"], 1)
_ALL_GATHER = _spec("xla::all_gather", _emit_all_gather, ["input", "dim", "groups"], 0)
_REDUCE_SCATTER = _spec("xla::reduce_scatter", _emit_reduce_scatter,
                        ["inputs", "reduce_type", "scale", "dim", "shard_count", "groups"], 1)  # fmt: skip
_ALL_TO_ALL = _spec("xla::all_to_all", _emit_all_to_all,
                    ["input", "split_dimension", "concat_dimension", "split_count"], 0)  # fmt: skip
_BROADCAST = _spec("xla::broadcast", _emit_broadcast, ["input", "root"], 0)
_PERMUTE = _spec("xla::collective_permute", _emit_collective_permute, ["input", "pairs", "keep"], 0)
# A set: a compiled graph holding a traced collective (runtime/trace/fx.py) joins it.
SPECS = {_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL, _BROADCAST, _PERMUTE}


def _node(spec, vals, avals) -> Node:
    COUNTERS[spec.name] += 1
    return Node(spec, vals, Info(tuple(avals), None), (spec, signature(vals)))


def _device_tensor(t, what: str) -> XlaTensor:
    if type(t) is not XlaTensor and (not isinstance(t, torch.Tensor) or t.device.type != "xla"):
        raise RuntimeError(f"xlatorch: {what} takes xla tensors, got a tensor on '{t.device}'")
    return t


def _traced(ts) -> bool:
    """Whether these device tensors are a tracer's (Dynamo's fakes, AOTAutograd's functional
    tensors): the collective is then recorded as its ``xlatorch::`` op."""
    return any(type(t) is not XlaTensor for t in ts)


def _flat(groups) -> tuple[list, int]:
    """Validated replica groups as the ops' arguments: every ordinal in group order, and the
    group size (``[], 0``: one group of every replica)."""
    gs = _groups(groups)
    return ([], 0) if gs is None else ([r for g in gs for r in g], len(gs[0]))


def _unflat(groups, size) -> tuple | None:
    return None if not size else tuple(tuple(groups[i : i + size]) for i in range(0, len(groups), size))


def _check_reduce_type(reduce_type: str) -> str:
    if reduce_type not in REDUCE_TYPES:
        raise ValueError(f"xlatorch: unknown reduce type '{reduce_type}' (one of {', '.join(REDUCE_TYPES)})")
    return reduce_type


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None, pin_layout: bool = True):
    """Reduce across replicas. A tensor gives a new tensor; a list is updated in place."""
    _check_reduce_type(reduce_type)
    single = isinstance(inputs, torch.Tensor)
    ts = [_device_tensor(t, "all_reduce") for t in ([inputs] if single else inputs)]
    if not ts:
        return inputs
    if world_size() == 1:
        res = [t * scale if scale != 1.0 else t for t in ts]
        if single:
            return res[0].clone() if res[0] is ts[0] else res[0]
        return inputs
    if _traced(ts):
        res = torch.ops.xlatorch.all_reduce(ts, reduce_type, float(scale), *_flat(groups))
        if single:
            return res[0]
        for t, r in zip(ts, res):
            t.copy_(r)
        return inputs
    vals = (tuple(value_of(t) for t in ts), reduce_type, float(scale), _groups(groups))
    n = _node(_ALL_REDUCE, vals, [v.aval for v in vals[0]])
    if single:
        return wrap(n.outs[0])
    for t, v in zip(ts, n.outs):
        write(t, v)
    return inputs


def all_gather(value, dim: int = 0, groups=None, output=None, pin_layout: bool = True):
    """Concatenate every replica's ``value`` along ``dim`` (ordinal order)."""
    t = _device_tensor(value, "all_gather")
    gs = _groups(groups)
    n = world_size() if gs is None else len(gs[0])
    shape = list(t.shape) or [1]
    d = dim % len(shape)
    shape[d] *= n
    if world_size() == 1:
        res = t.reshape(shape).clone()
    elif _traced([t]):
        res = torch.ops.xlatorch.all_gather(t, d, *_flat(groups))
    else:
        res = wrap(_node(_ALL_GATHER, (value_of(t), d, gs), [(tuple(shape), t.dtype)]).outs[0])
    if output is not None:
        output.copy_(res)
        return output
    return res


def reduce_scatter(reduce_type: str, input, scale: float, scatter_dim: int, shard_count: int, groups=None,
                   output=None, pin_layout: bool = True):  # fmt: skip
    """Reduce across replicas, then keep this replica's ``1/shard_count`` slice along ``scatter_dim``."""
    _check_reduce_type(reduce_type)
    single = isinstance(input, torch.Tensor)
    ts = [_device_tensor(t, "reduce_scatter") for t in ([input] if single else input)]
    gs = _groups(groups)
    count = world_size() if gs is None else len(gs[0])
    if shard_count != count:
        raise ValueError(f"xlatorch: reduce_scatter shard_count={shard_count}, but there are {count} replicas "
                         f"in the group")  # fmt: skip
    avals = []
    for t in ts:
        shape = list(t.shape)
        d = scatter_dim % len(shape)
        if shape[d] % shard_count:
            raise ValueError(f"xlatorch: reduce_scatter dim {scatter_dim} of size {shape[d]} is not divisible "
                             f"by shard_count={shard_count}")  # fmt: skip
        shape[d] //= shard_count
        avals.append((tuple(shape), t.dtype))
    if world_size() == 1:
        res = [t * scale for t in ts]
    elif _traced(ts):
        res = torch.ops.xlatorch.reduce_scatter(ts, reduce_type, float(scale), scatter_dim, shard_count, *_flat(groups))
    else:
        vals = (tuple(value_of(t) for t in ts), reduce_type, float(scale), scatter_dim, shard_count, gs)
        res = [wrap(v) for v in _node(_REDUCE_SCATTER, vals, avals).outs]
    if output is not None:
        outs = [output] if single else output
        for o, r in zip(outs, res):
            o.copy_(r)
        return output
    return res[0] if single else res


def all_to_all(value, split_dimension: int, concat_dimension: int, split_count: int, groups=None,
               pin_layout: bool = True):  # fmt: skip
    """Split ``value`` into ``split_count`` blocks, send block i to replica i, concatenate what arrives."""
    t = _device_tensor(value, "all_to_all")
    if _groups(groups) is not None:
        raise NotImplementedError("xlatorch: all_to_all over replica subgroups is not supported yet")
    if split_count != world_size():
        raise ValueError(f"xlatorch: all_to_all split_count={split_count} must equal the world size "
                         f"{world_size()}")  # fmt: skip
    shape = list(t.shape)
    s, c = split_dimension % len(shape), concat_dimension % len(shape)
    if shape[s] % split_count:
        raise ValueError(f"xlatorch: all_to_all dim {split_dimension} of size {shape[s]} is not divisible by "
                         f"split_count={split_count}")  # fmt: skip
    if world_size() == 1:
        return t.clone()
    shape[s] //= split_count
    shape[c] *= split_count
    return wrap(_node(_ALL_TO_ALL, (value_of(t), s, c, split_count), [(tuple(shape), t.dtype)]).outs[0])


def broadcast(value, root: int = 0):
    """Replica ``root``'s ``value`` on every replica (same shape and dtype everywhere)."""
    t = _device_tensor(value, "broadcast")
    if not 0 <= root < world_size():
        raise ValueError(f"xlatorch: broadcast root {root} is not an ordinal of the {world_size()} replicas")
    if world_size() == 1:
        return t.clone()
    return wrap(_node(_BROADCAST, (value_of(t), int(root)), [(tuple(t.shape), t.dtype)]).outs[0])


def _pairs(pairs) -> tuple:
    """Validated (source, target) ordinal pairs: each replica sends at most once and receives at
    most once (XLA's rule for CollectivePermute)."""
    ps = tuple((int(s), int(t)) for s, t in pairs)
    n = world_size()
    for what, col in (("source", 0), ("target", 1)):
        seen = [p[col] for p in ps]
        if len(set(seen)) != len(seen):
            raise ValueError(f"xlatorch: collective_permute pairs {list(pairs)} name a {what} replica twice")
    bad = [o for p in ps for o in p if not 0 <= o < n]
    if bad:
        raise ValueError(f"xlatorch: collective_permute pairs {list(pairs)} name ordinal {bad[0]}, but the "
                         f"job has {n} replicas")  # fmt: skip
    return ps


def _permute(t, pairs: tuple, keep: bool):
    if _traced([t]):
        raise NotImplementedError("xlatorch: collective_permute / send / recv inside torch.compile is not supported: "
                                  "call them outside the compiled function")  # fmt: skip
    if world_size() == 1:  # the only pair there can be is (0, 0)
        return t.clone() if pairs or keep else torch.zeros_like(t)
    return wrap(_node(_PERMUTE, (value_of(t), pairs, keep), [(tuple(t.shape), t.dtype)]).outs[0])


def collective_permute(value, pairs):
    """XLA's CollectivePermute: for each ``[source, target]`` of ``pairs``, replica ``target``
    gets replica ``source``'s ``value``; a replica that is no pair's target gets zeros. Every
    replica calls it with the same pairs (it is one collective in each one's step)."""
    return _permute(_device_tensor(value, "collective_permute"), _pairs(pairs), False)


# Sends whose result the caller may drop: kept until the sync that runs them, since the
# receiving replica's step waits for the send (torch_xla keeps them alive with its token).
_SENDS: list = []


def _point_to_point(t, pair, what: str):
    """The collective permute of one send or receive: the sender and the receiver record the
    same node (same pair), each in its own step."""
    if thread_replicas():  # their steps differ, and threads' replicas run one program together
        raise NotImplementedError(f"xlatorch: xm.{what} between dp.DataParallel threads is not supported: use "
                                  "xm.collective_permute with the same pairs on every replica")  # fmt: skip
    return _permute(_device_tensor(t, what), _pairs([pair]), True)


def send(value, channel_id: int):
    """Send ``value`` to replica ``channel_id``, which receives it with ``recv(out, channel_id=<this
    replica's ordinal>)`` in its step. Returns ``value`` (the same values). The pair is one
    collective permute in both replicas' steps: both must reach the same sync, with the same
    collectives before it."""
    res = _point_to_point(value, (global_ordinal(), channel_id), "send")
    _SENDS[:] = [s for s in _SENDS if type(s._st.value) is Out]  # drop the sends already run
    _SENDS.append(res)
    return res


def recv(output, channel_id: int):
    """Receive, into ``output`` (in place), the tensor that replica ``channel_id`` ``send``s to this
    one (same shape and dtype); returns it."""
    res = _point_to_point(output, (channel_id, global_ordinal()), "recv")
    with torch.no_grad():
        output.copy_(res)
    return res


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Average the gradients of ``optimizer``'s parameters across replicas (an IR all-reduce).

    FSDP's shards (parameters marked ``_is_sharded``) are skipped: their gradients were
    reduce-scattered in the backward, and each replica holds a different slice."""
    if world_size() == 1:
        return
    grads = [p.grad for g in optimizer.param_groups for p in g["params"]
             if p.grad is not None and not getattr(p, "_is_sharded", False)]  # fmt: skip
    if grads:
        count = len(groups[0]) if groups else world_size()
        all_reduce("sum", grads, scale=1.0 / count, groups=groups)


# The traced collectives: torch.library ops with fake kernels (shapes) and handlers for real
# device tensors (a compiled graph run op by op), each lowered like its IR node (TRACED).
_LIB = torch.library.Library("xlatorch", "DEF")
_LIB.define("all_reduce(Tensor[] inputs, str reduce_type, float scale, int[] groups, int group_size) -> Tensor[]")
_LIB.define("all_gather(Tensor input, int dim, int[] groups, int group_size) -> Tensor")
_LIB.define("reduce_scatter(Tensor[] inputs, str reduce_type, float scale, int dim, int shard_count, int[] groups, "
            "int group_size) -> Tensor[]")  # fmt: skip


def _gathered_shape(t, dim, group_size):
    shape = list(t.shape) or [1]
    shape[dim % len(shape)] *= group_size or world_size()
    return shape


def _scattered_shape(t, dim, shard_count):
    shape = list(t.shape)
    shape[dim % len(shape)] //= shard_count
    return shape


@torch.library.register_fake("xlatorch::all_reduce", lib=_LIB)
def _all_reduce_fake(inputs, reduce_type, scale, groups, group_size):
    return [torch.empty_like(t) for t in inputs]


@torch.library.register_fake("xlatorch::all_gather", lib=_LIB)
def _all_gather_fake(input, dim, groups, group_size):
    return input.new_empty(_gathered_shape(input, dim, group_size))


@torch.library.register_fake("xlatorch::reduce_scatter", lib=_LIB)
def _reduce_scatter_fake(inputs, reduce_type, scale, dim, shard_count, groups, group_size):
    return [t.new_empty(_scattered_shape(t, dim, shard_count)) for t in inputs]


def _all_reduce_op(inputs, reduce_type, scale, groups, group_size):
    groups = _unflat(groups, group_size)
    return [all_reduce(reduce_type, t, scale, groups) for t in inputs]


def _all_gather_op(input, dim, groups, group_size):
    return all_gather(input, dim, _unflat(groups, group_size))


def _reduce_scatter_op(inputs, reduce_type, scale, dim, shard_count, groups, group_size):
    return reduce_scatter(reduce_type, list(inputs), scale, dim, shard_count, _unflat(groups, group_size))


def _emit_traced_all_reduce(out, xs, reduce_type, scale, groups, group_size):
    return _emit_all_reduce(out, xs, reduce_type, scale, _unflat(groups, group_size))


def _emit_traced_all_gather(out, x, dim, groups, group_size):
    return _emit_all_gather(out, x, dim, _unflat(groups, group_size))


def _emit_traced_reduce_scatter(out, xs, reduce_type, scale, dim, shard_count, groups, group_size):
    return _emit_reduce_scatter(out, xs, reduce_type, scale, dim, shard_count, _unflat(groups, group_size))


_xops = torch.ops.xlatorch
RUNTIME_OPS.update({_xops.all_reduce.default: _all_reduce_op, _xops.all_gather.default: _all_gather_op,
                    _xops.reduce_scatter.default: _reduce_scatter_op})  # fmt: skip
# OpOverload -> the spec a compiled graph lowers it with (arguments by schema name).
TRACED = {
    _xops.all_reduce.default: _spec("xlatorch::all_reduce", _emit_traced_all_reduce,
                                    ["inputs", "reduce_type", "scale", "groups", "group_size"], 1),
    _xops.all_gather.default: _spec("xlatorch::all_gather", _emit_traced_all_gather,
                                    ["input", "dim", "groups", "group_size"], 0),
    _xops.reduce_scatter.default: _spec("xlatorch::reduce_scatter", _emit_traced_reduce_scatter,
                                        ["inputs", "reduce_type", "scale", "dim", "shard_count", "groups",
                                         "group_size"], 1),
}  # fmt: skip
