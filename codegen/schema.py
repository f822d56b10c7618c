"""ATen schemas from the ``native_functions.yaml`` shipped in the torch wheel, via torchgen."""

from __future__ import annotations

import ast
import keyword
import os
from dataclasses import dataclass
from functools import lru_cache

import torchgen
from torchgen.gen import get_grouped_native_functions, parse_native_yaml
from torchgen.model import NativeFunctionsGroup

# Argument kinds; the names match xlatorch.runtime.trace.dispatch.
TRACED_SCALAR_TYPES = {"Scalar", "Scalar?", "float", "float?"}


@dataclass(frozen=True)
class Arg:
    name: str  # the ATen name
    py: str  # the Python parameter name (keywords get a trailing underscore)
    type: str
    kind: str
    kwarg_only: bool
    default: str | None  # Python source of the default, or None
    is_out: bool


@dataclass(frozen=True)
class Schema:
    name: str  # "add.Tensor"
    op: str  # "add"
    overload: str  # "Tensor" or "default"
    args: tuple[Arg, ...]
    returns: str  # ONE / TUPLE / LIST / NONE
    n_returns: int
    view: bool
    inplace: bool
    tags: frozenset
    factory: bool
    mutated: tuple[str, ...] = ()  # the arguments written in place (``Tensor(a!)``), outs excluded


def _kind(t: str) -> str:
    if t == "Tensor":
        return "TENSOR"
    if t == "Tensor?":
        return "OPT_TENSOR"
    if t in ("Tensor[]", "Tensor?[]"):
        return "TENSOR_LIST"
    if t in TRACED_SCALAR_TYPES:
        return "SCALAR"
    if t == "Scalar[]":
        return "SCALAR_LIST"
    return "STATIC"


_SPECIAL_DEFAULTS = {
    "contiguous_format": "torch.contiguous_format",
    "long": "torch.long",
    "Mean": "1",
    "Sum": "2",
    "None": "None",
    "True": "True",
    "False": "False",
}


def _default(d: str | None, t: str = "") -> str | None:
    if d is None:
        return None
    if "[" in t and d.lstrip("-").isdigit():  # int[2] padding=0 means (0, 0)
        n = t[t.index("[") + 1 : t.index("]")]
        return repr((int(d),) * (int(n) if n else 1))
    if d in _SPECIAL_DEFAULTS:
        return _SPECIAL_DEFAULTS[d]
    try:
        v = ast.literal_eval(d)
    except (ValueError, SyntaxError):
        return repr(d.strip('"'))
    return repr(tuple(v) if isinstance(v, list) else v)


def _schema(f) -> Schema:
    fn = f.func
    args = []
    outs = {a.name for a in fn.arguments.out}
    for a, ko in (
        [(a, False) for a in fn.arguments.flat_positional]
        + [(a, True) for a in fn.arguments.flat_kwarg_only]
        + [(a, True) for a in fn.arguments.out]
    ):
        t = str(a.type)
        py = a.name + "_" if keyword.iskeyword(a.name) else a.name
        args.append(Arg(a.name, py, t, _kind(t), ko, _default(a.default, t), a.name in outs))
    rets = fn.returns
    if len(rets) == 0:
        ret = "NONE"
    elif len(rets) == 1:
        ret = "LIST" if str(rets[0].type) == "Tensor[]" else ("ONE" if str(rets[0].type) == "Tensor" else "OTHER")
    else:
        ret = "TUPLE" if all(str(r.type) == "Tensor" for r in rets) else "OTHER"
    view = any(r.annotation is not None and not r.annotation.is_write for r in rets)
    name = str(fn.name)
    base = name.split(".")[0]
    inplace = fn.name.name.inplace
    has_tensor = any(a.kind != "STATIC" and a.type.startswith("Tensor") for a in args if not a.is_out)
    factory = not has_tensor and any(a.name == "device" for a in args) and not fn.arguments.out
    mutated = tuple(a.name for a in fn.arguments.flat_non_out if a.annotation is not None and a.annotation.is_write)
    return Schema(
        name=name if "." in name else name + ".default",
        op=base,
        overload=name.split(".")[1] if "." in name else "default",
        args=tuple(args),
        returns=ret,
        n_returns=len(rets),
        view=view,
        inplace=inplace,
        tags=frozenset(f.tags),
        factory=factory,
        mutated=mutated,
    )


@lru_cache(maxsize=1)
def load():
    """``(schemas by "op.overload", groups: functional name -> (inplace name, out name))``."""
    root = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native")
    parsed = parse_native_yaml(os.path.join(root, "native_functions.yaml"), os.path.join(root, "tags.yaml"))
    schemas = {}
    for f in parsed.native_functions:
        s = _schema(f)
        schemas[s.name] = s
    groups = {}
    for g in get_grouped_native_functions(parsed.native_functions):
        if isinstance(g, NativeFunctionsGroup):
            fname = _schema(g.functional).name
            inplace = _schema(g.inplace).name if g.inplace is not None else None
            groups[fname] = (inplace, _schema(g.out).name)
    return schemas, groups
