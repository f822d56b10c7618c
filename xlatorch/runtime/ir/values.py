"""The lazy IR: leaves (device data, host scalars) and nodes with their outputs.

An aval is ``(shape: tuple[int, ...], dtype: torch.dtype)``. Every value carries a
signature (``sig``): its aval, or for a host scalar its kind and dtype. A node's
``key`` is its op plus its arguments' signatures (static arguments themselves); a
graph's cache key is its nodes' keys plus how they share operands (``plan.collect``),
so the same program over new data (or new scalar values) reuses its executable.
"""

from __future__ import annotations

from xlatorch.runtime.base import memory, record, topology
from xlatorch.runtime.base.source import user_frame
from xlatorch.runtime.base.topology import current_device

__all__ = ["UPLOAD", "Data", "Scalar", "Node", "Out", "Value", "VALUE_TYPES", "operands", "replace_operands"]

# Local device placement. With one device (the common case) every value lives on device 0
# and nothing below looks further. With several (``dp.DataParallel``), a node lives on its
# first operand's device, and a node without operands (a factory) on the device of the
# thread that built it. ``_multi`` is read per op: a module global, set by topology when it
# finds several local devices.
_multi = False
# Nodes record the user's (file, line) in ``src`` (debug level >= 1, XLA_IR_DEBUG): set by
# xlatorch.debug.knob. Off, ``src`` stays unset (read it with getattr(n, "src", None)), except
# on a node with a large output (``ops.Info.big``): an out-of-memory error names its line.
DEBUG_SOURCE = record.SOURCE_LINES
_LIVE = memory.LIVE


def _enable_multi_device() -> None:
    global _multi
    _multi = True


topology.MULTI_DEVICE_HOOKS.append(_enable_multi_device)
if len(topology._devices) > 1:  # the devices were found before this module loaded
    _enable_multi_device()


def _node_device(args) -> int:
    for a in args:
        t = type(a)
        if t is Data or t is Out:
            return a.dev
        if t is tuple:
            for x in a:
                if type(x) is Data or type(x) is Out:
                    return x.dev
        elif getattr(a, "type", None) == "xla" and getattr(a, "index", None):  # a torch.device
            return a.index
    return current_device()


class Data:
    """A leaf holding device data (a ``jax.Array``).

    ``holders`` counts the storages whose current value is this leaf: when it drops
    to zero, a step that reads it may donate its buffer. ``donor``: the user marked the buffer
    donatable (``_XLAC._set_buffer_donation``): a step that reads it may donate it even while
    tensors hold it (they cannot be read after that step).

    ``host``: a small value's CPU tensor as well (computed or read by a graph's stage run on the
    host, ``execute/host.py``), or None. Never written: a reader that hands it out copies it.
    A value computed on the host has no device array until one is read (``array``): it is
    uploaded then, once.

    ``nbytes`` counts in ``memory.LIVE`` while the leaf lives (``get_memory_info``'s peak).
    """

    __slots__ = ("_array", "host", "aval", "sig", "holders", "dev", "donor", "nbytes")

    def __init__(self, array, aval, dev=0, host=None):
        self._array = array
        self.host = host
        self.aval = self.sig = aval
        self.holders = 0
        self.dev = dev
        self.donor = False
        n = aval[1].itemsize
        for d in aval[0]:
            n *= d
        self.nbytes = n
        _LIVE[dev] = _LIVE.get(dev, 0) + n

    @property
    def array(self):
        """The device array (a value made on the host: uploaded at this first read)."""
        a = self._array
        if a is None:
            a = self._array = UPLOAD[0](self.host, self.dev)
        return a

    @array.setter
    def array(self, a) -> None:
        self._array = a

    def __del__(self):
        try:
            _LIVE[self.dev] -= self.nbytes
        except Exception:  # at interpreter exit the module's globals may be gone
            pass


# (CPU tensor, local device) -> jax.Array: set by runtime/execute/transfer.py (it sits above).
UPLOAD: list = [None]


class Scalar:
    """A leaf holding a host scalar that enters the graph as a 0-d parameter.

    Scalars are parameters, never constants: a learning rate that changes every step
    must not change the graph's key. (torch_xla bakes in 0 and 1; measured here, that
    gained nothing measurable in the bench's step time, and it recompiles a loop
    whose values pass through 0 or 1, such as a warm-up from ``lr=0``.)
    """

    __slots__ = ("value", "aval", "tensor", "sig")

    def __init__(self, value, dtype, tensor=False):
        self.value = value
        self.aval = ((), dtype)
        self.tensor = tensor  # a 0-d CPU tensor (promotes as a tensor, not as a number)
        self.sig = ("t" if tensor else "s", dtype)


class Node:
    """One op application: ``spec`` (the op), ``args`` in schema order with tensors
    replaced by values, and ``info`` (output avals and computation dtype).

    ``key`` identifies the node in a graph's cache key: the spec and its arguments'
    signatures, with static arguments themselves, compared by equality (not by hash:
    ``hash(-1) == hash(-2)``, and dims -1 and -2 must not share an executable).
    """

    # tick: checked nodes; born: a constant's storage (runtime/plan/births.py).
    # Made inline, with its Out, by the fused shims (trace/dispatch._fuse) for an Info marked
    # ``fast``: a change to what __init__ sets is made there too (tests/test_host_paths.py).
    __slots__ = ("spec", "args", "info", "key", "outs", "dev", "src", "tick", "born")

    def __init__(self, spec, args, info, key):
        self.spec = spec
        self.args = args
        self.info = info
        self.key = key
        self.dev = _node_device(args) if _multi else 0
        one = info.one
        if one is not None:  # the common case, without a genexpr
            self.outs = (Out(self, 0, one),)
        else:
            self.outs = tuple([None if aval is None else Out(self, i, aval) for i, aval in enumerate(info.avals)])
        if DEBUG_SOURCE or info.big:
            self.src = user_frame()


class Out:
    """Output ``idx`` of ``node``: a pending value."""

    __slots__ = ("node", "idx", "aval", "sig")

    def __init__(self, node, idx, aval):
        self.node = node
        self.idx = idx
        self.aval = self.sig = aval

    @property
    def dev(self) -> int:
        return self.node.dev


Value = Data | Scalar | Out
VALUE_TYPES = (Data, Scalar, Out)


_VALUE_SET = frozenset(VALUE_TYPES)


def operands(args) -> list:
    """The values among a node's arguments, in order (tensor lists flattened)."""
    out = []
    for a in args:
        t = type(a)
        if t in _VALUE_SET:
            out.append(a)
        elif t is tuple:
            out.extend(x for x in a if type(x) in _VALUE_SET)
    return out


def replace_operands(args, new: dict) -> tuple:
    """``args`` with each value found in ``new`` replaced: an output by ``new[id(its node)]``,
    a leaf by ``new[id(leaf)]``."""
    out = []
    for a in args:
        t = type(a)
        if t is tuple:
            out.append(replace_operands(a, new))
        elif t in _VALUE_SET:
            out.append(new.get(id(a.node) if t is Out else id(a), a))
        else:
            out.append(a)
    return tuple(out)
