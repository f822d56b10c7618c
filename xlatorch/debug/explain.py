"""Why the program recompiles and why it waits for the device.

Compile reasons: each compile is compared with the most similar graph compiled
before (the same op sequence first, else the longest common op prefix) and the
difference is named: an input whose shape or dtype changed, a constant (a Python
number passed as a static argument: a size, a dim) that changed, the op where the
sequences diverge, the set of outputs, buffer donation, the device. Records:
``compile_reasons()``.

Host syncs: every graph cut other than ``mark_step`` (``.item()``, ``print``,
``.cpu()``, a data-dependent op, a CPU fallback, ``xm.save``) is recorded with its
cause and the user's source line, per step and over the run: ``sync_report()``.

Both are recorded at every debug level (they happen at compiles and syncs only, each
of which costs far more); see ``xlatorch.debug.knob`` for what each level logs. Eager mode's
per-op syncs and compiles are neither (as in torch_xla); a graph compiled in a named
``torch_xla.compile`` region carries its name. The same comparison names what changed when a
region makes more graphs than its ``max_different_graphs`` (``record.GRAPH_DIFF``).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses

from xlatorch.debug import knob
from xlatorch.debug.dump import aval_text, dtype_name, graph_text, op_name
from xlatorch.runtime.base import record, regions
from xlatorch.runtime.base.record import cause
from xlatorch.runtime.base.source import fmt_src, user_frame

__all__ = [
    "CompileRecord",
    "GraphMemory",
    "graph_memory",
    "compile_reasons",
    "sync_report",
    "sync_counts",
    "summary",
    "cause",
    "clear",
]

_HISTORY: collections.deque = collections.deque(maxlen=64)  # _Graph summaries, newest last
_RECORDS: collections.deque = collections.deque(maxlen=1000)
_RUN: collections.Counter = collections.Counter()  # (cause, "path:line") -> count
_STEP: collections.Counter = collections.Counter()
_step = 0  # mark_steps seen
_last_sync: tuple[str, str | None] = ("mark_step", None)


def sig_text(sig) -> str:
    """A leaf's signature as text: device data by aval, host scalars by kind."""
    if type(sig) is tuple and len(sig) == 2 and sig[0] in ("s", "t"):
        kind = "a Python number" if sig[0] == "s" else "a 0-d CPU tensor"
        return f"{kind} ({dtype_name(sig[1])})"
    if type(sig) is tuple and len(sig) == 2 and type(sig[0]) is tuple:
        return aval_text(sig)
    return repr(sig)


@dataclasses.dataclass
class CompileRecord:
    """One compile: why it happened and what it cost.

    Attributes:
      reason: one line naming the difference from the closest graph compiled before.
      details: further differences, one line each (most specific first).
      graph_nodes: IR nodes in the compiled graph.
      compile_ms: wall time of lowering plus XLA compilation.
      source: ``path:line`` of the user code behind the difference (the first differing
        op, or the op first reading a changed input) when known, else of the graph cut.
      sync: what cut the graph (``mark_step``, ``.item()``, ``print``, ...).
      step: the number of ``mark_step`` calls before this compile.
      memory: buffer sizes in bytes from XLA (``argument``, ``output``, ``alias``,
        ``temp``, ``generated_code``), or None when unavailable.
      name: the ``torch_xla.compile`` region's ``name`` the graph was compiled in, or None.
      graph: the graph's number in this process (its executable's; out-of-memory errors and
        profiler spans name it).
    """

    reason: str
    details: list[str]
    graph_nodes: int
    compile_ms: float
    source: str | None
    sync: str
    step: int
    memory: dict | None = None
    name: str | None = None
    graph: int = 0

    def __str__(self) -> str:
        at = f" at {self.source}" if self.source else ""
        graph = f", graph {self.name!r}" if self.name else ""
        return f"{self.reason}{at} [{self.graph_nodes} nodes, {self.compile_ms:.1f} ms, cut by {self.sync}{graph}]"


class _Graph:
    """What a compiled graph's key says, with the op names and source lines of its nodes."""

    __slots__ = ("key", "names", "srcs", "first_use", "nodes_sig")

    def __init__(self, key, nodes):
        self.key = key
        enc = key[0]
        self.names = tuple(op_name(k[0][0]) for k in enc)
        self.srcs = tuple(getattr(n, "src", None) for n in nodes)
        # leaf index -> the first node reading it, preferring a forward op with a source line
        # (the user's own line, not the backward() call a backward op is attributed to).
        first: dict[int, int] = {}
        for i, (_, refs) in enumerate(enc):
            rank = _src_rank(self.srcs[i])
            for r in refs:
                if r < 0:
                    j = first.get(-1 - r)
                    if j is None or rank > _src_rank(self.srcs[j]):
                        first[-1 - r] = i
        self.first_use = first


def _src_rank(src) -> int:
    return 0 if src is None else 1 if len(src) > 2 else 2


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _closest(g: _Graph, history=_HISTORY):
    """The earlier graph most like ``g``: same op sequence (fewest differing nodes), else
    the longest common op prefix."""
    best, best_score = None, None
    for old in history:
        if old.names == g.names:
            same = sum(a == b for a, b in zip(old.key[0], g.key[0]))
            score = (1, same, 0)
        else:
            score = (0, _lcp(old.names, g.names), -abs(len(old.names) - len(g.names)))
        if best_score is None or score > best_score:
            best, best_score = old, score
    return best


def _overlap(a, b) -> int:
    """How many ops two sequences have in common, in any order."""
    return sum((collections.Counter(a) & collections.Counter(b)).values())


def _at(g: _Graph, i: int) -> str:
    src = g.srcs[i] if i < len(g.srcs) else None
    return f"{g.names[i]} ({fmt_src(src)})" if src else g.names[i]


def _arg_name(spec, j: int) -> str:
    names = getattr(spec, "arg_names", None)
    return names[j] if names is not None and j < len(names) else f"arg {j}"


def _static_positions(spec, sig) -> list[int]:
    """Positions of a node's arguments that are compile-time constants (not values)."""
    from xlatorch.runtime.ir import ops as d

    kinds = getattr(spec, "kinds", None)
    if kinds is None or len(kinds) != len(sig):
        return []
    return [j for j, k in enumerate(kinds) if k is d.STATIC]


def _diff_same_ops(new: _Graph, old: _Graph):
    """Differences between two graphs with the same op sequence: [(line, src)], most specific first."""
    out = []
    nk, ok = new.key, old.key
    # Inputs: shape, dtype, or kind (device data vs host number) changed.
    for i, (a, b) in enumerate(zip(ok[2], nk[2])):
        if a != b:
            use = new.first_use.get(i)
            by = f" (first read by {_at(new, use)})" if use is not None else ""
            what = "shape" if (type(a[0]) is tuple and type(b[0]) is tuple and a[1] == b[1]) else "type"
            out.append((f"input {i} changed {what}: {sig_text(a)} -> {sig_text(b)}{by}",
                        new.srcs[use] if use is not None else None))  # fmt: skip
    if len(ok[2]) != len(nk[2]):
        out.append((f"the graph reads {len(nk[2])} inputs (was {len(ok[2])})", None))
    # Constants: Python numbers and tuples passed as static arguments (sizes, dims).
    consts = []
    for i, (a, b) in enumerate(zip(ok[0], nk[0])):
        (spec, sa), (_, sb) = a[0][:2], b[0][:2]
        if a[0][2:] != b[0][2:]:  # a data-dependent op's output size, read from the device
            consts.append((f"data-dependent output of {_at(new, i)} changed: {aval_text(a[0][2])} -> "
                           f"{aval_text(b[0][2])} (each new size is a new graph)", new.srcs[i]))  # fmt: skip
        if sa == sb:
            continue
        for j in _static_positions(spec, sb):
            if sa[j] != sb[j]:
                consts.append((f"constant {_arg_name(spec, j)} of {_at(new, i)} changed: {sa[j]!r} -> {sb[j]!r}",
                               new.srcs[i]))  # fmt: skip
    out.extend(consts[:3])
    if len(consts) > 3:
        out.append((f"{len(consts)} constants changed in all", None))
    if not out:
        for i, (a, b) in enumerate(zip(ok[0], nk[0])):
            if a[0] != b[0]:
                out.append((f"node {i} {_at(new, i)} has different argument types: {a[0][1:]} -> {b[0][1:]}",
                            new.srcs[i]))  # fmt: skip
                break
            if a[1] != b[1]:
                out.append((f"node {i} {_at(new, i)} reads different operands (values are shared differently)",
                            new.srcs[i]))  # fmt: skip
                break
    return out


def _diff(new: _Graph, old: _Graph):
    """[(line, src)] naming how ``new`` differs from ``old``, most telling first."""
    out = []
    if new.names != old.names:
        i = _lcp(new.names, old.names)
        if i == len(new.names):
            out.append((f"op sequence stops after {i} nodes: the earlier graph went on with {_at(old, i)}", None))
        elif i == len(old.names):
            out.append((f"op sequence grows at node {i}: {_at(new, i)} is new", new.srcs[i]))
        else:
            out.append((f"op sequence diverges at node {i}: {_at(old, i)} -> {_at(new, i)}", new.srcs[i]))
    else:
        out.extend(_diff_same_ops(new, old))
    nk, ok = new.key, old.key
    if nk[1] != ok[1] and new.names == old.names:
        n, m = len(nk[1]), len(ok[1])
        what = f"{n} pending tensors (was {m})" if n != m else f"the {n} pending tensors are different values"
        out.append((f"outputs differ: {what}; a different set of tensors is alive at the cut", None))
    if nk[3] != ok[3]:
        out.append((f"buffer donation differs: inputs {list(nk[3])} donated (was {list(ok[3])}); a tensor "
                    f"holding an input was freed or kept alive", None))  # fmt: skip
    if nk[4] != ok[4]:
        out.append((f"device differs: xla:{nk[4]} (was xla:{ok[4]})", None))
    if nk[5:8] != ok[5:8]:
        out.append(("the updates a failed on-device check undoes differ (tensors updated in place, or ops traced "
                    "in another order relative to the checked ones)", None))  # fmt: skip
    if nk[8:] != ok[8:]:  # a torch_xla.compile region's custom_compile_options
        out.append((f"compiler options differ: {dict(nk[8]) if nk[8:] else {}} (was "
                    f"{dict(ok[8]) if ok[8:] else {}})", None))  # fmt: skip
    return out


def _memory(exe) -> dict | None:
    m = getattr(exe, "memory", None)  # computed once when the executable was made
    return None if m is None else m.as_dict()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def memory_text(mem: dict | None) -> str:
    """``arguments 1.2 MiB, outputs ..., temporaries ...`` for a record's ``memory``."""
    if not mem:
        return "buffer sizes unavailable"
    return (f"arguments {_mib(mem['argument'])}, outputs {_mib(mem['output'])} "
            f"({_mib(mem['alias'])} aliased to donated inputs), temporaries {_mib(mem['temp'])}, "
            f"generated code {_mib(mem['generated_code'])}")  # fmt: skip


@dataclasses.dataclass
class GraphMemory:
    """The device memory one compiled graph needs (``graph_memory()``), in bytes.

    Attributes:
      graph: the graph's number in this process (``CompileRecord.graph``).
      name: its ``torch_xla.compile`` region's name, or None.
      step: the number of ``mark_step`` calls before it was compiled.
      sync: what cut it; source: ``path:line`` behind its compile (``CompileRecord.source``).
      argument, output, alias, temp, generated_code: XLA's memory analysis (``alias``: the
        part of ``output`` that reuses donated inputs).
      new: what one run allocates: ``output - alias + temp``.
      peak: what one run holds at most: ``argument + new``.
    """

    graph: int
    name: str | None
    step: int
    sync: str
    source: str | None
    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    new: int
    peak: int

    def __str__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        at = f" at {self.source}" if self.source else ""
        return (f"graph {self.graph}{name} (step {self.step}, {self.sync}{at}): peak {_mib(self.peak)} = arguments "
                f"{_mib(self.argument)} + outputs {_mib(self.output - self.alias)} + temporaries {_mib(self.temp)}; "
                f"code {_mib(self.generated_code)}")  # fmt: skip


def graph_memory() -> list[GraphMemory]:
    """The memory each graph compiled so far needs (the newest 1000, oldest first), from XLA's
    memory analysis at compile time: nothing runs or syncs. Graphs compiled in eager mode are
    not listed (as in ``compile_reasons``)."""
    out = []
    for r in _RECORDS:
        m = r.memory
        if m:
            new = m["output"] - m["alias"] + m["temp"]
            out.append(GraphMemory(r.graph, r.name, r.step, r.sync, r.source, m["argument"], m["output"], m["alias"],
                                   m["temp"], m["generated_code"], new, m["argument"] + new))  # fmt: skip
    return out


def on_compile(request, exe, compile_ns: int) -> CompileRecord | None:
    """Record (and at level >= 1 log) why a graph was compiled (called on every compile with
    its ``runtime/lower/executable.CompileRequest``).

    Never raises: a fault in the debug tools must not fail the user's step.
    """
    try:
        r = request
        return _on_compile(r.key, r.nodes, r.leaves, r.root_refs, exe, compile_ns, r.cut)
    except Exception as e:  # pragma: no cover - a bug here is reported, not raised
        knob.LOG.warning(f"xlatorch.debug: could not explain a compile: {type(e).__name__}: {e}")
        return None


def _on_compile(key, nodes, leaves, root_refs, exe, compile_ns: int, cut=None) -> CompileRecord | None:
    if _last_sync[0] == "eager":  # eager mode's per-op compiles are not reported (as in torch_xla)
        return None
    g = _Graph(key, nodes)
    prev = _closest(g)
    if prev is None:
        lines = [("first compile of a graph in this process", None)]
    elif prev.key == key:
        lines = [("the same graph was compiled before: the executable cache was cleared", None)]
    else:
        lines = _diff(g, prev)
        if not lines:
            lines = [("no difference found from the closest earlier graph", None)]
        if prev.names != g.names and _overlap(prev.names, g.names) * 2 < max(len(g.names), len(prev.names)):
            # Not even half its ops in common with anything seen: a new graph (a new phase of
            # the program), not a variant of an old one.
            lines = [("first compile of this graph (it shares under half its ops with any graph compiled "
                      "before)", g.srcs[0] if g.srcs else None)]  # fmt: skip
    _HISTORY.append(g)
    src = next((s for _, s in lines if s is not None), None)
    sync, sync_src = _last_sync
    if src is not None:
        src = fmt_src(src, full=True)
    elif sync_src is not None:
        src = sync_src
    else:
        u = user_frame()
        src = fmt_src(u, full=True) if u else None
    region = regions.current()
    rec = CompileRecord(lines[0][0], [t for t, _ in lines[1:]], len(nodes), compile_ns / 1e6, src, sync, _step,
                        _memory(exe), region.name if region is not None else None,
                        getattr(exe, "gid", 0))  # fmt: skip
    _RECORDS.append(rec)
    lvl = knob.LEVEL
    if lvl >= 1:
        text = f"Compilation Analysis: {rec}"
        if rec.details:
            text += "".join(f"\n  also: {d}" for d in rec.details)
        if lvl >= 2:
            text += f"\n  memory: {memory_text(rec.memory)}"
        if lvl >= 3:
            text += "\n" + graph_text(nodes, leaves, root_refs, cut)
        knob.LOG.info(text)
    return rec


def compile_reasons() -> list[CompileRecord]:
    """Every compile recorded so far (the newest 1000), oldest first, with its reason."""
    return list(_RECORDS)


def on_sync(reason: str, graph_nodes: int) -> None:
    """Record a graph cut that runs ``graph_nodes`` nodes (called by every sync that executes)."""
    try:
        _on_sync(reason, graph_nodes)
    except Exception as e:  # pragma: no cover - a bug here is reported, not raised
        knob.LOG.warning(f"xlatorch.debug: could not record a graph cut: {type(e).__name__}: {e}")


def _on_sync(reason: str, graph_nodes: int) -> None:
    global _last_sync
    if reason == "mark_step" or reason == "eager":  # a step boundary; eager mode's op-by-op syncs
        _last_sync = (reason, None)
        return
    what = record.current_cause() or reason
    u = user_frame()
    src = fmt_src(u, full=True) if u else None
    _last_sync = (what, src)
    _RUN[(what, src)] += 1
    _STEP[(what, src)] += 1
    if knob.LEVEL >= 1:
        n = sum(_STEP.values())
        region = regions.current()
        graph = f" {region.name!r}" if region is not None and region.name else ""
        knob.LOG.info(f"Execution Analysis: {what} at {src or '?'} cut the graph{graph} ({graph_nodes} nodes; "
                      f"step {_step}, cut {n} besides mark_step); the host waits for the device")  # fmt: skip


def end_step() -> None:
    """At ``mark_step``: log the step's graph cuts (level >= 2) and start a new step."""
    global _step
    if _STEP and knob.LEVEL >= 2:
        knob.LOG.info(_table(f"Execution Analysis: graph cuts in step {_step} besides mark_step", _STEP))
    _STEP.clear()
    _step += 1


def sync_counts(step: bool = False) -> dict[tuple[str, str | None], int]:
    """``{(cause, "path:line"): count}`` of the graph cuts besides ``mark_step``, over the run
    or (``step=True``) since the last ``mark_step``."""
    return dict(_STEP if step else _RUN)


def _table(title: str, counts) -> str:
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][0]))
    w = max([len("cause")] + [len(c) for (c, _), _ in rows])
    lines = [title, f"  {'count':>7}  {'cause':<{w}}  source"]
    lines += [f"  {n:>7}  {c:<{w}}  {s or '?'}" for (c, s), n in rows]
    return "\n".join(lines)


def sync_report() -> str:
    """A table of the graph cuts besides ``mark_step`` (cause, source line, count): since the
    last ``mark_step``, then over the run. Each such cut makes the host wait for the device."""
    if not _RUN:
        return "No graph cuts besides mark_step."
    parts = []
    if _STEP:
        parts.append(_table(f"Graph cuts in the current step ({_step}) besides mark_step:", _STEP))
    parts.append(_table(f"Graph cuts over the run ({_step} steps) besides mark_step:", _RUN))
    return "\n".join(parts)


def summary() -> str:
    """The run so far in a few lines: compiles with their reasons, then the graph-cut table."""
    recs = list(_RECORDS)
    total = sum(r.compile_ms for r in recs) / 1e3
    lines = [f"{len(recs)} compile(s) ({total:.2f} s) and {sum(_RUN.values())} graph cut(s) besides mark_step "
             f"in {_step} step(s)"]  # fmt: skip
    lines += [f"  compile at step {r.step}: {r}" for r in recs]
    if _RUN:
        lines.append(_table("  graph cuts besides mark_step:", _RUN))
    return "\n".join(lines)


def _at_exit() -> None:
    if knob.LEVEL >= 1 and (_RECORDS or _RUN):
        knob.LOG.info("Run summary: " + summary())


atexit.register(_at_exit)


def clear() -> None:
    """Forget the recorded compiles, graph cuts and compared graphs."""
    global _step
    _HISTORY.clear()
    _RECORDS.clear()
    _RUN.clear()
    _STEP.clear()
    _step = 0


class _GraphDiff:
    """How a graph differs from others, for the runtime's errors (``record.GRAPH_DIFF``)."""

    @staticmethod
    def summary(key, nodes) -> _Graph:
        """What the comparison needs of a graph (its key, op names, source lines; no tensors)."""
        return _Graph(key, nodes)

    @staticmethod
    def difference(new: _Graph, olds) -> list[str]:
        """Lines naming how ``new`` differs from the closest of ``olds`` (summaries)."""
        prev = _closest(new, [g for g in olds if g is not None])
        if prev is None:
            return []
        return [text for text, _ in _diff(new, prev)]


# The runtime calls these at every compile, sync and mark_step (xlatorch.runtime.base.record).
record.GRAPH_DIFF.append(_GraphDiff)
record.COMPILE_HOOKS.append(on_compile)
record.SYNC_HOOKS.append(on_sync)
record.STEP_HOOKS.append(end_step)
