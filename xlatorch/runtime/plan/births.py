"""State born in a step from a constant (optimizer state) is computed before the step's graph.

An optimizer creates its state in its first step (AdamW: ``exp_avg = zeros_like(p)``, then
``exp_avg.lerp_(grad, ...)``); from the second step on the same tensors are device data. So
step 0's graph holds constant nodes where step 1's holds inputs: two large graphs that
differ only there, and two compiles before the second step ends.

On a compile miss, a sync looks for such births: a live tensor created in this step, outside
a backward pass, by a constant shaped like a tensor that is device data (``zeros_like``,
``ones_like``, ``full_like``, ``empty_like``, ``new_zeros`` ...: state shaped like a
parameter) and written in place since. It computes those constants first, by a graph of
their own (tiny), gives each tensor its constant as the data it held "before the step",
and compiles the step's graph with them as inputs, in the order the next step will meet
them: the graph the next step runs, which then hits the cache.

Gradients are never births (autograd makes them anew each step); nor are constants made
from a shape alone (``torch.ones(n).bernoulli_()``, an accumulator ``torch.zeros(())``),
which programs make anew every step far more often than state (so a capturable
optimizer's step count, ``zeros(())``, still differs between steps 0 and 1) - except a
buffer filled in part (``torch.zeros(shape)`` then ``index_copy_``, ``index_put_``, a slice
assignment: a static KV cache, a ring buffer): state a later step fills on. A tensor born
from a ``_like`` constant in every step and kept across ``mark_step`` would need two
executions a step: a graph split twice in a row (each time within ``RECENT`` syncs of the
last) is compiled whole when it misses a third time (the second time its split graph is
cached, so a second training run in one process compiles nothing): at most one extra
compile per graph. A birth further apart is split every time: a generation loop whose
static cache is made anew in each call's first forward (Hugging Face's ``StaticCache``
since transformers 5) pays one tiny execution a call for it, not a compile of its prefill
in the third call.
Counter ``BirthsHoisted``: the constants computed apart.
``XLATORCH_HOIST_BIRTHS=0`` turns this off.
"""

from __future__ import annotations

from collections import OrderedDict

from xlatorch.runtime.base import config
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.ir.values import Data, Out, operands, replace_operands
from xlatorch.runtime.trace.tensor import Storage

__all__ = ["ENABLED", "NAMES", "LIMIT", "RECENT", "mark", "hoist"]

ENABLED = config.env("XLATORCH_HOIST_BIRTHS")

# Ops whose value depends on their arguments' avals and static arguments only, shaped like
# their tensor argument.
NAMES = (
    "zeros_like.default", "ones_like.default", "full_like.default", "empty_like.default",
    "new_zeros.default", "new_ones.default", "new_full.default", "new_empty.default",
)  # fmt: skip
# Constants made from a shape alone: births only when written in part (``_fills``).
SHAPED = ("zeros.default", "ones.default", "full.default", "empty.memory_format")
# Ops writing part of a tensor (by ATen name, trailing ``_`` dropped); a view's write-through
# (``x[:, i] = v``) is ``<view op>.scatter``.
FILLS = frozenset(
    ("index_copy", "index_put", "index_fill", "scatter", "masked_scatter", "slice_scatter", "select_scatter")
)

_SPLIT: OrderedDict = OrderedDict()  # graph key -> (times split in a row, sync of the last split)
LIMIT = 2
# Splits of one graph at most this many syncs apart are in a row (a birth every step); further
# apart (a birth every generation call), the count starts again.
RECENT = 8


def mark(specs: dict) -> None:
    """Make ``dispatch.call`` record which storage each constant op's result was born in."""
    for name in NAMES + SHAPED:
        spec = specs.get(name)
        if spec is not None:
            spec.born = True


def _births(storages, nodes) -> dict:
    """id(constant node) -> the root storage born from it and written since."""
    roots = {id(st) for st in storages}
    found = {}
    for n in nodes:
        ref = getattr(n, "born", None)
        if ref is None:
            continue
        st = ref()
        if st is None or id(st) not in roots or st.prev is not None:
            continue
        v = st.value
        if type(v) is not Out or v.node is n or n.outs[0] is None:
            continue
        if any(type(a) is Out for a in operands(n.args)):
            continue
        if type(n.args[0]) is Data or _fills(v.node, n.outs[0]):
            found[id(n)] = (n, st)
    return found


def _fills(w, out) -> bool:
    """Whether node ``w`` writes part of ``out`` (its first argument)."""
    if not w.args or w.args[0] is not out:
        return False
    name = w.spec.name
    return name.endswith(".scatter") or name.split(".")[0].rstrip("_") in FILLS


def hoist(storages, nodes, key, run_part, sync=0):
    """The step's roots, reordered as the next step will have them, after computing their
    births by ``run_part(temporary storages)``; None when there is nothing to split (or the
    graph was split ``LIMIT`` times in a row, or computing the births failed: it compiles
    whole). ``sync``: the number of syncs so far (the runtime's count), which tells a birth
    every step from one every generation call."""
    if not ENABLED:
        return None
    found = _births(storages, nodes)
    if not found:
        return None
    n, last = _SPLIT.get(key, (0, sync))
    if not 0 <= sync - last <= RECENT:
        n = 0  # the last split was long ago: not a birth every step
    if n >= LIMIT:
        return None
    _SPLIT[key] = (n + 1, sync)
    while len(_SPLIT) > 64:
        _SPLIT.pop(next(iter(_SPLIT)), None)
    temps = [Storage(n.outs[0]) for n, _ in found.values()]
    try:
        run_part(temps)
    except Exception:  # the whole graph meets the same error where it is handled today
        return None
    done = {id(n): t.value for (n, _), t in zip(found.values(), temps)}
    del temps  # nothing holds the births' buffers now: the step may donate them, as the next will
    if any(type(v) is not Data for v in done.values()):
        return None
    for n in nodes:
        if any(type(a) is Out and id(a.node) in done for a in operands(n.args)):
            n.args = replace_operands(n.args, done)
    for n, st in found.values():
        st.prev = done[id(n)]  # a failed on-device check gives the constant back (runtime/lower/checks.py)
        st.first = st.gen  # its value before its last write, as far as checks can tell
    COUNTERS["BirthsHoisted"] += len(done)
    # The next step meets these storages as older than everything born in it.
    return sorted(storages, key=lambda st: (st.prev is None, st.sid))
