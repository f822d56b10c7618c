"""Graphs whose shapes change from sync to sync: run the changing part apart.

A loop that grows one tensor (text generation appends a token to ``input_ids`` at every
step) syncs the same program over inputs of a new shape each time, so the whole graph -
the model's forward included - would compile anew at every step. When a graph misses
the cache and a graph of the same structure (the same ops, wired the same way) ran
before, the nodes whose keys differ between the two (a new operand shape, a new static
argument) are the *changing* ones. The graph then runs as stages, in dependency order:
stages of changing nodes, compiled per shape and small, alternate with stages of the
unchanged nodes, compiled once. Values cross from one stage to the next as device data.

A changing stage whose values are all small integer or boolean tensors (the bookkeeping of
a generation loop: token ids, attention masks, positions) runs on the host instead, op by
op in PyTorch (``on_host``): integer ops are exact either way, and nothing is compiled for
each new length.

A graph of a new structure that is nearly one already split (the loop's last step, whose
mask needs no more padding, drops one op) borrows its plan (``_borrow``): nodes matched in
order keep their side. It runs so only when its compiled stages are all cached and its
changing ones all run on the host; otherwise it compiles whole, as any new graph.

A whole graph that is tiny (at most ``TINY`` nodes) and read by the host at once (``.item()``,
``.cpu()``: the sync waits for its values anyway) runs on the host the same way when every
node is exact there: bookkeeping as above, or a float op that only makes constants or moves
bits (``zero_``, ``zeros``, views, ``cat``) or compares. A generation loop's setup checks and
cache resets compile nothing then, each one new to the cache (counter ``GraphOnHost``). A graph
cut by ``mark_step`` never does: its values stay on the device for the next step. When the whole
graph is not tiny but the read value's own graph is (``tiny_and_exact``), that one runs on the
host alone and the rest stays pending (``execute/sync._read_alone``): a model's checks on its
inputs do not cut its step.

``split`` decides; ``execute/staged.run_stages`` runs the stages (``on_host`` for those that may)
and commits the step whole. A changing part that must compile splits off only when it is
the small part of a large graph (at most half the nodes, ``MIN_UNCHANGED`` unchanged ones);
a graph needing more than ``MAX_STAGES`` stages, a graph with collectives, an SPMD graph
(``graph.py`` does not ask) and ``dp.DataParallel``'s graphs compile whole as before.
"""

from __future__ import annotations

import math

import torch

from xlatorch.runtime.base.dtypes import STORAGE
from xlatorch.runtime.ir import values as ir
from xlatorch.runtime.ir.ops import GENERATOR
from xlatorch.runtime.ir.values import Scalar
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES

__all__ = [
    "split",
    "stages",
    "encode",
    "donors",
    "donating",
    "exact",
    "bookkeeping",
    "Whole",
    "Borrowed",
    "MAX_STAGES",
    "SEEN",
    "TINY",
    "HOST_READS",
    "small_integral",
    "on_host",
    "tiny_and_exact",
]

# At most this many stages per sync: each costs an execution's launch (a host stage: a wait
# for its inputs and their transfers); a dynamic KV cache makes two stages per layer.
MAX_STAGES = 256
# Structure -> (node keys, which changed, stages) of the last graph with that structure (a
# bounded memory of recent graphs: node keys are small tuples; nothing here holds device data).
SEEN: dict = {}
_SEEN_SIZE = 64
# A graph with fewer unchanged nodes than this compiles whole: the compile a split saves is
# small, and the split costs executions and fusion across the stages.
MIN_UNCHANGED = 32
# A graph of at most this many nodes, synced for a host read, runs on the host when it may (a
# PyTorch CPU kernel per node costs microseconds; a compile, tens of milliseconds).
TINY = 32
HOST_READS = frozenset((".item()", ".tolist()", ".numpy()", ".cpu()", "copy_ to CPU", "to_cpu"))


def split(nodes, enc, root_refs, gdev, reason=None) -> list[int] | None:
    """Each node's stage (stages of changing nodes are even, of unchanged nodes odd), or
    None: run the graph whole. Called at a cache miss; remembers this graph's node keys.
    A tiny graph read by the host (``reason``) gets one stage, 0: it runs on the host."""
    if ir._multi or gdev or any(r < 0 for r in root_refs):
        return None
    if on_host(nodes, reason):
        return Whole([0] * len(nodes))
    if any(n.spec in COLLECTIVES for n in nodes):  # every replica must run the same programs
        return None
    keys = [k for k, _ in enc]
    structure = (tuple((k[0], refs) for k, refs in enc), root_refs)
    seen = SEEN.pop(structure, None)
    changed = None if seen is None else [key != seen[0][k] for k, key in enumerate(keys)]
    plan = seen[2] if seen is not None and changed == seen[1] else None  # the same nodes changed again
    if plan is None and changed is not None and any(changed):
        plan = _plan(nodes, enc, changed)
    if seen is None:  # a new structure: a recent plan may fit it
        plan = _borrow(nodes, enc, keys)
        if plan is not None:
            changed = [False] * len(keys)  # met again unchanged: the same plan
    SEEN[structure] = (keys, changed, plan)
    if len(SEEN) > _SEEN_SIZE:
        del SEEN[next(iter(SEEN))]
    return plan or None


def on_host(nodes, reason) -> bool:
    """Whether a graph synced for ``reason`` runs on the host whole: tiny, read by the host, exact there."""
    return reason in HOST_READS and len(nodes) <= TINY and all(exact(n) for n in nodes)


def tiny_and_exact(value) -> bool:
    """Whether the graph of the pending ``value`` alone is tiny and exact on the host: a walk that
    stops at its ``TINY + 1``-th node or at the first node that is not exact, so a read of a large
    graph (a step's loss) pays a few nodes' look, not a second walk of its graph."""
    seen: set = set()
    todo = [value.node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > TINY or not exact(n):
            return False
        todo.extend(v.node for v in ir.operands(n.args) if type(v) is ir.Out)
    return True


class Whole(list):
    """A plan of one stage for a tiny graph read by the host: it runs there whole."""


class Borrowed(list):
    """A plan fitted from a recent graph of another structure (``_borrow``): it runs only
    when its compiled stages are all cached and its changing stages all run on the host."""


# A plan is borrowed from a graph at most this many nodes apart (ops added, dropped, changed).
BORROW_SLACK = 8


def _borrow(nodes, enc, keys) -> Borrowed | None:
    """A plan for a new structure, from a recent plan of one nearly alike: a generation loop's
    last step, whose mask needs no more padding, drops an op. Nodes matched in order (by op)
    keep their side, changing or unchanged; the others change. None when it does not fit."""
    import difflib

    specs = [k[0] for k in keys]
    tried = 0
    for old, _, old_plan in reversed(SEEN.values()):
        if not old_plan or abs(len(old) - len(keys)) > BORROW_SLACK:
            continue
        tried += 1
        if tried > 4:
            break
        moves: list = [True] * len(keys)
        matched = 0
        blocks = difflib.SequenceMatcher(None, [k[0] for k in old], specs, autojunk=False).get_matching_blocks()
        for a, b, size in blocks:
            for i in range(size):
                moves[b + i] = not old_plan[a + i] & 1
            matched += size
        if len(keys) - matched > BORROW_SLACK or not all(bookkeeping(n) for n, m in zip(nodes, moves) if m):
            continue
        stage = _number(enc, moves)
        if max(stage) < MAX_STAGES and any(s & 1 for s in stage):
            return Borrowed(stage)
    return None


def _number(enc, moves) -> list[int]:
    """Each node's stage: changing nodes (``moves``) in even stages, the others in odd ones,
    each at or after its operands' stages."""
    stage: list[int] = []
    for k, (_, refs) in enumerate(enc):
        s = 0
        for r in refs:
            if r >= 0 and stage[r // 4096] > s:
                s = stage[r // 4096]
        if moves[k]:
            s += s & 1  # the next even stage at or after its operands'
        else:
            s += not s & 1  # the next odd one
        stage.append(s)
    return stage


def _plan(nodes, enc, changed) -> list[int]:
    """The stages for a graph whose ``changed`` nodes' keys differ from the last time (an
    empty list: run it whole)."""
    moves = list(changed)  # changing nodes, and what runs with them
    # Unchanged integer bookkeeping next to the changing nodes runs with them: a position
    # computed from a mask that grows (it feeds only changing nodes), a stopping criterion on
    # the grown ids (it reads them). One stage instead of two more.
    ops = [[r // 4096 for r in refs if r >= 0] for _, refs in enc]
    hostable: list[bool] = []  # bookkeeping over leaves, changing nodes and other such nodes
    for k, n in enumerate(nodes):
        hostable.append(bookkeeping(n) and all(hostable[o] or moves[o] for o in ops[k]))
    for k in range(len(nodes)):
        if not moves[k] and hostable[k] and any(moves[o] for o in ops[k]):
            moves[k] = True
    users: list[list[int]] = [[] for _ in nodes]
    for k in range(len(nodes)):
        for o in ops[k]:
            users[o].append(k)
    for k in range(len(nodes) - 1, -1, -1):
        if not moves[k] and hostable[k] and users[k] and all(moves[u] for u in users[k]):
            moves[k] = True
    stage = _number(enc, moves)
    # Changing stages that run on the host compile nothing: worth it for any graph. Others
    # compile per shape: worth it when they are the small part of a large graph.
    if not all(bookkeeping(n) for n, m in zip(nodes, moves) if m):
        changing = sum(moves)
        if 2 * changing > len(nodes) or len(nodes) - changing < MIN_UNCHANGED:
            return []
    if max(stage) >= MAX_STAGES:
        return []
    return stage


def stages(enc, root_refs, stage):
    """Per stage that computes something, in order: ``(stage, its nodes' positions, the refs of
    its outputs read by later stages or roots, sorted)``."""
    n = max(stage) + 1
    members: list[list[int]] = [[] for _ in range(n)]
    wanted: list[set] = [set() for _ in range(n)]
    for k, (_, refs) in enumerate(enc):
        s = stage[k]
        members[s].append(k)
        for r in refs:
            if r >= 0 and stage[r // 4096] != s:
                wanted[stage[r // 4096]].add(r)
    for r in root_refs:
        wanted[stage[r // 4096]].add(r)
    return [(s, members[s], sorted(wanted[s])) for s in range(n) if wanted[s]]


def encode(nodes, leaves, enc, stage, ks, refs, cut):
    """Stage ``ks``' leaves (the whole graph's leaves it reads, then earlier stages' outputs as
    ``cut`` holds them, in first-use order), encoding and roots ``refs``: its cache key's
    parts, from the whole graph's encoding (no second walk of the graph)."""
    pos = {k: i for i, k in enumerate(ks)}
    sl: list = []
    lpos: dict = {}
    senc = []
    for k in ks:
        new = []
        for r in enc[k][1]:
            j = r // 4096 if r >= 0 else -1
            if j >= 0 and j in pos:
                new.append(pos[j] * 4096 + r % 4096)
                continue
            if j >= 0:  # an earlier stage's output: its device data (before it ran: the value, same sig)
                o = nodes[j].outs[r % 4096]
                v = cut.get(id(o), o)
            else:
                v = leaves[-1 - r]
            i = lpos.get(id(v))
            if i is None:
                i = lpos[id(v)] = len(sl)
                sl.append(v)
            new.append(-1 - i)
        senc.append((enc[k][0], tuple(new)))
    return sl, senc, tuple(pos[r // 4096] * 4096 + r % 4096 for r in refs)


def donors(leaves, enc, stage, data) -> dict:
    """``id`` -> stage, for each of ``data`` (device-data leaves a staged step may donate: no
    live tensor holds them): the last stage reading it, whose executable may reuse its buffer.
    The caller donates only to a stage with no checks to read: a check that fires makes it run
    the graph whole, from the leaves."""
    if not data:
        return {}
    want = {id(d) for d in data}
    last: dict = {}
    for k, (_, refs) in enumerate(enc):
        for r in refs:
            if r < 0 and id(leaves[-1 - r]) in want:
                last[id(leaves[-1 - r])] = stage[k]  # nodes are in order, stages increase along them
    return last


def donating(parts, nodes) -> int:
    """The stage that may donate, of ``stages``' ``parts``: the last one that compiles, that is
    the last but trailing stages of bookkeeping with no checks (on the host: they compile
    only if PyTorch's kernel fails there, and then read no check rows); -1 when none."""
    for s, ks, _ in reversed(parts):
        if s & 1 or not all(bookkeeping(nodes[k]) and not nodes[k].info.checked for k in ks):
            return s
    return -1


HOST_MAX_ELEMENTS = 1 << 16  # per value: a stage reading or making more stays on the device


def small_integral(aval) -> bool:
    """Whether ``aval`` is an integer or boolean tensor of at most ``HOST_MAX_ELEMENTS`` elements."""
    return (
        aval is not None
        and not (aval[1].is_floating_point or aval[1].is_complex)
        and (math.prod(aval[0]) <= HOST_MAX_ELEMENTS)
    )


_BOOKKEEPING: dict = {}  # node key -> whether it is bookkeeping (its avals and op decide)


def bookkeeping(n) -> bool:
    """Whether node ``n`` reads and makes only small integer or boolean tensors with an ATen op
    that PyTorch runs on the host as it is (no random numbers)."""
    ok = _BOOKKEEPING.get(n.key)
    if ok is None:
        spec = n.spec
        ok = (
            GENERATOR not in spec.kinds
            and isinstance(spec.overload, torch._ops.OpOverload)
            and all(small_integral(a) for a in n.info.avals)
            and all(type(v) is Scalar or small_integral(v.aval) for v in ir.operands(n.args))
        )
        if len(_BOOKKEEPING) > 4096:
            _BOOKKEEPING.clear()
        _BOOKKEEPING[n.key] = ok
    return ok


# Ops on floats that never round: constants, their operands' bits moved, and comparisons
# (IEEE comparisons are exact; on denormals the host gives PyTorch's own answer, where XLA's
# CPU backend flushes them to zero). They run on the host bit for bit. By ATen name.
_MOVES = frozenset((
    "zeros", "ones", "zeros_like", "ones_like", "new_zeros", "new_ones", "zero", "zero_", "empty",
    "empty_like", "new_empty", "clone", "alias", "detach", "view", "_unsafe_view", "reshape",
    "slice", "select", "narrow", "unsqueeze", "squeeze", "expand", "permute", "transpose", "t",
    "cat", "stack", "index_select", "where", "masked_fill", "masked_fill_",
    "eq", "ne", "lt", "le", "gt", "ge", "any", "all", "isnan", "isinf", "isfinite",
))  # fmt: skip
# Float ops that round once, as IEEE prescribes, on the host as on the device: a sum, difference
# or product of float32 or float64 values. Not with ``alpha`` (PyTorch's CPU kernel fuses it into
# a multiply-add), not a division (CPU's kernel may multiply by a reciprocal), not half floats
# (CPU computes them in float32 and rounds twice), and not a sum of a product: XLA contracts
# ``a * b + c`` into one fused multiply-add, which the host's two ops round differently. By
# overload name.
_PRODUCTS = frozenset(("mul.Tensor", "mul.Scalar", "neg.default", "mul_.Tensor", "mul_.Scalar", "neg_.default"))
_SUMS = frozenset((
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar",
    "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar",
))  # fmt: skip
_ROUNDS_ONCE = _PRODUCTS | _SUMS
_WIDE = (torch.float32, torch.float64)
_EXACT: dict = {}  # node key -> whether it runs on the host exactly


def exact(n) -> bool:
    """Whether node ``n`` gives the same bits on the host: bookkeeping, or a small float tensor
    made or moved by an op of ``_MOVES``, or computed by one of ``_ROUNDS_ONCE``, without a
    change of dtype."""
    ok = _EXACT.get(n.key)
    if ok is None:
        ok = bookkeeping(n)
        if not ok:
            spec = n.spec
            avals = [a for a in n.info.avals if a is not None]
            ins = [v.aval for v in ir.operands(n.args) if type(v) is not Scalar]
            rounds = spec.name in _ROUNDS_ONCE and all(a[1] in _WIDE for a in avals) and _no_alpha(n.args)
            ok = (
                (rounds or spec.name.split(".")[0] in _MOVES)
                and isinstance(spec.overload, torch._ops.OpOverload)
                and all(math.prod(a[0]) <= HOST_MAX_ELEMENTS for a in avals + ins)
                and len(floats := {a[1] for a in avals + ins if a[1].is_floating_point or a[1].is_complex}) <= 1
                and not any(dt in STORAGE for dt in floats)  # a precision mode: the device compares narrower
            )
        if len(_EXACT) > 4096:
            _EXACT.clear()
        _EXACT[n.key] = ok
    if ok and n.spec.name in _SUMS and not bookkeeping(n):  # not in the key: what made its operands
        return not any(type(v) is ir.Out and v.node.spec.name in _PRODUCTS for v in n.args)
    return ok


def _no_alpha(args) -> bool:
    """Whether an add or sub has no ``alpha`` (PyTorch passes its default, the int 1)."""
    return len(args) < 3 or (type(args[2]) is int and args[2] == 1)
