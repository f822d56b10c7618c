"""Graph dumps: the IR that would compute some tensors, its StableHLO/HLO, and a dot graph.

None of these syncs or changes the tensors: the pending graph is walked (and, for
``hlo_text``, lowered by the same path a sync compiles with) but not executed, so the
next ``mark_step`` compiles and runs exactly what it would have without the dump.
Nodes carry ``# file.py:12`` annotations when they recorded the user's source line
(debug level >= 1 or ``XLA_IR_DEBUG=1`` when they were created).
"""

from __future__ import annotations

from xlatorch.debug import knob
from xlatorch.runtime.base import topology
from xlatorch.runtime.base.source import fmt_src
from xlatorch.runtime.execute.lowered import graph_of, lower

__all__ = ["ir_text", "hlo_text", "dot_text", "graph_text", "aval_text", "dtype_name", "op_name"]

_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "pred", "complex64": "c64", "complex128": "c128",
}  # fmt: skip


def dtype_name(dt) -> str:
    """``f32`` for ``torch.float32`` (HLO-style short names)."""
    s = str(dt).replace("torch.", "")
    return _SHORT.get(s, s)


def aval_text(aval) -> str:
    """``f32[64,784]`` for an aval ``((64, 784), torch.float32)``."""
    if aval is None:
        return "undefined"
    shape, dt = aval
    return f"{dtype_name(dt)}[{','.join(str(d) for d in shape)}]"


def op_name(spec) -> str:
    """``aten::mm`` (default overload) or ``aten::add.Tensor``."""
    name = getattr(spec, "name", None) or str(spec)
    name = name[: -len(".default")] if name.endswith(".default") else name
    return name if "::" in name else "aten::" + name  # xlatorch's own ops are named xla::<op>


def _ref_namer(nodes, leaves, cut=None):
    """Names of values: ``%3`` (node 3), ``%3.1`` (its output 1), ``%i0`` (leaf 0). ``cut``: the
    outputs of earlier stages that this graph reads as device data (``runtime/plan/stages.py``)."""
    from xlatorch.runtime.ir.values import Out

    order = {id(n): i for i, n in enumerate(nodes)}
    lpos = {id(v): i for i, v in enumerate(leaves)}

    def name(v) -> str:
        if cut and id(v) in cut:
            v = cut[id(v)]
        if type(v) is Out:
            i = order[id(v.node)]
            return f"%{i}" if len(v.node.outs) == 1 else f"%{i}.{v.idx}"
        return f"%i{lpos[id(v)]}"

    return name


def _root_name(r: int, nodes) -> str:
    if r < 0:
        return f"%i{-1 - r}"
    i, j = divmod(r, 4096)
    return f"%{i}" if len(nodes[i].outs) == 1 else f"%{i}.{j}"


def _leaf_text(v) -> str:
    from xlatorch.runtime.ir.values import Data

    if type(v) is Data:
        return f"device_data : {aval_text(v.aval)}" + _sharding_text(v)
    kind = "cpu_tensor" if v.tensor else "scalar"
    return f"{kind}({v.value!r}) : {dtype_name(v.aval[1])}[]"


def _sharding_text(v) -> str:
    """`` {sharding={devices=[4,2]0,1,...}}`` for device data under SPMD (how the graph input is split)."""
    from xlatorch.runtime.multi import sharding

    if not topology.SPMD[0]:
        return ""
    return " {sharding=" + sharding.hlo_sharding_text(v.array.sharding, len(v.aval[0])) + "}"


def _args_text(n, name) -> str:
    from xlatorch.runtime.ir.values import VALUE_TYPES

    names = getattr(n.spec, "arg_names", ())
    parts = []
    for j, a in enumerate(n.args):
        if isinstance(a, VALUE_TYPES):
            parts.append(name(a))
        elif type(a) is tuple and a and all(isinstance(x, VALUE_TYPES) or x is None for x in a):
            parts.append("[" + ", ".join("None" if x is None else name(x) for x in a) + "]")
        elif a is None:
            continue
        else:
            label = names[j] if j < len(names) else f"arg{j}"
            parts.append(f"{label}={a!r}")
    return ", ".join(parts)


def _out_text(n) -> str:
    avals = n.info.avals
    if len(avals) == 1:
        return aval_text(avals[0])
    return "(" + ", ".join(aval_text(a) for a in avals) + ")"


def graph_text(nodes, leaves, root_refs, cut=None) -> str:
    """The IR text of a collected graph (see ``ir_text``)."""
    name = _ref_namer(nodes, leaves, cut)
    lines = ["IR {"]
    lines += [f"  %i{i} = {_leaf_text(v)}" for i, v in enumerate(leaves)]
    for i, n in enumerate(nodes):
        line = f"  %{i} = {op_name(n.spec)}({_args_text(n, name)}) : {_out_text(n)}"
        src = getattr(n, "src", None)
        if src is not None:
            line += f"  # {fmt_src(src)}"
        lines.append(line)
    lines.append("  ROOT (" + ", ".join(_root_name(r, nodes) for r in root_refs) + ")")
    lines.append("}")
    return "\n".join(lines)


def ir_text(tensors) -> str:
    """The IR of the graph that would compute ``tensors``, one line per node
    (``%5 = aten::mm(%3, %4) : f32[64,10]  # train.py:12``); inputs are ``%iN``.

    Does not sync: pending tensors stay pending (``torch_xla._XLAC._get_xla_tensors_text``).

    Args:
      tensors: a tensor or a list of tensors on the xla device.
    """
    return graph_text(*graph_of(tensors, "xlatorch.debug"))


def hlo_text(tensors, dialect: str = "stablehlo", debug_info: bool | None = None) -> str:
    """The lowered computation of ``tensors``' graph, as a sync would compile it (before XLA's
    optimisations). Does not sync or compile (``torch_xla._XLAC._get_xla_tensors_hlo``).

    Args:
      tensors: a tensor or a list of tensors on the xla device.
      dialect: ``"stablehlo"`` (MLIR text) or ``"hlo"`` (XLA HLO text).
      debug_info: include op metadata / locations (default: when ``XLA_HLO_DEBUG`` is set,
        whose ``aten::<op>(file.py:12)`` names then appear in every ``op_name``).
    """
    lowered = lower(tensors, "xlatorch.debug.hlo_text")[0]
    return lowered.as_text(dialect=dialect, debug_info=knob.hlo_debug() if debug_info is None else debug_info)


def _q(s: str) -> str:
    r"""A dot string literal (newlines become dot's ``\n`` line breaks)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_text(tensors) -> str:
    """The graph computing ``tensors`` in graphviz dot: one box per IR node (op, output type,
    source line), one ellipse per input, outputs drawn with a double border. Does not sync."""
    from xlatorch.runtime.ir.values import operands

    nodes, leaves, root_refs = graph_of(tensors, "xlatorch.debug")
    name = _ref_namer(nodes, leaves)
    roots = {_root_name(r, nodes).split(".")[0] for r in root_refs}
    lines = ["digraph xla_graph {", '  node [shape=box, fontname="monospace", fontsize=10];']
    for i, v in enumerate(leaves):
        extra = ", peripheries=2" if f"%i{i}" in roots else ""
        lines.append(f"  i{i} [label={_q(f'%i{i} ' + _leaf_text(v))}, shape=ellipse{extra}];")
    for i, n in enumerate(nodes):
        label = f"%{i} {op_name(n.spec)}\n{_out_text(n)}"
        src = getattr(n, "src", None)
        if src is not None:
            label += f"\n{fmt_src(src)}"
        extra = ", peripheries=2" if f"%{i}" in roots else ""
        lines.append(f"  n{i} [label={_q(label)}{extra}];")
        for v in operands(n.args):
            src_id = name(v).lstrip("%").split(".")[0]
            lines.append(f"  {src_id if src_id.startswith('i') else 'n' + src_id} -> n{i};")
    lines.append("}")
    return "\n".join(lines)
