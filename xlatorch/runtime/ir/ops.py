"""What the runtime knows about an op: its ``OpSpec`` (from ops.yaml and the ATen schema), the
argument kinds, a node's ``Info``, argument signatures, and the table of every lowered op.

The generated table (``generated/dispatch.py``) builds one ``OpSpec`` per ops.yaml entry;
``SPECS`` holds them by name (filled when xlatorch is imported, ``runtime/device.py``).
"""

from __future__ import annotations

from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND

from xlatorch.runtime.ir.values import VALUE_TYPES

__all__ = ["OpSpec", "Info", "signature", "SPECS", "TENSOR", "OPT_TENSOR", "TENSOR_LIST", "SCALAR", "SCALAR_LIST",
           "HOST_SCALARS", "STATIC", "GENERATOR", "ONE", "TUPLE", "LIST", "PROMOTION"]  # fmt: skip

# Argument kinds, from the schema's types (codegen decides; see codegen/schema.py).
# GENERATOR is a synthetic trailing argument of random ops: a fresh seed per call.
# HOST_SCALARS (ops.yaml ``host_scalars``): a 1-d CPU tensor of scalars, one per list element
# (foreach's ``Tensor scalars``), read on the host as traced scalars.
TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST, STATIC, GENERATOR, HOST_SCALARS = range(8)
# Return kinds.
ONE, TUPLE, LIST = range(3)

# The kinds that promote unless ops.yaml's ``promote_args`` says which: a foreach op's lists
# promote element by element (``trace/nodes.py``, ``ir/emit.py``).
_PROMOTING = (TENSOR, OPT_TENSOR, SCALAR, TENSOR_LIST, SCALAR_LIST, HOST_SCALARS)

PROMOTION = {k.name.lower(): k for k in ELEMENTWISE_TYPE_PROMOTION_KIND}

SPECS: dict = {}  # ops.yaml name ('add.Tensor') -> OpSpec, every lowered op


# A node with an output this large records the user's line at every debug level: an
# out-of-memory error names where its largest buffers were made (runtime/lower/executable.py).
BIG_BYTES = 16 << 20


class Info:
    """What a node's signature determines: output avals, computation dtype, whether the node
    carries an on-device check (``runtime/lower/checks.py``), whether an output is large
    (``big``: at least ``BIG_BYTES``), and the aval of its only output (``one``; None if it has
    several). ``key``: the key of the nodes made from it, one
    tuple shared by all of them (set by ``trace/nodes.py`` at the first), so that comparing two
    graphs' keys finds equal nodes by identity instead of walking their signatures."""

    __slots__ = ("avals", "cdtype", "checked", "big", "key", "one", "fast", "rounds")

    def __init__(self, avals, cdtype, checked=False, rounds=()):
        self.avals = avals
        # ``((position, dtype), ...)``: 0-d tensor arguments rounded to the common dtype before the
        # cast to ``cdtype`` (``trace/nodes.py``, ``_rounded``)
        self.rounds = rounds
        self.one = avals[0] if len(avals) == 1 else None
        self.cdtype = cdtype
        self.checked = checked
        self.big = any(a is not None and type(a) is tuple and _nbytes(a) >= BIG_BYTES for a in avals)
        self.key = None
        self.fast = False  # set with ``key``: its nodes may be made inline (``trace/dispatch._fuse``)


def _nbytes(aval) -> int:
    shape, dtype = aval
    n = getattr(dtype, "itemsize", 0)
    try:
        for d in shape:
            n *= int(d)
    except TypeError:  # a symbolic size: unknown, not counted as large
        return 0
    return n


class OpSpec:
    """One lowered ATen overload: everything the runtime needs, from ops.yaml + schema."""

    __slots__ = (
        "name", "overload", "emit", "arg_names", "kinds", "kwarg_only", "returns",
        "promote", "promote_idx", "view", "scatter", "cache", "meta_overload", "check", "check_integral", "check_reads",
        "counter", "mutates", "born", "index_dtype", "prepare", "copies", "distinct_out",
        "out_overload", "validate", "refuse_dtypes", "validate_out", "keeps_scalar", "inner_checks",
    )  # fmt: skip

    def __init__(self, name, overload, emit, arg_names, kinds, kwarg_only, returns,
                 promote=None, promote_args=None, view=False, scatter=None, meta_overload=None,
                 check=None, check_integral=False, mutates=(), index_dtype=None, copies=False,
                 check_reads=None, distinct_out=False, out_overload=None, validate=None,
                 refuse_dtypes=None, validate_out=None, keeps_scalar=()):  # fmt: skip
        self.name = name
        self.overload = overload
        self.emit = emit
        self.arg_names = arg_names
        self.kinds = kinds
        self.kwarg_only = kwarg_only
        self.returns = returns
        self.promote = PROMOTION[promote] if promote else None
        names = promote_args or [n for n, k in zip(arg_names, kinds) if k in _PROMOTING]
        self.promote_idx = tuple(arg_names.index(n) for n in names)
        # ops.yaml ``keeps_scalar``: promoting positions CPU's kernel reads at their own precision
        # when 0-d (``mul``'s, ``div``'s second operand); others are rounded to the common dtype
        self.keeps_scalar = keeps_scalar
        self.view = view
        # ops.yaml ``copies``: its result holds its first argument's elements when the dtype stays
        self.copies = copies
        # ops.yaml ``distinct_out``: its out= tensor may not share memory with an input
        self.distinct_out = distinct_out
        # Its out= overload (``aten.add.out``), whose meta kernel judges out= tensors, or None
        self.out_overload = out_overload
        self.scatter = scatter
        self.cache: dict = {}
        # The overload whose meta kernel gives this spec's avals (an in-place variant
        # uses its own, so PyTorch's in-place casting rules and errors apply).
        self.meta_overload = meta_overload or overload
        # The on-device check (ops.yaml ``check``): called like ``emit``, gives L.checks results.
        self.check = check
        self.check_integral = check_integral  # check only when the computation dtype is integral
        # ``(expression, positions of the arguments it reads, whether it reads the outputs)``:
        # checks with equal keys over the same values give the same answer (plan/prechecks.py)
        self.check_reads = check_reads
        # ops.yaml ``index_dtype``: ``((argument positions, dtypes CPU accepts, exception, message,
        # empty_ok), ...)``, checked when a signature is first seen (``trace/nodes.py``), so a bad
        # dtype raises at the call.
        self.index_dtype = index_dtype
        # ops.yaml ``validate``: called with the meta arguments in schema order at the same
        # time; raises CPU's error for shapes and dtypes CPU refuses and the meta kernel takes.
        self.validate = validate
        # ops.yaml ``refuse_dtypes``: ``((dtypes, exception, message), ...)``, the computation dtypes
        # CPU's kernel refuses (checked with the signature's inference, after the meta kernel).
        self.refuse_dtypes = refuse_dtypes
        # ops.yaml ``validate_out``: called with the out= tensors' dtypes, the results' and the meta
        # arguments when an out= signature is first seen (trace/outs.py, ``_check_out``)
        self.validate_out = validate_out
        # torch_xla's per-op counter: how many times the op was recorded for the device
        self.counter = "xla::" + (name.split("::")[-1].split(".")[0])
        # An in-place op writing several arguments (``_amp_update_scale_``): their positions, in
        # schema order; the node's outputs are their new values, a list argument's one per tensor.
        self.mutates = mutates
        # A constant op (``zeros_like``, ``full``): its node records the storage its result
        # starts (runtime/plan/births.py, which sets this).
        self.born = False
        # The converter of its arguments (runtime/trace/dispatch.py makes it at the first call).
        self.prepare = None
        # A node that is a whole graph (``torch.compile``'s, runtime/trace/fx.py): its checked ops
        # with the node's arguments, for plan/prechecks.py to decide on the host (None: it cannot)
        self.inner_checks = None

    def __repr__(self):
        return f"OpSpec({self.name})"


def signature(vals: tuple) -> tuple:
    """Arguments' signatures: avals (and scalar kinds) of values, static arguments themselves."""
    return tuple(_sig(a) for a in vals)


def _sig(a):
    if isinstance(a, VALUE_TYPES):
        return a.sig
    if type(a) is tuple:
        return tuple(_sig(x) for x in a)
    if type(a) is float or type(a) is bool:
        return _static_sig(a)
    return a


def _static_sig(a):
    """A float or bool static argument's signature: ``4 == 4.0 == True`` and ``-0.0 == 0.0``,
    but ``arange(4)`` is int64 and ``arange(4.0)`` float32, ``full(s, True)`` is bool."""
    return (bool, a) if type(a) is bool else (float, a.hex())
