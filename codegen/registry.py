"""Reading and validating ops.yaml: every entry names a real overload and real arguments."""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field

import yaml

from codegen.schema import Schema

KEYS = {"lower", "helper", "promote", "promote_args", "static", "random", "scatter", "variants", "dispatch", "note"}
PROMOTIONS = {"default", "int_to_float", "always_bool", "complex_to_float", "bool_to_long", "no_opmath"}
# Names a lowering expression may use besides its schema's argument names.
GLOBALS = {"jnp", "lax", "jax", "np", "math", "L", "out", "torch_dtype"}


class RegistryError(ValueError):
    pass


@dataclass
class Entry:
    name: str
    schema: Schema
    lower: str | None = None
    helper: str | None = None
    promote: str | None = None
    promote_args: list = field(default_factory=list)
    static: list = field(default_factory=list)
    random: bool = False
    scatter: str | None = None
    variants: bool = True
    dispatch: str = "shim"  # "shim" or "runtime" (the runtime routes calls itself)


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for k, _ in node.value:
        key = loader.construct_object(k, deep=deep)
        if key in seen:
            raise RegistryError(f"ops.yaml: entry '{key}' appears twice (line {k.start_mark.line + 1})")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _check_expr(where: str, expr: str, allowed: set) -> None:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise RegistryError(f"{where}: not a Python expression: {expr!r} ({e.msg})") from None
    bound = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    bound |= {t.id for c in ast.walk(tree) if isinstance(c, ast.comprehension) for t in ast.walk(c.target)
              if isinstance(t, ast.Name)}  # fmt: skip
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id not in allowed and n.id not in bound and not hasattr(builtins, n.id):
            args = sorted(allowed - GLOBALS)
            raise RegistryError(f"{where}: unknown name '{n.id}' (the schema's arguments are {args})")


def load(path: str, schemas: dict) -> list[Entry]:
    """Parse ops.yaml; raise ``RegistryError`` naming the entry for any mistake."""
    with open(path) as f:
        raw = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    entries = []
    for name, body in raw.items():
        key = name if "." in name else name + ".default"
        if key not in schemas:
            raise RegistryError(
                f"ops.yaml entry '{name}': no ATen overload of that name in torch's native_functions.yaml"
            )
        s = schemas[key]
        if isinstance(body, str):
            body = {"lower": body}
        unknown = set(body) - KEYS
        if unknown:
            raise RegistryError(f"ops.yaml entry '{name}': unknown field(s) {sorted(unknown)}")
        e = Entry(name=key, schema=s, **{k: v for k, v in body.items() if k != "note"})
        if (e.lower is None) == (e.helper is None):
            raise RegistryError(f"ops.yaml entry '{name}': give exactly one of 'lower' (an expression) or 'helper'")
        if s.returns not in ("ONE", "TUPLE", "LIST"):
            raise RegistryError(f"ops.yaml entry '{name}': returns {s.returns}, which a lowering cannot produce")
        argnames = {a.py for a in s.args if not a.is_out}
        for field_name in ("promote_args", "static"):
            for a in getattr(e, field_name):
                if a not in argnames:
                    raise RegistryError(f"ops.yaml entry '{name}': {field_name} names unknown argument '{a}'")
        if e.promote is not None and e.promote not in PROMOTIONS:
            raise RegistryError(f"ops.yaml entry '{name}': promote must be one of {sorted(PROMOTIONS)}")
        extra = {"seed"} if e.random else set()
        if e.lower is not None:
            _check_expr(f"ops.yaml entry '{name}'", e.lower, argnames | GLOBALS | extra)
        if e.scatter is not None:
            if not s.view:
                raise RegistryError(f"ops.yaml entry '{name}': 'scatter' is only for view ops")
            _check_expr(f"ops.yaml entry '{name}' (scatter)", e.scatter, argnames | GLOBALS | {"src", "idx"})
        entries.append(e)
    return entries
