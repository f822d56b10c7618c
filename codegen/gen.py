"""Render generated/ from ops.yaml and the ATen schemas."""

from __future__ import annotations

import ast
import keyword
import os

import jinja2

from codegen import registry, schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(ROOT, "codegen", "templates")


def _check_unique(shims) -> None:
    seen = {}
    for sh in shims:
        if sh["aten"] in seen:
            raise registry.RegistryError(
                f"ops.yaml: {sh['aten']} would get two shims ({seen[sh['aten']]} and {sh['fn']}): an entry duplicates "
                f"a generated in-place/out= variant; drop the entry or give its group 'variants: false'"
            )
        seen[sh["aten"]] = sh["fn"]


def _ident(name: str) -> str:
    op, ov = name.split(".")
    return op if ov == "default" else f"{op}_{ov}"


def _aten(name: str) -> str:
    op, ov = name.split(".")
    return f'getattr(aten.{op}, "{ov}")' if keyword.iskeyword(ov) else f"aten.{op}.{ov}"


def overload(name: str):
    """The ``torch.ops.aten`` OpOverload of an ``"op.overload"`` name."""
    import torch

    op, ov = name.split(".")
    return getattr(getattr(torch.ops.aten, op), ov)


def _params(args, extra_default: bool = False) -> str:
    """A Python parameter list mirroring the schema (keyword-only after ``*``)."""
    pos = [a for a in args if not a.kwarg_only]
    kw = [a for a in args if a.kwarg_only]

    def p(a):
        return a.py if a.default is None else f"{a.py}={a.default}"

    parts = [p(a) for a in pos]
    if kw:
        parts += ["*"] + [p(a) for a in kw]
    return ", ".join(parts)


def _tuple(items) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _index_dtype(e: registry.Entry, args) -> str:
    """Python source of the spec's ``index_dtype`` rules: ``((positions, dtypes, exception, message,
    empty_ok), ...)``."""
    if not e.index_dtype:
        return "None"
    names = [a.py for a in args]
    rules = []
    for r in e.index_dtype:
        pos = tuple(names.index(a) for a in ([r["arg"]] if isinstance(r["arg"], str) else r["arg"]))
        exc, _, msg = r["error"].partition(": ")
        dtypes = _tuple([f"torch.{d}" for d in r["dtypes"]])
        rules.append(_tuple([repr(pos), dtypes, exc, repr(msg), repr(bool(r.get("empty_ok")))]))
    return _tuple(rules)


def _refuse_dtypes(e: registry.Entry) -> str:
    """Python source of the spec's ``refuse_dtypes`` rules: ``((dtypes, exception, message,
    scalar_ok, empty_ok), ...)``."""
    if not e.refuse_dtypes:
        return "None"
    rules = []
    for r in e.refuse_dtypes:
        exc, _, msg = r["error"].partition(": ")
        dtypes = _tuple([f"torch.{d}" for d in r["dtypes"]])
        flags = [repr(bool(r.get("scalar_ok"))), repr(bool(r.get("empty_ok")))]
        rules.append(_tuple([dtypes, exc, repr(msg), *flags]))
    return _tuple(rules)


def _reads(expr: str, params: list) -> str:
    """``OpSpec.check_reads`` for a check expression: ``(expr, positions of the arguments it
    reads, whether it reads the outputs)``: two ops whose checks are the same expression over the
    same values decide the same (an op and its backward on one index tensor)."""
    names = {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
    return repr((expr, tuple(i for i, p in enumerate(params) if p in names), "out" in names))


def _kinds(e: registry.Entry, args) -> list[str]:
    return ["STATIC" if a.py in e.static else "HOST_SCALARS" if a.py in e.host_scalars else a.kind for a in args]


class _Spec:
    """What the templates need for one OpSpec (functional, in-place or scatter)."""

    def __init__(self, **kw):
        self.mutates = ()
        self.copies = False
        self.distinct_out = False
        self.out_overload = None
        self.validate = self.refuse_dtypes = self.validate_out = "None"
        self.keeps_scalar = "()"
        self.__dict__.update(kw)


def build(entries):
    schemas, groups = schema.load()
    lowerings, specs, shims, factories, decomposed, fallbacks, runtime = [], [], [], [], [], [], []
    validators, decomposed_validated = [], []
    for e in entries:
        s = e.schema
        if e.dispatch == "runtime":
            runtime.append(_aten(e.name))
        if e.decompose:
            decomposed.append(_aten(e.name))
            if e.validate is not None or e.refuse_dtypes:
                fn = "None"
                if e.validate is not None:
                    fn = f"_validate_{_ident(e.name)}"
                    validators.append(dict(fn=fn, params=_params([a for a in s.args if not a.is_out]), body=e.validate))
                decomposed_validated.append((_aten(e.name), fn, _refuse_dtypes(e)))
            continue
        if e.fallback is not None:
            fallbacks.append((_aten(e.name), e.fallback))
            continue
        if e.lower is None and e.helper is None:  # a runtime handler, or metadata only
            continue
        fargs = [a for a in s.args if not a.is_out]
        fn = _ident(e.name)
        names = [a.name for a in fargs] + (["seed"] if e.random else [])
        kinds = _kinds(e, fargs) + (["GENERATOR"] if e.random else [])
        pys = [a.py for a in fargs] + (["seed"] if e.random else [])
        body = e.lower if e.lower is not None else f"L.{e.helper}(out, {', '.join(pys)})"
        lowerings.append(dict(fn=fn, params=", ".join(["out"] + pys), body=body))
        check = check_reads = "None"
        if e.check is not None:
            lowerings.append(dict(fn=fn + "__check", params=", ".join(["out"] + pys), body=e.check))
            check = f"E.{fn}__check"
            check_reads = _reads(e.check, pys)
        validate = "None"
        if e.validate is not None:
            validate = f"_validate_{fn}"
            validators.append(dict(fn=validate, params=", ".join(pys), body=e.validate))
        validate_out = "None"
        if e.validate_out is not None:
            validate_out = f"_validate_out_{fn}"
            validators.append(dict(fn=validate_out, params=", ".join(["outs", "results"] + pys), body=e.validate_out))
        call_args = ", ".join([a.py for a in fargs] + (["None"] if e.random else []))
        call_args = f"({call_args},)" if call_args else "()"
        common = dict(
            names=tuple(names),
            kinds=", ".join(kinds),
            kwarg_only=tuple([a.kwarg_only for a in fargs] + ([True] if e.random else [])),
            returns=s.returns,
            promote=repr(e.promote),
            promote_args=repr(e.promote_args or None),
            keeps_scalar=repr(tuple(names.index(a) for a in e.keeps_scalar)) if e.keeps_scalar else "()",
            emit=f"E.{fn}",
            check=check,
            check_reads=check_reads,
            check_integral=e.check_if == "integral",
            index_dtype=_index_dtype(e, fargs),
            validate=validate,
            refuse_dtypes=_refuse_dtypes(e),
        )
        meta = "None"
        if s.inplace and len(s.mutated) > 1:
            # Writes several arguments: the node's outputs are their new values in schema order,
            # with the avals of the functional op (the in-place op's meta returns only `self`).
            names_ = [a.name for a in fargs]
            common["mutates"] = tuple(names_.index(m) for m in s.mutated)
            common["returns"] = "LIST" if s.returns == "NONE" else s.returns
            meta = _aten(s.name.replace("_.", ".", 1))
        var = f"S_{fn}"
        scatter_var = "None"
        if e.scatter is not None:
            rest = [a.py for a in fargs[1:]]
            lowerings.append(dict(fn=fn + "__scatter", params=", ".join(["out", "self", "src"] + rest + ["idx"]),
                                  body=e.scatter))  # fmt: skip
            scatter_var = f"S_{fn}__scatter"
            specs.append(_Spec(var=scatter_var, name=e.name + ".scatter", overload="None", emit=f"E.{fn}__scatter",
                               names=tuple(["self", "src"] + [a.name for a in fargs[1:]] + ["idx"]),
                               kinds=", ".join(["TENSOR", "TENSOR"] + ["STATIC"] * len(fargs)),
                               kwarg_only=tuple([False] * (len(fargs) + 2)), returns="ONE", promote="None",
                               promote_args="None", view=False, scatter="None", meta="_scatter_meta",
                               check="None", check_integral=False, index_dtype="None"))  # fmt: skip
        main = _Spec(var=var, name=e.name, overload=_aten(e.name), view=s.view, scatter=scatter_var,
                     meta=meta, copies=e.copies, distinct_out=e.distinct_out, validate_out=validate_out,
                     **common)  # fmt: skip
        specs.append(main)
        entry_shim = "call_inplace" if s.inplace else "call"
        if e.dispatch == "shim":
            shims.append(dict(fn=fn, aten=_aten(e.name), params=_params(fargs),
                              body=f"{entry_shim}({var}, {call_args})"))  # fmt: skip
            if s.factory:
                factories.append((e.name.removesuffix(".default"), fn))
        if not e.variants or s.inplace or e.dispatch != "shim":
            continue
        inplace, out = groups.get(e.name, (None, None))
        if inplace is not None:
            ifn = _ident(inplace)
            # In-place foreach ops return nothing: their avals come from the functional op.
            meta = _aten(e.name) if schemas[inplace].returns == "NONE" else "None"
            own = {}
            if e.lower_inplace is not None:  # CPU's in-place kernel computes otherwise
                lowerings.append(dict(fn=ifn, params=", ".join(["out"] + pys), body=e.lower_inplace))
                own = dict(emit=f"E.{ifn}")
            specs.append(_Spec(var=f"S_{ifn}", name=inplace, overload=_aten(inplace), view=False, scatter="None",
                               meta=meta, **{**common, **own}))  # fmt: skip
            shims.append(dict(fn=ifn, aten=_aten(inplace), params=_params(fargs),
                              body=f"call_inplace(S_{ifn}, {call_args})"))  # fmt: skip
        if out is not None:
            os_ = schemas[out]
            if [a.name for a in os_.args if not a.is_out] == [a.name for a in fargs]:
                outs = [a for a in os_.args if a.is_out]
                ofn = _ident(out)
                main.out_overload = _aten(out)  # its meta kernel judges the out= tensors (trace/dispatch.py)
                if len(outs) == 1 and outs[0].type.endswith("[]"):  # `Tensor(a!)[] out`, returning ()
                    body = f"call_out({var}, {call_args}, tuple({outs[0].py}), returns=False)"
                else:
                    body = f"call_out({var}, {call_args}, ({', '.join(a.py for a in outs)},))"
                shims.append(dict(fn=ofn, aten=_aten(out), params=_params(os_.args), body=body))
    _check_unique(shims)
    return dict(lowerings=lowerings, validators=validators, decomposed_validated=decomposed_validated,
                specs=specs, shims=shims, factories=factories, decomposed=decomposed,
                runtime=runtime, fallbacks=fallbacks, n_entries=len(entries))  # fmt: skip


def render(ops_yaml: str) -> dict[str, str]:
    """``{relative path: text}`` of every generated file."""
    schemas, _ = schema.load()
    entries = registry.load(ops_yaml, schemas)
    ctx = build(entries)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)  # fmt: skip
    out = {}
    for name in ("__init__.py", "lowerings.py", "dispatch.py"):
        out[name] = env.get_template(name + ".j2").render(**ctx)
    return out
