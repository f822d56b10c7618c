"""SPMD: one program over every device of the job, partitioned by XLA (Shardy/GSPMD) through JAX.

After ``use_spmd()`` the process has one device, ``xla:0``, that spans every device of the
job. Its device data are ``jax.Array``s with a ``NamedSharding`` (replicated unless
annotated); ``mark_sharding`` re-places device data (the sharding is then an input sharding
of every graph that reads it) or, on a pending value, adds a ``with_sharding_constraint``
node to the step's program. A graph is compiled with its inputs' shardings and XLA's
partitioner chooses the rest; a storage annotated with a sharding keeps it across steps
(its new value is constrained to it). The graph's key includes its inputs' shardings.

A dimension the mesh does not divide is padded, as torch_xla does, inside the programs that
compute the tensor (XLA's partitioner pads uneven blocks); between steps such a tensor's data is
held replicated, since a ``jax.Array`` has equal blocks (``SpmdUnevenSharding`` counts them).

Every graph runs over one mesh: the mesh of its sharded inputs, else the mesh last used in
an annotation, else every device in one axis. Replicated data on another mesh of the same
devices is re-labelled (no copy); a sharded array on another mesh is replicated first
(counted as ``SpmdReshard``).
"""

from __future__ import annotations

import contextlib
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlatorch.runtime.base import record, topology
from xlatorch.runtime.ir.ops import STATIC, TENSOR, Info, OpSpec, signature
from xlatorch.runtime.ir.values import Data, Node
from xlatorch.runtime.lower import compiler
from xlatorch.runtime.lower.executable import Executable
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, write

__all__ = ["use_spmd", "is_spmd", "devices", "default_mesh", "set_mesh", "annotate", "clear", "constrain", "is_sharded",
           "sharding_of", "hlo_sharding_text", "host_value", "gathered", "prepare", "compile_sharded", "tiles",
           "divides", "padded_shape"]  # fmt: skip

_mesh: dict = {"current": None, "default": None}


def is_spmd() -> bool:
    return topology.SPMD[0]


def use_spmd() -> None:
    """Make ``xla:0`` one virtual device over every device of the job (before its first use).

    On CPU, ``$CPU_NUM_DEVICES`` sets how many CPU devices this process has (as torch_xla's
    PJRT CPU client does); in a multi-process job every process's devices join the mesh.
    Sets ``XLA_USE_SPMD=1`` as torch_xla does; a program started with it set runs SPMD from
    its first use of the device.
    Raises ``RuntimeError`` once the xla device has been used without SPMD.
    """
    if topology.SPMD[0]:
        os.environ["XLA_USE_SPMD"] = "1"  # as torch_xla's, set on every call (tests delete it between classes)
        return
    if topology._devices:
        raise RuntimeError("xlatorch: use_spmd() must be called before the xla device is first used "
                           "(its device data already lives on one device)")  # fmt: skip
    topology.start_spmd()


def devices() -> list:
    """Every device of the job, in global ordinal order (process, then device id)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def default_mesh() -> Mesh:
    """The mesh new device data and unannotated graphs use: the last annotation's mesh, else
    every device along one axis."""
    m = _mesh["current"]
    if m is None:
        m = _mesh["default"]
        if m is None:
            m = _mesh["default"] = Mesh(np.array(devices()), ("_devices",))
    return m


def set_mesh(mesh: Mesh) -> None:
    _mesh["current"] = mesh


def replicated(mesh: Mesh | None = None) -> NamedSharding:
    return NamedSharding(mesh or default_mesh(), PartitionSpec())


def placement():
    """Where an upload goes under SPMD: replicated over the default mesh."""
    return replicated()


# The sharding constraint: an IR node whose lowering is jax.lax.with_sharding_constraint.
def _emit_constraint(out, x, sharding):
    return jax.lax.with_sharding_constraint(x, sharding)


CONSTRAINT = OpSpec("xla::sharding_constraint", None, _emit_constraint, ["input", "sharding"], (TENSOR, STATIC),
                    (False, False), 0)  # fmt: skip


def annotate(t, sharding: NamedSharding) -> None:
    """Give tensor ``t`` (an ``XlaTensor``, not a view) ``sharding``: device data is re-placed
    (a copy between devices; no host transfer), a pending value is constrained inside its
    graph. The storage keeps the sharding: later values of it are constrained to it too."""
    set_mesh(sharding.mesh)
    st = t._st
    if not divides(sharding, t.shape):
        # A jax.Array cannot hold uneven blocks: the data stays replicated between steps, and
        # every program that computes it constrains it (XLA pads the blocks inside it).
        record.COUNTERS["SpmdUnevenSharding"] += 1
        if type(st.value) is Data and t._vw is None:
            write(t, _constrain(st.value, sharding))
            st.sharding = sharding
            return
    if t._vw is not None:  # a view (``out.view(...)``): its value as read now is constrained
        v = value_of(t)
        t._vc = (st.gen, _constrain(v, sharding))  # until its base changes; the base keeps its sharding
        return
    v = st.value
    if type(v) is Data:
        if v.array.sharding != sharding:
            v.array = jax.device_put(v.array, sharding)
            record.COUNTERS["SpmdReshard"] += 1
    else:
        write(t, _constrain(v, sharding))
    st.sharding = sharding


def tiles(sharding, shape) -> tuple[int, ...]:
    """How many blocks ``sharding`` splits each dimension of ``shape`` into."""
    sizes = sharding.mesh.shape
    out = []
    for i in range(len(shape)):
        a = sharding.spec[i] if i < len(sharding.spec) else None
        names = () if a is None else a if isinstance(a, tuple) else (a,)
        k = 1
        for name in names:
            k *= sizes[name]
        out.append(k)
    return tuple(out)


def divides(sharding, shape) -> bool:
    """Whether ``sharding`` splits every dimension of ``shape`` into equal blocks."""
    return all(n % k == 0 for n, k in zip(shape, tiles(sharding, shape)))


def padded_shape(sharding, shape) -> tuple[int, ...]:
    """``shape`` with each split dimension rounded up to a multiple of its blocks (torch_xla's
    padding of a dimension the mesh does not divide)."""
    return tuple(-(-n // k) * k for n, k in zip(shape, tiles(sharding, shape)))


def constrain(t, sharding: NamedSharding) -> None:
    """Constrain ``t``'s current value to ``sharding`` inside its graph (device data too: it
    becomes a pending value), without re-placing its data or annotating its storage."""
    set_mesh(sharding.mesh)
    v = _constrain(value_of(t), sharding)
    if t._vw is not None:
        t._vc = (t._st.gen, v)  # a view: until its base changes
    else:
        write(t, v)


def is_sharded(t) -> bool:
    """Whether ``t`` carries a sharding: an annotation (replicated ones too) or split data."""
    st = t._st
    if st.sharding is not None:
        return True
    v = st.value
    return type(v) is Data and not v.array.sharding.is_fully_replicated


def _constrain(v, sharding):
    n = Node(CONSTRAINT, (v, sharding), Info((v.aval,), None), (CONSTRAINT, signature((v, sharding))))
    record.COUNTERS[CONSTRAINT.name] += 1
    return n.outs[0]


def clear(t) -> None:
    """Forget ``t``'s annotation; its device data becomes replicated again."""
    st = t._st
    st.sharding = None
    v = st.value
    if type(v) is Data and not v.array.sharding.is_fully_replicated:
        v.array = jax.device_put(v.array, replicated(_mesh_of(v.array)))


def _mesh_of(arr):
    s = arr.sharding
    return s.mesh if isinstance(s, NamedSharding) else None


def sharding_of(t):
    """The ``NamedSharding`` of ``t``'s data (its annotation while it is pending; None if none)."""
    st = t._st
    v = st.value
    if type(v) is Data and (st.sharding is None or divides(st.sharding, v.aval[0])):
        s = v.array.sharding
        # Replicated data nobody annotated has no sharding, as torch_xla reports it.
        return None if st.sharding is None and s.is_fully_replicated else s
    return st.sharding  # pending, or unevenly sharded (its data is held replicated)


def hlo_sharding_text(sharding, ndim: int) -> str:
    """XLA's text of a sharding as torch_xla prints it: the devices listed
    (``{devices=[4,2]0,1,...}``), or in iota form (``{devices=[4,2]<=[8]}``) with
    ``CONVERT_SHLO_TO_SHARDY`` set, as torch_xla does then; ``{replicated}``."""
    if sharding is None:
        return ""
    hs = sharding._to_xla_hlo_sharding(ndim)
    text = str(hs)
    if not text.startswith("{devices=[") or "last_tile_dims" in text or os.environ.get("CONVERT_SHLO_TO_SHARDY"):
        return text
    dims = ",".join(str(d) for d in hs.tile_assignment_dimensions())
    # The tile assignment counts the mesh's devices in its order; torch_xla prints their ordinals.
    ordinal = {d: i for i, d in enumerate(devices())}
    order = [ordinal[d] for d in sharding.mesh.devices.flat] if hasattr(sharding, "mesh") else None
    devices_text = ",".join(str(order[k] if order else k) for k in hs.tile_assignment_devices())
    last = " last_tile_dim_replicate" if hs.replicate_on_last_tile_dim() else ""
    return f"{{devices=[{dims}]{devices_text}{last}}}"


_GATHERED: dict = {}  # id(jax.Array) -> (array, its whole value on the host), while a save runs


def host_value(arr):
    """A host-readable array of ``arr``'s whole value: a replicated array's local copy, or a
    sharded array gathered from every process (a collective: every process must ask)."""
    if arr.is_fully_addressable:
        return arr
    if arr.sharding.is_fully_replicated:
        return arr.addressable_shards[0].data
    hit = _GATHERED.get(id(arr))
    if hit is not None and hit[0] is arr:
        return hit[1]
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(arr, tiled=True)


@contextlib.contextmanager
def gathered(data):
    """While a checkpoint of ``data`` is written by one process: the values of ``data``'s
    device tensors that are split across processes, gathered to every process's host in one
    collective, which every process enters (a no-op unless SPMD spans several processes).

    Tensors are found in dicts, lists and tuples (state dicts and optimizer state dicts)."""
    if not topology.SPMD[0] or jax.process_count() == 1:
        yield
        return
    from torch.utils._pytree import tree_leaves

    arrays, seen = [], set()
    for t in tree_leaves(data):  # the caller synced: every storage holds device data
        if type(t) is XlaTensor and t._st.sid not in seen and type(t._st.value) is Data:
            seen.add(t._st.sid)
            a = t._st.value.array
            if not a.is_fully_addressable and not a.sharding.is_fully_replicated:
                arrays.append(a)
    if arrays:
        from jax.experimental import multihost_utils

        for a, host in zip(arrays, multihost_utils.process_allgather(arrays, tiled=True)):
            _GATHERED[id(a)] = (a, host)
    try:
        yield
    finally:
        _GATHERED.clear()


def _onto(arr, mesh: Mesh):
    """``arr`` on ``mesh``: replicated data is re-labelled (same buffers); other data is
    replicated there (a copy)."""
    s = arr.sharding
    rep = NamedSharding(mesh, PartitionSpec())
    if s.is_fully_replicated and s.device_set == rep.device_set:
        return jax.make_array_from_single_device_arrays(arr.shape, rep, [x.data for x in arr.addressable_shards])
    record.COUNTERS["SpmdReshard"] += 1
    return jax.device_put(arr, rep)


def prepare(data, storages) -> tuple:
    """Put every input of a graph on one mesh; ``(mesh, key part, output shardings)``.

    The key part (every input's partition spec and every output's annotation) joins the
    graph's key: the same graph with differently sharded inputs is another program.
    """
    mesh = None
    for d in data:
        s = d.array.sharding
        if isinstance(s, NamedSharding) and not s.is_fully_replicated:
            mesh = s.mesh
            break
    outs = tuple(st.sharding for st in storages)
    if mesh is None:
        mesh = next((o.mesh for o in outs if o is not None), None) or default_mesh()
    specs = []
    for d in data:
        s = d.array.sharding
        if not isinstance(s, NamedSharding) or (s.mesh is not mesh and s.mesh != mesh):
            d.array = _onto(d.array, mesh)
            s = d.array.sharding
        specs.append(s.spec)
    return mesh, (mesh, tuple(specs), outs), outs


def compile_sharded(body, data_avals, packed_avals, args_order, outs, mesh):
    """Compile ``body(donated, kept, packed)`` as one program partitioned over ``mesh``.

    Inputs keep the shardings they have; outputs of annotated storages are constrained to
    their annotations, the others are the partitioner's choice (a graph without inputs
    puts them replicated on ``mesh``).
    """
    from jax.sharding import PartitionSpec as P

    donate, kept = args_order
    rep = NamedSharding(mesh, P())
    packed_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in packed_avals]
    no_inputs = not data_avals and not packed_avals
    args = ([data_avals[i] for i in donate], [data_avals[i] for i in kept], packed_avals)

    def sbody(d, k, p):
        res = body(d, k, p)
        fixed = []
        for i, o in enumerate(res):
            s = outs[i] if i < len(outs) else None
            if s is None and no_inputs:
                s = rep
            fixed.append(o if s is None else jax.lax.with_sharding_constraint(o, s))
        return tuple(fixed)

    compiled = compiler.compile(jax.jit(sbody, donate_argnums=(0,)).lower(*args))

    groups = topology.Groups(rep)  # the scalars, replicated: a group only when it changed

    def call(arrays, packed_vals):
        packed_vals = groups.send(packed_vals, [p.tobytes() for p in packed_vals])
        return compiled([arrays[i] for i in donate], [arrays[i] for i in kept], packed_vals)

    return Executable(call, xla=compiled)


def data_aval(d, dtype):
    """The abstract input of device data ``d`` (its shape and sharding)."""
    return jax.ShapeDtypeStruct(d.aval[0], dtype, sharding=d.array.sharding)
