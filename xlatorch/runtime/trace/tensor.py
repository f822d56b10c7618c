"""``XlaTensor``: the device tensor, and the storage cells that make aliasing work.

A tensor reads its value through ``value_of`` and changes it through ``write``.
Tensors that alias (``detach``, ``.data``, views) share one ``Storage``; a view also
carries the chain of view ops that derives it from the storage's value, replayed
lazily when the storage changes and inverted (scatter) when the view is written.
"""

from __future__ import annotations

import copy
import sys
import threading
import traceback
import weakref
from sys import getrefcount as _refs

import torch
import torch._guards

from xlatorch.runtime.base import topology
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.record import cause as _cause
from xlatorch.runtime.base.threads import (
    CHECKED_SINCE_SYNC,
    DEFERRED,
    LOCK,
    TICKS,
    _get_ident,
    _in_backward,
    defer_to_owners,
    owner,
)
from xlatorch.runtime.ir import values as ir
from xlatorch.runtime.ir.failed import FailedValueError, cause, failed_value
from xlatorch.runtime.ir.ops import SPECS
from xlatorch.runtime.ir.values import Data, Out
from xlatorch.runtime.trace.nodes import apply_scatter, apply_view, convert_value, node
from xlatorch.runtime.trace.strides import SELF_OVERLAP, STORAGE_LAYOUT, dense, self_overlapping, through_storage

__all__ = [
    "XlaTensor",
    "Storage",
    "wrap",
    "value_of",
    "write",
    "PENDING",
    "pending_storages",
    "reroot_lone_views",
    "fail_storages",
    "CACHED_VIEWS",
    "drop_view_caches",
]

DEVICE = torch.device("xla", 0)

# Storages whose value is pending: storage id -> weak reference. A plain dict of weak
# references without callbacks (a storage's ``__del__`` removes its entry) costs a
# fraction of a WeakValueDictionary on the per-op path.
PENDING: dict[int, weakref.ref] = {}
_weakref = weakref.ref
# Weak references to the view tensors that cached a value (``_vc``) since the last sync
# (``drop_view_caches``).
CACHED_VIEWS: list = []
_STALE = (-1, None)  # a view's cached value that no generation matches: recomputed at its next read
# Filled by the modules above that own them (they import this one): the ATen call's
# dispatch (trace/dispatch.py), a tensor's download (execute/materialize.py), its pickling
# (execute/serialization.py).
DISPATCH = None
TO_CPU = None
REDUCE = None
# The lazy dispatch's own table and function (trace/dispatch.py fills both): while DISPATCH is
# LAZY (not eager mode's wrapper), a lowered op calls its shim straight from __torch_dispatch__.
SHIMS: dict = {}
LAZY = None


def pending_storages() -> list:
    """The live storages whose value is pending, by creation order (``sid``)."""
    live = [st for st in (r() for r in PENDING.values()) if st is not None and type(st.value) is ir.Out]
    live.sort(key=_sid)
    return live


def _sid(st) -> int:
    return st.sid


class Storage:
    """The mutable cell shared by a tensor and all its aliases and views.

    ``refs`` holds weak references to the tensors made on it (some may have died or
    moved to another storage since): a sync asks it whether one view alone can still
    read the storage (``reroot_lone_views``).

    Made inline by the fused shims (trace/dispatch._fuse): a change to what __init__ sets is
    made there too (tests/test_host_paths.py).
    """

    __slots__ = ("value", "gen", "sid", "dev", "refs", "prev", "first", "owner", "sharding", "__weakref__")

    def __init__(self, value, ref=None):
        self.refs = [] if ref is None else [ref]  # ``ref``: a weak reference to its first tensor
        # The user thread that made it (errors of its value are raised there): this one,
        # unless autograd's device thread is running a backward pass for another (owner()).
        self.owner = _get_ident() if _in_backward() == -1 else owner()
        # Its id is the tick of its creation (its first write): ids follow creation order.
        self.gen = self.sid = sid = next(TICKS)
        # The device data this storage held when the step began writing it: a step whose
        # on-device check fails gives it back (runtime/lower/checks.py). Reset at each commit.
        self.prev = None
        self.first = 0  # the tick of the step's first write of it (when ``prev`` was set)
        self.sharding = None  # SPMD: the sharding mark_sharding gave it (runtime/multi/sharding.py)
        self.dev = value.dev if ir._multi else 0  # the local device index (see ir.current_device)
        self.value = value
        if type(value) is Data:
            value.holders += 1
        else:
            PENDING[sid] = _weakref(self)

    def set(self, value) -> None:
        old = self.value
        first = False
        if type(old) is Data:
            old.holders -= 1
            if self.prev is None and type(value) is not Data:
                self.prev = first = old
        self.value = value
        self.gen = next(TICKS)
        if first:
            self.first = self.gen
        if type(value) is Data:
            # New data written outside a graph (an upload, a step's result): a later step's
            # undo gives back this, not what the storage held before.
            self.prev = None
            value.holders += 1
        elif self.sid not in PENDING:
            PENDING[self.sid] = _weakref(self)

    def __del__(self):
        v = self.value
        if type(v) is Data:
            v.holders -= 1
            return
        try:
            PENDING.pop(self.sid, None)
            # References: n.outs, self.value, v and getrefcount's argument; any more is a reader
            # (the common case: a consumer's arguments), and nothing is freed
            if type(v) is not Out or _refs(v) > 4:
                return
            n = v.node
            del v
            self.value = None
            outs = n.outs
            if outs is None or len(outs) > 1:
                _free_dead([n])
                return
            # Its only output, read by nothing: the node is dead (``_free_dead``'s first round, inline)
            args = n.args
            n.outs = n.args = None
            work = _operand_nodes(args)
            if work:
                args = None
                _free_dead(work)
        except Exception:  # at interpreter exit the module's globals may be gone
            pass


def _operand_nodes(args) -> list:
    """The nodes whose outputs are among ``args`` (tensor lists flattened)."""
    return [v.node for v in ir.operands(args) if type(v) is Out]


def _free_dead(work: list) -> None:
    """After the last tensor of a pending value let go of it: when nothing reads a node's
    outputs any more (no consumer's arguments, no tensor, no view's cached value: their
    reference counts say so), no sync will compute it, so break its cycle with its outputs now,
    as ``plan/collect.release`` does after a sync, and then its operands' nodes that this leaves
    unread. Left linked, a value the program dropped unused (a generation loop's clones) went
    to the cyclic collector, and kept linked the graph it read from. ``work``: the nodes to
    look at, taken by this call (no reference to them must be left in the caller)."""
    try:
        while work:
            n = work.pop()
            outs = n.outs
            if outs is None:
                continue
            for o in outs:
                # References: n.outs, this loop's name and getrefcount's argument; any more is a reader
                if o is not None and _refs(o) > 3:
                    break
            else:
                args = n.args
                n.outs = n.args = None
                if args:  # its operands' nodes are counted next: no reference to them left here
                    work += _operand_nodes(args)
                    args = None
            o = outs = None
    except Exception:  # at interpreter exit the module's globals may be gone
        pass


def nested_error(what: str) -> RuntimeError:
    """A nested tensor (torch.nested) on the device: what to do instead (runtime/device.py's
    fallback for a strided one's ops; ``untyped_storage`` for a jagged one's move)."""
    return RuntimeError(
        f"xlatorch: {what} a nested tensor (torch.nested) on the xla device, which holds dense arrays only; "
        f"pad it with torch.nested.to_padded_tensor on the CPU first (then move it), or keep it on the CPU"
    )


def _nesting(frame) -> bool:
    """Whether ``frame`` is a jagged nested tensor being made around its values."""
    from torch.nested._internal.nested_tensor import NestedTensor

    return frame.f_code is NestedTensor.__new__.__code__


def _faking(frame) -> bool:
    """Whether ``frame`` is PyTorch's fake-tensor converter describing a tensor."""
    from torch._subclasses.meta_utils import MetaTensorDescriber

    return frame.f_code is MetaTensorDescriber.describe_tensor.__code__


class XlaTensor(torch.Tensor):
    """A tensor on the ``xla`` device: lazy, with PyTorch's shape, dtype and autograd."""

    _st: Storage
    # Set on views only (a plain tensor reads these class defaults: two attribute writes less per op)
    _vw: tuple | None = None  # view steps from the storage's value, or None
    _vc: tuple | None = None  # (storage gen, value) cache of a view's value
    _geo: tuple | None = None  # a view's (strides, storage offset) when not contiguous's from 0 (trace/strides.py)

    @staticmethod
    def __new__(cls, *args, **kwargs):
        raise TypeError("XlaTensor is created by ops on the xla device, not directly")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        lock = None if ir._multi else LOCK
        if lock is not None:
            lock.acquire()
        try:
            if DEFERRED:
                if _in_backward() == -1:
                    error = DEFERRED.pop(_get_ident(), None)
                    if error is not None:
                        raise error
                elif func._schema.is_mutable and owner() in DEFERRED:
                    # The user's code raised earlier in this backward pass (runtime/trace/modules.py):
                    # the pass runs to its end, as an exception cannot unwind through the engine,
                    # but writes nothing more (no gradient accumulates), as CPU's pass stops there.
                    return args[0]
            d = DISPATCH
            if d is LAZY:
                shim = SHIMS.get(func)
                if shim is not None:
                    return shim(*args, **kwargs) if kwargs else shim(*args)
            return d(func, args, kwargs or {})
        except Exception as e:
            if _in_backward() == -1:
                raise
            # In a backward pass (inside autograd's engine, in whichever thread) an exception
            # would abort the process (torch's Python device guard terminates while
            # unwinding): defer it to the next sync.
            try:
                return defer_error(func, args, kwargs or {}, e)
            except Exception:
                sys.stderr.write(f"xlatorch: {func._schema.name} failed in a backward pass:\n")
                traceback.print_exc()
                sys.stderr.flush()
                raise
        finally:
            if lock is not None:
                lock.release()

    def __repr__(self, *, tensor_contents=None):
        # PyTorch prints subclasses as "XlaTensor(...)"; device tensors print as "tensor(...)".
        with _cause("print"):
            try:
                text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
            except BaseException as e:
                # PyTorch's printing holds a guard that turns functorch off in a local variable.
                # While the error's traceback lives, that frame would keep it (and vmap off for
                # this thread: a later vmap fails "Cannot access data pointer"), and when it
                # died, it would restore this thread's dispatch keys to what they were then.
                traceback.clear_frames(e.__traceback__)
                raise
        pad = len("XlaTensor(") - len("tensor(")
        first, *rest = text.split("\n")
        return "\n".join(["tensor(" + first[len("XlaTensor(") :]] + [line[pad:] for line in rest])

    def tolist(self):
        """The values as nested Python lists (a graph cut if pending)."""
        return TO_CPU(self, ".tolist()").tolist()

    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return TO_CPU(self, ".numpy()").numpy()

    @property
    def is_xla(self) -> bool:  # type: ignore[override]
        return True

    def __reduce_ex__(self, proto):
        # The storage's CPU data (once per pickle) plus this tensor's view steps: loads
        # back onto the xla device, aliasing what it aliased (runtime/execute/serialization.py).
        return REDUCE(self)

    def __deepcopy__(self, memo):
        # As on CPU: the storage is copied once per deepcopy (a lazy clone of its value) and
        # the tensor rebuilt on the copy with its view steps and layout, so a tensor and its
        # views deep-copied together still share (copied apart, a write into the view's copy
        # did not show in the base's). Python attributes (``_is_param``, the user's own) are
        # deep-copied, the aliasing fields are not.
        if id(self) in memo:
            return memo[id(self)]
        st = self._st
        root = memo.get(id(st))
        if root is None:
            layout = STORAGE_LAYOUT.get(st)
            with torch.no_grad():  # the storage's copy laid out as it is
                root = wrap(st.value, st, None, None if layout is None else (layout, 0))
                root = memo[id(st)] = torch.ops.aten.clone.default(root)
            memo.setdefault(id(memo), []).append(st)  # deepcopy's keep-alive list: ids stay unique
        v = value_of(root)
        for step in self._vw or ():
            v = apply_view(step, v)
        new = wrap(v, root._st, self._vw, self._geo)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for k, val in self.__dict__.items():
            if k not in ("_st", "_vw", "_vc", "_geo"):
                setattr(new, k, copy.deepcopy(val, memo))
        return new

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        # torch.compile's backward (AOTAutograd) takes gradients of plain-tensor outputs:
        # an xla tensor is one, to the lowering of that backward graph.
        return self

    def untyped_storage(self):  # type: ignore[override]
        if torch._guards.TracingContext.try_get() is not None or _faking(sys._getframe(1)):
            # torch.compile (or its compiled autograd, outside Dynamo's tracing context) making
            # a fake tensor of this one: the wrapper's empty storage.
            return torch.Tensor.untyped_storage(self)
        if _nesting(sys._getframe(1)):  # a jagged nested tensor moved to the device (its values were)
            raise nested_error("cannot make")
        if torch.utils.data.get_worker_info() is not None:  # collating a batch in shared memory
            raise RuntimeError(
                "xlatorch: a DataLoader worker process cannot hand xla tensors to the main process (its "
                "batches travel in shared CPU memory): have the Dataset return CPU tensors and move each "
                "batch to the device in the main process (pl.MpDeviceLoader(loader, device) does), or use "
                "num_workers=0"
            )
        raise RuntimeError(
            "xla tensors have no storage: their data lives on the device. Move the tensor "
            "to CPU (t.cpu()) to reach its storage"
        )

    def storage(self):  # type: ignore[override]
        return self.untyped_storage()

    @property
    def data(self):  # type: ignore[override]
        return self.detach()

    @data.setter
    def data(self, new):
        if not isinstance(new, XlaTensor):
            raise RuntimeError(
                f"Attempted to set the data of an xla tensor to a tensor on {new.device}; move it to xla first"
            )
        torch._C.TensorBase.data.__set__(self, new)
        self._st, self._vw, self._vc, self._geo = new._st, new._vw, new._vc, new._geo
        new._st.refs.append(weakref.ref(self))
        if self._vw is not None:
            CACHED_VIEWS.append(weakref.ref(self))

    __torch_function__ = torch._C._disabled_torch_function_impl


# Where ``torch.load`` puts saved device tensors: None (the device, as saved) or a device
# resolved from its ``map_location`` (set around each call; see serialization.load_target).
LOAD_TARGET = threading.local()


def _rebuild_xla(cpu, requires_grad):
    # A saved device tensor's CPU data, moved to the device unless torch.load's map_location
    # sends it elsewhere. Also loads files written before view steps were saved.
    target = getattr(LOAD_TARGET, "device", None)
    t = cpu.to(DEVICE) if target is None or target.type == "xla" else cpu.to(target)
    if requires_grad:
        t.requires_grad_()
    return t


_new = torch.Tensor._make_wrapper_subclass


def wrap(value, st: Storage | None = None, view=None, geo=None) -> XlaTensor:
    """A new device tensor holding ``value`` (a fresh storage unless ``st`` is given); a view
    (``view``: its steps), or an op's result, reports the strides and offset ``geo``
    (``trace/strides.py``; None: contiguous from offset 0).

    Inlined, with ``dispatch._view_of`` and ``nodes._node``'s cached path, in the fused shims
    (``dispatch._fuse``): a change here is made there too (``tests/test_host_paths.py``)."""
    shape, dtype = value.aval
    if geo is None:
        t = _new(XlaTensor, shape, dtype=dtype, device=DEVICE)
    else:
        t = _new(XlaTensor, shape, strides=geo[0], storage_offset=geo[1], dtype=dtype, device=DEVICE)
        t._geo = geo
    COUNTERS["CreateXlaTensor"] += 1
    if st is None:
        t._st = st = Storage(value, _weakref(t))
        if geo is not None:  # an op's result laid out as on CPU (trace/strides.result_layout)
            STORAGE_LAYOUT[st] = geo[0]
        return t
    t._st = st
    r = _weakref(t)
    if view is not None:
        t._vw, t._vc = view, (st.gen, value)
        CACHED_VIEWS.append(r)
    if len(st.refs) >= 16:  # a long-lived storage (a weight read through .t() every step)
        st.refs = [r for r in st.refs if _reads(r(), st)]
    st.refs.append(r)
    return t


def _reads(t, st) -> bool:
    return t is not None and t._st is st


def drop_view_caches() -> None:
    """At a sync: each view that cached a pending value since the last sync forgets it; its
    next read takes the view of its base's value again, the same value. A cached value of a
    view of device data stays valid across the sync (a stale one stays until the view is read
    again), and either kept the graph that computed it linked (``release`` sees it held), to
    go to the cyclic collector when the view died: a generation loop's views of its cache
    position, ~750 nodes a call. Not under SPMD, where a view's cached value may carry a
    sharding constraint (``multi/sharding.py``), kept until its base changes, nor with several
    local devices (``dp.DataParallel``): a replica's sync would drop another replica's caches
    at a moment of its own, and their programs must stay the same."""
    if topology.SPMD[0] or ir._multi:
        CACHED_VIEWS.clear()
        return
    for r in CACHED_VIEWS:
        t = r()
        if t is not None and t._vw is not None:
            vc = t._vc
            if vc is not None and type(vc[1]) is Out:
                t._vc = _STALE
    CACHED_VIEWS.clear()


def reroot_lone_views(storages) -> None:
    """Before a sync: a pending storage that only one view tensor can still read takes that
    view's value, and the view becomes a plain tensor on it.

    Nothing else can observe the rest of the base, so this changes no result; it lets XLA
    compute the view directly instead of the base plus a copy. A view whose elements are
    not its base's whole storage (an offset, gaps) stays a view: ``as_strided`` of it counts
    in the base's storage. The case that matters: an
    ``nn.Linear`` weight's gradient is ``t()`` of an ``mm`` (autograd's ``TBackward``), and
    storing the ``mm`` would make XLA transpose a weight-sized buffer every step.
    """
    for st in storages:
        refs = st.refs
        if len(refs) == 1:  # the common case: one tensor made on it, no view
            t = refs[0]()
            if t is None or t._vw is None:
                continue
        lone = None
        for r in refs:
            t = r()
            if _reads(t, st) and t is not lone:
                if lone is not None:
                    lone = None
                    break
                lone = t
        if lone is not None and lone._vw is not None:
            geo = lone._geo
            if geo is not None and (geo[1] or not dense(lone.shape, geo[0])):
                continue  # its storage elements are not its value's: as_strided of it needs the base
            v = value_of(lone)
            st.set(v)
            lone._vw = lone._vc = None
            st.refs = [_weakref(lone)]
            if geo is None:
                STORAGE_LAYOUT.pop(st, None)
            else:  # a transposed view: its storage is its value, in the view's order
                STORAGE_LAYOUT[st] = geo[0]


def fail_storages(storages, error: Exception) -> None:
    """Each storage holds ``error`` instead of its value: a failed sync's tensors, a loop
    body's temporaries (runtime/trace/bodies.py)."""
    for st in storages:
        st.value = failed_value(st.value.aval, error)  # not Storage.set: a failed value is not pending
        st.gen += 1
        st.prev = None
        PENDING.pop(st.sid, None)


def value_of(t: XlaTensor):
    """The tensor's current value (device data or a pending IR value)."""
    vw = t._vw
    if vw is None:
        return t._st.value
    st = t._st
    gen, v = t._vc
    if gen != st.gen:
        v = st.value
        for step in vw:
            v = apply_view(step, v)
        t._vc = (st.gen, v)
        CACHED_VIEWS.append(_weakref(t))
    return v


def write(t: XlaTensor, v) -> None:
    """Make ``v`` the tensor's new value, updating its base and every alias."""
    if type(v) is Data and CHECKED_SINCE_SYNC and _get_ident() in CHECKED_SINCE_SYNC:
        v = convert_value(v, v.aval[1])
    vw = t._vw
    st = t._st
    if vw is None:
        st.set(v)
        return
    if self_overlapping(t):
        raise RuntimeError(SELF_OVERLAP)
    root = st.value
    flat = through_storage(st, root.aval[0], root.aval[1], vw)
    if flat is not None:  # a chain with a step that may overlap: one scatter into the storage's elements
        new = node(SPECS["as_strided_scatter.default"], (root, v) + flat).outs[0]
    else:
        bases = [root]
        for step in vw[:-1]:
            bases.append(apply_view(step, bases[-1]))
        new = v
        for step, base in zip(reversed(vw), reversed(bases)):
            new = apply_scatter(step, base, new)
    st.set(new)
    t._vc = (st.gen, v)
    CACHED_VIEWS.append(_weakref(t))


_PLACEHOLDER = {True: float("nan")}  # what a failed .item() gives a backward pass that will raise


def defer_error(func, args, kwargs, error: Exception):
    """The outputs of an op that failed on autograd's device thread, carrying the error.

    An exception cannot leave ``__torch_dispatch__`` there (torch 2.13's Python device
    guard aborts the process while unwinding), so the outputs (shapes from the meta
    kernel) and any arguments the op writes hold a failed value instead, and the error
    is raised by the sync that reads them. An op with no tensor result to carry it
    (``.item()``) returns a placeholder and the thread that called ``backward`` raises the
    error when the backward pass returns (``runtime/trace/modules.py``).
    """
    from torch.utils._pytree import tree_map

    if isinstance(error, FailedValueError):  # an input had already failed: keep that cause
        err = cause(error)
    else:
        err = RuntimeError(f"{func._schema.name} failed in a backward pass: {type(error).__name__}: {error}")
    if func is torch.ops.aten._local_scalar_dense.default:
        defer_to_owners(error if isinstance(error, FailedValueError) else err, (owner(),))
        return _PLACEHOLDER.get(args[0].dtype.is_floating_point or args[0].dtype.is_complex, 0)

    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        return "meta" if isinstance(a, torch.device) and a.type == "xla" else a

    mkwargs = tree_map(meta, kwargs)
    if isinstance(mkwargs.get("device"), (str, torch.device)):
        mkwargs["device"] = "meta"
    res = func(*tree_map(meta, args), **mkwargs)
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            dst = args[i] if i < len(args) else kwargs.get(arg.name)
            if type(dst) is XlaTensor:
                write(dst, failed_value((tuple(dst.shape), dst.dtype), err))
                written.append(dst)
    if written and isinstance(res, torch.Tensor):
        return written[0]
    return tree_map(lambda r: wrap(failed_value((tuple(r.shape), r.dtype), err)) if isinstance(r, torch.Tensor)
                    else r, res)  # fmt: skip
