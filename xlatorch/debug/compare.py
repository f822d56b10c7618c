"""Which op makes the device's results diverge from PyTorch's on CPU: ``compare(fn, *args)``.

``compare`` runs ``fn`` (a step: forward, backward, optimizer) on the device once, with every
op's output kept, then checks each op on CPU from the device's own inputs to that op. A
local check isolates the op: an error made earlier does not reach it. An op is beyond
tolerance when the device's distance to a float64 computation of the op (from the same
inputs) exceeds what rounding can explain: several times CPU's own float32 error plus the
output's sensitivity to one-ulp changes of its inputs (what the op amplifies), plus a few
ulps of each output element. Integer and boolean outputs must match exactly. Random ops
(whose device values CPU cannot reproduce) and ops without a CPU kernel are taken as given.

Then the whole step runs again on CPU as a chain (each op from the chain's own results) to
show how the first culprit's difference grows up to the step's outputs.

Precision modes: an op computed in bfloat16 / float16 (autocast, ``.to(torch.bfloat16)``,
``XLA_USE_BF16``, ``XLA_DOWNCAST_BF16``) or a float32 matmul under
``set_mat_mul_precision('default')`` that differs within that precision's rounding is
counted as rounding of that mode, not reported as a divergence.

``XLATORCH_COMPARE=1``: every ``xm.mark_step()`` first compares its step this way and logs
the report (logger ``"xlatorch"``) when an op diverges. It runs every step twice over (on
the device with all intermediates as outputs, then each op a few times on CPU): slow.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from xlatorch.debug.dump import aval_text, op_name
from xlatorch.debug.knob import LOG
from xlatorch.runtime.base import config, dtypes, record
from xlatorch.runtime.base.source import fmt_src
from xlatorch.runtime.execute.sync import sync
from xlatorch.runtime.execute.transfer import from_array
from xlatorch.runtime.ir import values as ir
from xlatorch.runtime.ir.ops import GENERATOR
from xlatorch.runtime.ir.values import Data, Out, Scalar, operands
from xlatorch.runtime.lower import precision
from xlatorch.runtime.plan.collect import collect
from xlatorch.runtime.trace.nodes import run_node_on_cpu as _run
from xlatorch.runtime.trace.tensor import XlaTensor, pending_storages, reroot_lone_views, wrap

__all__ = ["compare", "compare_pending", "CompareReport", "OpDiff", "Growth"]

K = 8.0  # how many times rounding's own size the device's error may reach
ULPS = 4.0  # plus this many ulps of each output element
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "dot", "convolution", "_convolution", "linear", "einsum"}
_LOW = (torch.bfloat16, torch.float16)


@dataclass
class OpDiff:
    """One op's output on the device against CPU's from the same inputs.

    ``kind``: "diverged" (beyond tolerance) or "rounding" (within the rounding of ``mode``).
    ``max_abs`` / ``max_rel``: the largest difference from CPU, absolute and relative to the
    output's largest magnitude; ``allowed``: the largest absolute error rounding explains."""

    index: int
    op: str
    src: tuple | None
    inputs: list[str]
    outputs: list[str]
    max_abs: float
    max_rel: float
    allowed: float
    kind: str
    mode: str | None = None

    def line(self) -> str:
        return (f"#{self.index} {self.op} at {fmt_src(self.src, full=True)}: ({', '.join(self.inputs)}) -> "
                f"{', '.join(self.outputs)}; max abs diff {self.max_abs:.3g}, max rel diff {self.max_rel:.3g} "
                f"(rounding explains {self.allowed:.3g})")  # fmt: skip


@dataclass
class Growth:
    """The device against CPU's chained run at one value: op ``index``'s output, or a step output."""

    index: int
    label: str
    src: tuple | None
    max_abs: float
    max_rel: float

    def line(self) -> str:
        where = "" if self.src is None else f" at {fmt_src(self.src, full=True)}"
        return f"{self.label}{where}: max abs diff {self.max_abs:.3g}, max rel diff {self.max_rel:.3g}"


@dataclass
class CompareReport:
    """What ``compare`` found. ``first``: the first op beyond tolerance (None: none);
    ``diverged``: every such op; ``rounding``: ops within a precision mode's rounding;
    ``growth``: the chained difference at the culprit, where it grew 10x, and at the step's
    outputs; ``taken``: ops not checked, by reason, their device values taken as given;
    ``result``: what ``fn`` returned."""

    first: OpDiff | None
    diverged: list[OpDiff] = field(default_factory=list)
    rounding: list[OpDiff] = field(default_factory=list)
    growth: list[Growth] = field(default_factory=list)
    taken: dict[str, list[str]] = field(default_factory=dict)
    checked: int = 0
    result: Any = None

    def __str__(self) -> str:
        lines = [f"xlatorch.debug.compare: {self.checked} ops checked against CPU (inputs from the device)"]
        if self.first is None:
            lines.append("no divergence: every op is within rounding of its CPU result")
        else:
            lines.append("first divergence: " + self.first.line())
            if len(self.diverged) > 1:
                lines.append(f"{len(self.diverged) - 1} later op(s) also beyond tolerance, the next: "
                             + self.diverged[1].line())  # fmt: skip
        modes: dict[str, list[OpDiff]] = {}
        for d in self.rounding:
            modes.setdefault(d.mode, []).append(d)
        for mode, ds in modes.items():
            top = max(ds, key=lambda d: d.max_rel)
            lines.append(f"bf16 rounding ({mode}): {len(ds)} op(s) differ within that precision's rounding, "
                         f"not a divergence; largest: " + top.line())  # fmt: skip
        if self.growth:
            lines.append("growth of the difference (device vs CPU running the whole step):")
            lines += ["  " + g.line() for g in self.growth]
        for reason, ops in self.taken.items():
            names = sorted(set(ops))
            lines.append(f"taken from the device ({reason}): {len(ops)} op(s): {', '.join(names[:6])}"
                         + (" ..." if len(names) > 6 else ""))  # fmt: skip
        return "\n".join(lines)


@contextlib.contextmanager
def _source_lines():
    prev = ir.DEBUG_SOURCE
    ir.DEBUG_SOURCE = True
    try:
        yield
    finally:
        ir.DEBUG_SOURCE = prev


def compare(fn, *args, **kwargs) -> CompareReport:
    """Run ``fn(*args, **kwargs)`` on the device and check each of its ops against CPU.

    Syncs what was pending before (so only ``fn``'s ops are compared), records source lines
    while ``fn`` runs, then runs ``fn``'s graph once on the device with every op's output
    kept: ``fn``'s effects (in-place updates of parameters, optimizer state) take place once,
    as a plain run followed by ``mark_step`` would. ``fn`` must not call ``mark_step`` itself.
    Modules and optimizers among the arguments (or that ``fn`` reads from its closure or
    globals) name the step's outputs in the report.

    Returns:
      A ``CompareReport``; ``str()`` of it is a readable report.
    """
    sync("compare")
    with _source_lines():
        result = fn(*args, **kwargs)
    labels = _labels(list(args) + list(kwargs.values()) + _referenced(fn), result)
    report = compare_pending(labels)
    report.result = result
    return report


def _referenced(fn) -> list:
    """The objects ``fn`` reads from its closure and by global name (a model, an optimizer)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    objs = [_contents(c) for c in (fn.__closure__ or ())]
    g = getattr(fn, "__globals__", {})
    return objs + [g[k] for k in code.co_names if k in g]


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _labels(objs, result) -> dict[int, str]:
    """id(storage) -> a name for the step's outputs: fn's result, parameters, gradients, optimizer state."""
    out: dict[int, str] = {}

    def put(t, name):
        if type(t) is XlaTensor and id(t._st) not in out:
            out[id(t._st)] = name

    def visit(obj, name):
        if isinstance(obj, torch.Tensor):
            put(obj, name)
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                visit(x, f"{name}[{i}]")
        elif isinstance(obj, dict):
            for k, x in obj.items():
                visit(x, f"{name}[{k!r}]")

    visit(result, "result")
    for a in objs:
        if isinstance(a, torch.nn.Module):
            for n, p in a.named_parameters():
                put(p, f"parameter {n}")
                if p.grad is not None:
                    put(p.grad, f"grad of {n}")
        elif isinstance(a, torch.optim.Optimizer):
            for i, st in enumerate(a.state.values()):
                for k, v in st.items():
                    put(v, f"optimizer state[{i}][{k!r}]")
    return out


def compare_pending(labels: dict[int, str] | None = None) -> CompareReport:
    """Compare every pending value's graph (what the next sync would run) against CPU, running it
    on the device once (a sync, with every op's output kept). See ``compare``."""
    labels = labels or {}
    storages = pending_storages()
    reroot_lone_views(storages)  # as the sync would: what it runs
    g = collect([st.value for st in storages])
    nodes = [_Op(n) for n in g.nodes]  # as traced: a sync may replace arguments (runtime/plan/births.py)
    # The leaves' data first: the sync may donate the buffers of leaves no tensor holds any more.
    vals: dict[int, Any] = {id(v): _leaf_cpu(v) for v in g.leaves if type(v) is Data}
    keep = [[None if o is None else wrap(o) for o in n.outs] for n in g.nodes]
    roots = [(labels.get(id(st)), st.value) for st in storages]
    sync("compare")
    dev: dict[int, list] = {}
    for n, ts in zip(nodes, keep):
        dev[n.key] = [None if t is None else _data_cpu(t._st.value) for t in ts]
    del keep, g
    report = CompareReport(first=None)
    mode = _low_mode(nodes)
    for i, n in enumerate(nodes):
        reason = _untestable(n)
        if reason is None:
            try:
                d = _check(i, n, dev, vals, mode)
            except Exception as e:  # no CPU kernel for these arguments, or it disagrees on their types
                reason, d = f"CPU could not run it: {type(e).__name__}", None
        if reason is not None:
            report.taken.setdefault(reason, []).append(op_name(n.spec))
            continue
        report.checked += 1
        if d is None:
            continue
        (report.diverged if d.kind == "diverged" else report.rounding).append(d)
    report.first = report.diverged[0] if report.diverged else None
    report.growth = _growth(nodes, dev, vals, roots, report.first)
    return report


class _Op:
    """A node as traced: ``key`` is id() of the node, which its outputs' ``.node`` is."""

    __slots__ = ("spec", "args", "info", "outs", "src", "key")

    def __init__(self, n):
        self.spec, self.args, self.info, self.outs = n.spec, n.args, n.info, n.outs
        self.src, self.key = getattr(n, "src", None), id(n)


def _leaf_cpu(v):
    return from_array(v.array, v.aval[1])


def _data_cpu(v):
    if type(v) is not Data:  # a failed value
        return None
    return from_array(v.array, v.aval[1])


def _untestable(n) -> str | None:
    spec = n.spec
    if GENERATOR in spec.kinds:
        return "random op, CPU cannot reproduce its values"
    if getattr(spec, "overload", None) is None or not callable(spec.overload):
        return "no PyTorch op to run on CPU"
    return None


def _low_mode(nodes) -> str:
    """The name of the low-precision mode bfloat16/float16 ops of this graph come from."""
    if dtypes.USE_BF16:
        return "XLA_USE_BF16"
    if dtypes.DOWNCAST_BF16:
        return "XLA_DOWNCAST_BF16"
    for n in nodes:  # autocast casts float32 arguments with _to_copy
        if n.spec.name == "_to_copy.default" and n.info.avals[0][1] in _LOW:
            ins = operands(n.args)
            if ins and ins[0].aval[1] == torch.float32:
                return "autocast"
    return "bfloat16 tensors"


def _operand(get, dtype64=False, noise=None):
    """A converter of one node argument to what the PyTorch op takes on CPU."""

    def conv(a):
        t = type(a)
        if t is Data or t is Out:
            x = get(a)
            if dtype64 and x.is_floating_point():
                x = x.double()
                if noise is not None:
                    x = x * (1 + noise(a) * torch.randn(x.shape, generator=noise.gen, dtype=torch.float64).sign())
            return x
        if t is Scalar:
            if a.tensor:
                x = torch.tensor(a.value, dtype=a.aval[1])
                return x.double() if dtype64 and x.is_floating_point() else x
            return a.value
        if t is tuple:
            return [conv(x) for x in a]
        if isinstance(a, torch.device) and a.type != "cpu":
            return torch.device("cpu")
        return a

    return conv


def _value_getter(dev, vals):
    def get(v):
        if type(v) is Out:
            x = dev[id(v.node)][v.idx]
        else:
            x = vals[id(v)]
        if x is None:
            raise ValueError("a failed input")
        return x

    return get


class _Noise:
    """Rounding's largest relative error (half an ulp) in each float input's dtype (its device
    storage's, under a precision mode), as a perturbation with random signs (a fixed seed: the
    same tolerance every run)."""

    def __init__(self, eps_of):
        self.gen = torch.Generator().manual_seed(0)
        self.eps_of = eps_of

    def __call__(self, v):
        return self.eps_of(v.aval[1]) / 2


def _eps(dt) -> float:
    return torch.finfo(dtypes.STORAGE.get(dt, dt)).eps


def _check(i, n, dev, vals, low_mode) -> OpDiff | None:
    """Node ``n`` against CPU from the device's inputs: None when it matches within rounding."""
    get = _value_getter(dev, vals)
    mine = dev[n.key]
    cpu = _run(n, _operand(get))
    base = n.spec.name.split(".")[0]
    mm_default = base in _MATMULS and precision.get_precision() == "default"
    worst = None
    for k, (y, c) in enumerate(zip(mine, cpu)):
        aval = n.info.avals[k] if k < len(n.info.avals) else None
        if y is None or aval is None or not isinstance(c, torch.Tensor):
            continue
        if not (y.is_floating_point() or y.is_complex()):
            if not torch.equal(y, c.to(y.dtype)):
                diff = (y.double() - c.double()).abs().max().item() if y.numel() else 0.0
                scale = c.double().abs().max().item() if c.numel() else 0.0
                return _diff(i, n, diff, diff / max(scale, 1e-30), 0.0, "diverged")
            continue
        d = _float_check(n, k, y, c, get, mm_default, low_mode)
        if d is not None and (worst is None or d[0] == "diverged" or d[2] > worst[2]):
            worst = d
            if d[0] == "diverged":
                break
    if worst is None:
        return None
    kind, mode, abs_d, rel_d, allowed = worst
    return _diff(i, n, abs_d, rel_d, allowed, kind, mode)


def _real(x):
    return torch.view_as_real(x) if x.is_complex() else x


def _float_check(n, k, y, c, get, mm_default, low_mode):
    """(kind, mode, max abs, max rel, allowed) for float output ``k``, or None when it equals CPU's."""
    y, c = _real(y).double(), _real(c.to(y.dtype)).double()
    same = (y == c) | (torch.isnan(y) & torch.isnan(c))
    if bool(same.all()):
        return None
    diff = torch.where(same, torch.zeros_like(y), (y - c).abs())
    abs_d = diff.max().item()
    scale = c.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if c.numel() else 0.0
    rel_d = abs_d / max(scale, 1e-30)
    out_dt = n.info.avals[k][1]
    low = dtypes.STORAGE.get(out_dt, out_dt) in _LOW or any(
        isinstance(v, (Data, Out)) and dtypes.STORAGE.get(v.aval[1], v.aval[1]) in _LOW for v in operands(n.args)
    )
    levels = [(low_mode if low else None, _eps)]
    if mm_default and not low:
        levels.append(("mat_mul_precision 'default'", lambda dt: torch.finfo(torch.bfloat16).eps))
    allowed = 0.0
    for mode, eps_of in levels:
        ok, allowed = _within(n, k, y, c, get, eps_of, same)
        if ok:
            return ("rounding", mode, abs_d, rel_d, allowed) if mode is not None else None
    return ("diverged", None, abs_d, rel_d, allowed)


def _within(n, k, y, c, get, eps_of, same):
    """Whether the device's output ``y`` is within rounding of the op's float64 value, and the
    largest error allowed. Without a float64 computation, CPU's result stands in for it."""
    eps_out = eps_of(n.info.avals[k][1])
    try:
        r64 = _real(_run(n, _operand(get, True))[k]).double()
        p64 = _real(_run(n, _operand(get, True, _Noise(eps_of)))[k]).double()
        sens = _finite_max((p64 - r64).abs())
        own = _finite_max((c - r64).abs())
    except Exception:  # no float64 kernel (or mixed dtypes it does not accept)
        r64, sens, own = c, 0.0, 0.0
    err = (y - r64).abs()
    allow = K * (sens + own) + ULPS * eps_out * r64.abs() + 1e-30
    bad = ~same & ~(err <= allow)  # NaN error counts as bad unless both are NaN
    bad &= ~(torch.isinf(y) & torch.isinf(r64) & (torch.sign(y) == torch.sign(r64)))
    return not bool(bad.any()), _finite_max(allow)


def _finite_max(x) -> float:
    x = x[torch.isfinite(x)]
    return x.max().item() if x.numel() else 0.0


def _diff(i, n, abs_d, rel_d, allowed, kind, mode=None) -> OpDiff:
    ins = [aval_text(v.aval) for v in operands(n.args) if type(v) is not Scalar]
    outs = [aval_text(a) for a in n.info.avals if a is not None]
    return OpDiff(i, op_name(n.spec), n.src, ins, outs, abs_d, rel_d, allowed, kind, mode)


def _distance(y, c):
    """(max abs, max rel) between the device's ``y`` and CPU's ``c`` (NaN where only one is NaN: inf)."""
    if y is None or c is None or not isinstance(c, torch.Tensor) or y.numel() == 0:
        return 0.0, 0.0
    y, c = _real(y).double(), _real(c.to(y.dtype)).double()
    same = (y == c) | (torch.isnan(y) & torch.isnan(c))
    d = torch.where(same, torch.zeros_like(y), (y - c).abs().nan_to_num(math.inf, math.inf, math.inf))
    abs_d = d.max().item()
    scale = c.abs().nan_to_num(0.0, 0.0, 0.0).max().item()
    return abs_d, abs_d / max(scale, 1e-30)


def _growth(nodes, dev, vals, roots, first) -> list[Growth]:
    """The whole graph on CPU from the leaves (random ops and unchecked ops: the device's
    values): the device's distance to it after ``first``, and at the labelled step outputs."""
    if first is None:
        return []
    chain: dict[int, list] = {}
    get = _value_getter(chain, vals)
    out: list[Growth] = []
    last = 0.0
    for i, n in enumerate(nodes):
        res = None
        if i >= first.index and _untestable(n) is None:
            try:
                res = _run(n, _operand(get))
                if len(res) != len(n.outs):
                    res = None
            except Exception:
                res = None
        if res is None:  # before the culprit the chain equals the device (checked op by op)
            res = dev[n.key]
        chain[n.key] = res
        if i < first.index:
            continue
        a, r = max((_distance(y, c) for y, c in zip(dev[n.key], res)), key=lambda t: t[1], default=(0.0, 0.0))
        if i == first.index or (r >= 10 * last and r > 0 and len(out) < 8):
            out.append(Growth(i, f"#{i} {op_name(n.spec)}", n.src, a, r))
            last = r
    order = ("result", "parameter", "grad", "optimizer")  # the loss first, then what the step updates
    roots = sorted(roots, key=lambda r: next((i for i, w in enumerate(order) if (r[0] or "").startswith(w)), 4))
    unnamed = []
    for label, v in roots:
        if type(v) is not Out or id(v.node) not in chain:
            continue
        a, r = _distance(dev[id(v.node)][v.idx], chain[id(v.node)][v.idx])
        if label is not None:
            out.append(Growth(-1, label, None, a, r))
        else:  # a tensor the step updates that no argument names (XLATORCH_COMPARE: all of them)
            unnamed.append(Growth(-1, f"step output {aval_text(v.aval)} from {op_name(v.node.spec)}", None, a, r))
    unnamed.sort(key=lambda g: -g.max_rel)
    out += unnamed[:8]
    return out


def _on_step() -> None:
    """Before each ``mark_step``'s sync (``XLATORCH_COMPARE=1``): compare the step, log a divergence."""
    if not pending_storages():
        return
    try:
        report = compare_pending()
    except Exception as e:  # a hook must not raise: the step still runs at the sync
        LOG.warning("xlatorch.debug.compare: could not compare this step: %s: %s", type(e).__name__, e)
        return
    if report.first is not None:
        LOG.warning("%s", report)


ENABLED = config.env("XLATORCH_COMPARE")
if ENABLED:
    record.SOURCE_LINES = True
    ir.DEBUG_SOURCE = True
    record.PRE_STEP_HOOKS.append(_on_step)
