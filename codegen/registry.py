"""Reading and validating ops.yaml: every entry names a real overload and real arguments."""

from __future__ import annotations

import ast
import builtins
import string
from dataclasses import dataclass, field

import yaml

from codegen.schema import Schema

KEYS = {
    "lower", "helper", "decompose", "fallback", "promote", "promote_args", "static", "random", "scatter",
    "variants", "dispatch", "test", "note", "check", "check_if", "index_dtype", "host_scalars", "copies",
    "distinct_out", "validate", "refuse_dtypes", "validate_out", "lower_inplace",
    "keeps_scalar",
}  # fmt: skip
# How an entry is executed: exactly one of these fields, except for dispatch runtime/metadata.
RULES = ("lower", "helper", "decompose", "fallback")
DISPATCH = {"shim", "runtime", "metadata"}
TEST_KEYS = {"opinfo", "atol", "rtol", "grad_atol", "grad_rtol", "dtypes", "xfail", "compare"}
TEST_TAGS = {"float32", "bfloat16", "int64", "bool", "grad", "inplace", "out", "errors", "unsupported", "all"}
CHECK_IF = {"integral"}
INDEX_DTYPE_KEYS = {"arg", "dtypes", "error"}  # and optionally "empty_ok"
# The exceptions an index_dtype error may raise, and the dtype names its message may use.
INDEX_DTYPE_ERRORS = {"IndexError", "RuntimeError", "NotImplementedError"}
INDEX_DTYPE_NAMES = {"scalar_type", "tensor_type"}
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
    # Promoting arguments CPU's kernel reads at their own precision when they are 0-d tensors
    # (``mul`` / ``div``'s second operand); any other 0-d tensor operand of another dtype is
    # first rounded to the common dtype, as TensorIterator casts it
    keeps_scalar: list = field(default_factory=list)
    static: list = field(default_factory=list)
    host_scalars: list = field(default_factory=list)  # CPU tensors of scalars, read on the host
    random: bool = False
    scatter: str | None = None
    # The lowering of the generated in-place variant where CPU's in-place kernel computes
    # otherwise (``_foreach_mul_`` takes its number in the tensors' dtype, ``_foreach_mul`` not)
    lower_inplace: str | None = None
    variants: bool = True
    # "shim": generated dispatch; "runtime": a hand-written handler in xlatorch/runtime
    # (copies, transfers, data-dependent shapes); "metadata": answered by the tensor's
    # sizes/strides, never dispatched.
    dispatch: str = "shim"
    decompose: bool = False  # run PyTorch's decomposition (torch._decomp) into lowered ops
    fallback: str | None = None  # a declared CPU fallback, with the reason
    test: dict = field(default_factory=dict)  # OpInfo hints: opinfo names, tolerances, xfails
    # A check CPU PyTorch makes on the data (index bounds, division by zero): an expression
    # giving L.checks results, computed inside the compiled graph (xlatorch/runtime/lower/checks.py).
    check: str | None = None
    check_if: str | None = None  # "integral": only when the computation dtype is integral
    # The dtypes CPU PyTorch accepts for an index argument, and the error it raises otherwise,
    # checked when the op is traced (once per signature): a list of {arg, dtypes, error}.
    index_dtype: list = field(default_factory=list)
    # CPU's checks decided from shapes and dtypes alone that PyTorch's meta kernel skips: an
    # expression over the arguments as meta tensors calling runtime/trace/validate.py (V), run
    # when the op is traced (once per signature), so CPU's error is raised at the call.
    validate: str | None = None
    # CPU's rules for an out= tensor's dtype that the out= overload's meta kernel skips: an
    # expression over ``outs`` and ``results`` (their dtypes) and the arguments, calling V.
    validate_out: str | None = None
    # The computation dtypes CPU's kernel has no implementation for, and its error ("abs_cpu" not
    # implemented for 'Bool'): a list of {dtypes, error}, checked when the op is traced.
    refuse_dtypes: list = field(default_factory=list)
    # Its result holds exactly its first argument's elements when the dtype stays (a copy or a
    # reshape, not a view): the host, holding that argument, holds the result too
    # (runtime/plan/prechecks.py decides a step's checks from it).
    copies: bool = False
    # Its out= tensor may not share memory with an input at all, as CPU's kernel refuses (cat,
    # gather); an elementwise op's may be an input itself (runtime/trace/outs.call_out)
    distinct_out: bool = False

    @property
    def status(self) -> str:
        """``lowered``, ``decomposed`` or ``fallback``: what the coverage report shows."""
        if self.decompose:
            return "decomposed"
        return "fallback" if self.fallback is not None else "lowered"


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


def _check_rule(name: str, e: Entry) -> None:
    if e.dispatch not in DISPATCH:
        raise RegistryError(f"ops.yaml entry '{name}': dispatch must be one of {sorted(DISPATCH)}")
    rules = [r for r in RULES if getattr(e, r) not in (None, False)]
    if e.dispatch == "shim" and len(rules) != 1 or len(rules) > 1:
        raise RegistryError(
            f"ops.yaml entry '{name}': give exactly one of 'lower' (an expression), 'helper', "
            f"'decompose: true' or 'fallback: <reason>' (got {rules or 'none'})"
        )
    if e.decompose:
        from torch._decomp import decomposition_table

        from codegen.gen import overload

        if e.decompose is not True or overload(e.name) not in decomposition_table:
            raise RegistryError(f"ops.yaml entry '{name}': 'decompose: true' needs a PyTorch decomposition, "
                                f"and torch._decomp has none for aten::{e.name}")  # fmt: skip
    # An in-place op writing several arguments (``_amp_update_scale_``) may return anything:
    # its lowering returns the new value of each written argument, in schema order.
    several = e.schema.inplace and len(e.schema.mutated) > 1
    if (e.lower or e.helper) and e.schema.returns not in ("ONE", "TUPLE", "LIST") and not several:
        raise RegistryError(f"ops.yaml entry '{name}': returns {e.schema.returns}, which a lowering cannot produce")


def _check_test(name: str, t: dict) -> None:
    unknown = set(t) - TEST_KEYS
    if unknown:
        raise RegistryError(f"ops.yaml entry '{name}': unknown test field(s) {sorted(unknown)}")
    for key, reason in (t.get("xfail") or {}).items():
        tag = key.rpartition("/")[2]  # "<tag>", or "<OpInfo name>/<tag>" for one of the entry's OpInfos
        if tag not in TEST_TAGS:
            raise RegistryError(f"ops.yaml entry '{name}': xfail key '{key}' is not one of {sorted(TEST_TAGS)} "
                                f"(optionally after '<OpInfo name>/')")  # fmt: skip
        if not isinstance(reason, str) or not reason.strip():
            raise RegistryError(f"ops.yaml entry '{name}': xfail '{key}' needs a reason")
    if t.get("compare", "values") not in ("values", "meta"):
        raise RegistryError(f"ops.yaml entry '{name}': test compare must be 'values' or 'meta'")
    if isinstance(t.get("opinfo"), str):
        t["opinfo"] = [t["opinfo"]]


def _check_dtype_rule(where: str, r: dict) -> None:
    """A rule's ``dtypes`` (torch dtype names) and ``error`` ("<exception>: <message>", the
    message naming the dtype as ``{scalar_type}`` / ``{tensor_type}`` only)."""
    import torch

    for d in r["dtypes"]:
        if not isinstance(getattr(torch, str(d), None), torch.dtype):
            raise RegistryError(f"{where}: '{d}' is not a torch dtype")
    exc, _, msg = str(r["error"]).partition(": ")
    if exc not in INDEX_DTYPE_ERRORS or not msg:
        raise RegistryError(f"{where}: error is '<exception>: <message>', the exception one of "
                            f"{sorted(INDEX_DTYPE_ERRORS)}")  # fmt: skip
    fields = {f for _, f, _, _ in string.Formatter().parse(msg) if f is not None}
    if fields - INDEX_DTYPE_NAMES:
        raise RegistryError(f"{where}: the message may name the dtype as {sorted(INDEX_DTYPE_NAMES)}, "
                            f"not {sorted(fields - INDEX_DTYPE_NAMES)}")  # fmt: skip


def _check_index_dtype(name: str, e: Entry) -> None:
    rules = e.index_dtype if isinstance(e.index_dtype, list) else [e.index_dtype]
    tensors = {a.py for a in e.schema.args if not a.is_out and a.type in ("Tensor", "Tensor?", "Tensor?[]", "Tensor[]")}
    for r in rules:
        where = f"ops.yaml entry '{name}': index_dtype"
        if not isinstance(r, dict) or not INDEX_DTYPE_KEYS <= set(r) <= INDEX_DTYPE_KEYS | {"empty_ok"}:
            raise RegistryError(f"{where} is a mapping (or a list of them) with keys {sorted(INDEX_DTYPE_KEYS)} "
                                f"and optionally empty_ok")  # fmt: skip
        for a in [r["arg"]] if isinstance(r["arg"], str) else r["arg"]:
            if a not in tensors:
                raise RegistryError(f"{where} names '{a}', not a tensor argument (those are {sorted(tensors)})")
        _check_dtype_rule(where, r)
    e.index_dtype = rules


def _check_refuse_dtypes(name: str, e: Entry) -> None:
    rules = e.refuse_dtypes if isinstance(e.refuse_dtypes, list) else [e.refuse_dtypes]
    where = f"ops.yaml entry '{name}': refuse_dtypes"
    for r in rules:
        if not isinstance(r, dict) or not {"dtypes", "error"} <= set(r) <= {"dtypes", "error", "scalar_ok", "empty_ok"}:
            raise RegistryError(f"{where} is a mapping (or a list of them) with keys dtypes and error (optionally "
                                f"scalar_ok, empty_ok)")  # fmt: skip
        if any(not isinstance(r.get(k, False), bool) for k in ("scalar_ok", "empty_ok")):
            raise RegistryError(f"{where}: scalar_ok and empty_ok are true or false")
        _check_dtype_rule(where, r)
    e.refuse_dtypes = rules


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
        _check_rule(name, e)
        _check_test(name, e.test)
        argnames = {a.py for a in s.args if not a.is_out}
        for field_name in ("promote_args", "static", "host_scalars", "keeps_scalar"):
            for a in getattr(e, field_name):
                if a not in argnames:
                    raise RegistryError(f"ops.yaml entry '{name}': {field_name} names unknown argument '{a}'")
        if e.promote is not None and e.promote not in PROMOTIONS:
            raise RegistryError(f"ops.yaml entry '{name}': promote must be one of {sorted(PROMOTIONS)}")
        extra = {"seed"} if e.random else set()
        if e.lower is not None:
            _check_expr(f"ops.yaml entry '{name}'", e.lower, argnames | GLOBALS | extra)
        if e.check is not None:
            _check_expr(f"ops.yaml entry '{name}' (check)", e.check, argnames | GLOBALS | extra)
        if e.validate is not None:
            _check_expr(f"ops.yaml entry '{name}' (validate)", e.validate, argnames | {"V", "torch"} | extra)
            read = {n.id for n in ast.walk(ast.parse(e.validate, mode="eval")) if isinstance(n, ast.Name)}
            traced = {a.py for a in s.args if a.kind == "SCALAR" and a.py not in e.static} & read
            if traced:  # it runs once per signature, which holds no traced number's value
                raise RegistryError(f"ops.yaml entry '{name}': validate reads the traced number(s) {sorted(traced)}; "
                                    f"list them in static or check them on the device (check:)")  # fmt: skip
        if e.validate_out is not None:
            _check_expr(f"ops.yaml entry '{name}' (validate_out)", e.validate_out,
                        argnames | {"V", "torch", "outs", "results"})  # fmt: skip
        if e.check_if is not None and (e.check is None or e.check_if not in CHECK_IF):
            raise RegistryError(f"ops.yaml entry '{name}': check_if needs a check and is one of {sorted(CHECK_IF)}")
        if e.index_dtype:
            _check_index_dtype(name, e)
        if e.refuse_dtypes:
            _check_refuse_dtypes(name, e)
        if not isinstance(e.copies, bool) or (e.copies and (s.view or not s.args or s.args[0].kind != "TENSOR")):
            raise RegistryError(f"ops.yaml entry '{name}': copies is true or false, and only for a non-view op "
                                f"whose first argument is a tensor")  # fmt: skip
        if not isinstance(e.distinct_out, bool):
            raise RegistryError(f"ops.yaml entry '{name}': distinct_out is true or false")
        if e.lower_inplace is not None:
            if e.lower is None or not e.variants:
                raise RegistryError(f"ops.yaml entry '{name}': lower_inplace needs a lower and the variants")
            _check_expr(f"ops.yaml entry '{name}' (lower_inplace)", e.lower_inplace, argnames | GLOBALS | extra)
        if e.scatter is not None:
            if not s.view:
                raise RegistryError(f"ops.yaml entry '{name}': 'scatter' is only for view ops")
            _check_expr(f"ops.yaml entry '{name}' (scatter)", e.scatter, argnames | GLOBALS | {"src", "idx"})
        entries.append(e)
    return entries
