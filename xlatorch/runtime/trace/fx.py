"""An ATen FX graph (from AOTAutograd, behind ``torch.compile``) as one IR node.

``FxProgram(gm)`` checks once that every node of ``gm`` has a lowering in ops.yaml, then each
call records ONE node for the whole graph: no per-op Python dispatch, and the node's lowering
emits the graph's ops with the same emitters a lazily traced program uses. Inputs are device
tensors and 0-d CPU tensors (Python float arguments, ``xlatorch/dynamo.py``), which enter as
parameters like the lazy path's host scalars. Outputs are device tensors, and CPU values
computed from CPU inputs alone (a float argument a forward saves for its backward), computed
on the host at each call. The node joins the step's lazy graph, so a compiled forward, its
backward and the optimizer's ops still compile into the step's one XLA program (cached like
any other). Random ops get a fresh seed per call (graph inputs, never constants); on-device
checks (index bounds ...) are computed inside the node and raised at the sync, as in the lazy
path. A tensor the traced code built from Python data (``torch.tensor([...], device=...)``,
held by the graph as a CPU constant, ``get_attr``) is a constant of the node's lowering, as it
is of the graph Dynamo guards. A graph with an op that has no lowering (or symbolic shapes)
raises ``Unlowerable``: the caller runs it op by op instead.
"""

from __future__ import annotations

import itertools
import operator

import jax.numpy as jnp
import torch
from jax import lax
from torch.fx.node import map_arg

from xlatorch.lowering import checks, pointwise
from xlatorch.runtime.base import config
from xlatorch.runtime.base.dtypes import EXACT, PY_SCALAR_DTYPE, TORCH_TO_JAX, to_jax, weak_number
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.base.source import user_frame
from xlatorch.runtime.base.threads import TICKS, owner
from xlatorch.runtime.base.topology import world_size
from xlatorch.runtime.ir.emit import emit_node
from xlatorch.runtime.ir.ops import GENERATOR, SCALAR, SCALAR_LIST, STATIC, TENSOR_LIST, TUPLE, Info, OpSpec, signature
from xlatorch.runtime.ir.rng import next_key
from xlatorch.runtime.ir.values import Node, Scalar
from xlatorch.runtime.trace.collectives import SPECS as COLLECTIVES
from xlatorch.runtime.trace.collectives import TRACED
from xlatorch.runtime.trace.nodes import info_of
from xlatorch.runtime.trace.tensor import XlaTensor, value_of, wrap

__all__ = ["FxProgram", "Unlowerable", "Inner", "HANDLED", "SPECS"]

aten = torch.ops.aten
_ids = itertools.count()
SPECS: dict = {}  # OpOverload -> OpSpec, filled at import of xlatorch (from the generated table)
# Ops a functional graph holds that need no lowering of their own.
_WITH_EFFECTS = torch.ops.higher_order.with_effects
_IDENTITY = {aten.detach.default, aten.alias.default, aten.lift_fresh.default, aten.lift_fresh_copy.default}
# Casts: _to_copy, and the prims cast that casts a float argument (a 0-d float64 tensor, see
# xlatorch/dynamo.py) to the dtype it computes with.
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
HANDLED = _IDENTITY | _CASTS  # what FxProgram lowers without an ops.yaml entry


class _Seed:
    """Where a random op's seed goes: the node's ``i``-th seed input."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Num:
    """A Python number argument: a weakly typed constant of the graph, as the lazy path's
    scalars are weakly typed parameters (2.5 * a float32 tensor stays float32). Behind an
    optimization barrier: XLA's simplifier folds constants across ops in ways that change
    the result (``(x + 2.5) - 1.5`` became ``x + 1``, a third of float32 results 1 ulp from
    CPU's), as it cannot with the lazy path's parameters."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def jax(self):
        return lax.optimization_barrier(weak_number(self.value))


class Inner:
    """A value the graph computes inside its node, as an argument of one of its checked ops
    (``FxProgram.inner_checks``): the host does not hold it, only its aval."""

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


class _In:
    """Where a checked op reads the graph's ``i``-th input (``FxProgram.inner_checks``)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _bind(a, inputs):
    t = type(a)
    if t is _In:
        return inputs[a.i]
    if t is tuple:
        return tuple(_bind(x, inputs) for x in a)
    return a


def _number(a):
    return _Num(a) if type(a) in PY_SCALAR_DTYPE else a


class Unlowerable(Exception):
    """The graph has an op (or a shape) this path cannot lower as one node."""


def _aval(v):
    if not isinstance(v, torch.Tensor):
        raise Unlowerable(f"a non-tensor value {type(v).__name__}")
    shape = tuple(v.shape)
    if not all(type(d) is int for d in shape):
        raise Unlowerable("symbolic shapes")
    return shape, v.dtype


def _constant(gm, n) -> torch.Tensor:
    """The CPU tensor a ``get_attr`` node reads: a tensor the traced code made from Python data."""
    t = getattr(gm, n.target, None)
    if type(t) is not torch.Tensor or t.device.type != "cpu":
        raise Unlowerable(f"graph attribute {n.target} ({type(t).__name__})")
    _aval(t)
    return t  # read (never written) at each call and lowering: a fake mode may be tracing now


def _literal(t: torch.Tensor):
    """``t`` as a JAX constant in the device's storage dtype (bfloat16 bit for bit)."""
    t = t.contiguous()
    a = t.view(torch.int16).numpy().view(EXACT[torch.bfloat16]) if t.dtype == torch.bfloat16 else t.numpy()
    return jnp.asarray(a, TORCH_TO_JAX[t.dtype])


def _schema_args(op, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _meta(a):
    """What PyTorch's promotion sees for an argument: the node's fake value, or the number."""
    if isinstance(a, torch.fx.Node):
        return a.meta.get("val")
    if isinstance(a, list):  # a foreach op's list (fx's immutable_list)
        return [_meta(x) for x in a]
    return a


def _on_device(n) -> bool:
    """Whether FX node ``n`` computes a value on the xla device."""
    val = n.meta.get("val")
    return any(
        isinstance(v, torch.Tensor) and v.device.type == "xla"
        for v in (val if isinstance(val, (tuple, list)) else (val,))
    )


def _host_steps(gm, outputs) -> list:
    """The nodes computing ``outputs`` (values on the CPU), in graph order, run eagerly on the
    host at each call; raises ``Unlowerable`` if one reads a device value."""
    need: set = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        if _on_device(n):
            raise Unlowerable("an output on the CPU computed from device values")
        need.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in gm.graph.nodes if n in need and n.op == "call_function"]


class FxProgram:
    """One FX graph of ATen ops, callable on device tensors as one IR node."""

    def __init__(self, gm: torch.fx.GraphModule, name: str = "graph"):
        self.gm = gm
        self.steps = []  # (kind, fx node, spec, arg template, info)
        self.inputs = []
        self.constants = {}  # get_attr node -> CPU tensor
        self.random = 0
        self.collective = False
        # Effect tokens (AOTAutograd's ordering of ops with side effects): None at run time,
        # neither passed to the device nor returned from it
        tokens = {e.args[0] for e in gm.graph.nodes if e.target is _WITH_EFFECTS}
        tokens |= {u for e in gm.graph.nodes if e.target is _WITH_EFFECTS for u in e.users if u.args[1] == 0}
        self.placeholders = []
        self.tokens = tokens
        checked = False
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                self.placeholders.append(n)
                if n in tokens:
                    continue
                _aval(n.meta.get("val"))
                self.inputs.append(n)
            elif n.op == "call_function":
                checked |= self._plan(n)
            elif n.op == "output":
                outs = n.args[0]
                outs = outs if isinstance(outs, (tuple, list)) else [outs]
                self.outputs = [None if o in tokens else o for o in outs]
            elif n.op == "get_attr":
                self.constants[n] = _constant(gm, n)
            else:
                raise Unlowerable(f"FX node kind {n.op}")
        # Outputs on the CPU (computed from float arguments alone: a forward saves them for its
        # backward, Dynamo reads a returned one back as a number) are computed on the host.
        self.on_device = [o if o is not None and _on_device(o) else None for o in self.outputs]
        self.host = _host_steps(gm, [o for o, d in zip(self.outputs, self.on_device) if o is not None and d is None])
        self.avals = tuple(None if o is None else _aval(o.meta.get("val")) for o in self.on_device)
        self.spec = OpSpec(f"xlatorch::compiled_{name}_{next(_ids)}", None, self._emit, ("inputs",),
                           (TENSOR_LIST,), (False,), TUPLE)  # fmt: skip
        self.spec.check = self._check if checked and config.CHECKS else None
        self.spec.inner_checks = self.inner_checks
        self._checked_ops = None  # inner_checks' plan, made at its first call
        self.info = Info(self.avals, None, self.spec.check is not None)
        if self.collective and world_size() > 1:  # compiled as one program per replica (SPMD)
            COLLECTIVES.add(self.spec)
        self._stash: dict = {}

    def _plan(self, n) -> bool:
        op = n.target
        if op is _WITH_EFFECTS:
            return self._plan_effect(n)
        if op is operator.getitem:
            self.steps.append(("getitem", n, None, n.args, None))
            return False
        if op in _IDENTITY:
            self.steps.append(("identity", n, None, n.args[0], None))
            return False
        if op in _CASTS:  # a cast on the device
            dev = n.kwargs.get("device")
            if dev is not None and torch.device(dev).type != "xla":
                raise Unlowerable("a copy to another device")
            self.steps.append(("convert", n, None, n.args[0], _aval(n.meta.get("val"))[1]))
            return False
        spec = SPECS.get(op)
        if spec is None:
            spec = TRACED.get(op)
            self.collective |= spec is not None
        if spec is None:
            raise Unlowerable(f"aten::{getattr(op, '__name__', op)} has no lowering")
        named = _schema_args(op, n.args, n.kwargs)
        args, margs = [], []
        for name, kind in zip(spec.arg_names, spec.kinds):
            if kind is GENERATOR:
                args.append(_Seed(self.random))
                self.random += 1
                margs.append(None)
                continue
            a = named.get(name)
            if kind is STATIC and type(a) is list:
                a = tuple(a)
            margs.append(_meta(a))
            if kind is SCALAR:
                a = _number(a)
            elif kind is SCALAR_LIST and a is not None:
                a = tuple(_number(x) for x in a)
            args.append(a)
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        info = info_of(spec, margs, tuple(None if v is None else _aval(v) for v in vals))
        self.steps.append(("op", n, spec, tuple(args), info))
        return info.checked

    def inner_checks(self, inputs) -> list | None:
        """The graph's checked ops applied to the node's arguments ``inputs`` (its inputs'
        values, in order), for ``plan/prechecks.decided``: per op ``(position, spec, info,
        arguments)``, an argument that is an input of the graph given as its value (an alias of
        one too), a constant as its CPU tensor, a Python number as a ``Scalar``, and a value the
        graph computes as ``Inner`` (its aval). None when a check is not an op's own (linalg's)."""
        plan = self._checked_ops
        if plan is None:
            plan = self._checked_ops = self._plan_checked_ops()
        if plan is False:
            return None
        return [(k, spec, info, _bind(args, inputs)) for k, spec, info, args in plan]

    def _plan_checked_ops(self):
        where: dict = {p: _In(i) for i, p in enumerate(self.inputs)}
        where.update(self.constants)

        def arg(a):
            if isinstance(a, torch.fx.Node):
                w = where.get(a)
                return w if w is not None else Inner(_aval(a.meta.get("val")))
            if type(a) is _Num:
                return Scalar(a.value, PY_SCALAR_DTYPE[type(a.value)])
            if type(a) is _Seed:
                return None
            if type(a) is tuple:
                return tuple(arg(x) for x in a)
            return a

        plan = []
        try:
            for k, (kind, n, spec, args, info) in enumerate(self.steps):
                if kind == "identity" and args in where:
                    where[n] = where[args]
                elif kind == "linalg_check":
                    return False
                elif kind == "op" and info.checked:
                    plan.append((k, spec, info, tuple(arg(a) for a in args)))
        except Unlowerable:  # a value that is not one tensor
            return False
        return plan

    def _plan_effect(self, n) -> bool:
        """``with_effects(token, op, *args)``: ``_linalg_check_errors`` (after ``linalg.cholesky``,
        ``inv``, ``solve``) is an on-device check, raising CPU's error at the read."""
        _, op, *args = n.args
        if op is not aten._linalg_check_errors.default:
            raise Unlowerable(f"the side effects of aten::{getattr(op, '__name__', op)}")
        self.steps.append(("linalg_check", n, None, (args[0], args[1], n.kwargs["is_matrix"]), None))
        return True

    def __call__(self, args):
        """Record the graph applied to ``args`` (device tensors and 0-d CPU tensors, in
        placeholder order); returns the outputs as new device tensors, CPU tensors where the
        graph computes one on the CPU (computed now), None where it returns None."""
        vals = []
        if self.tokens:
            args = [a for p, a in zip(self.placeholders, args) if p not in self.tokens]
        for a in args:
            if type(a) is XlaTensor:
                vals.append(value_of(a))
            elif isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == "cpu":
                # A Python float argument (Dynamo passes it as a 0-d tensor) or a 0-d CPU
                # tensor: a parameter, never a constant, as on the lazy path.
                vals.append(Scalar(a.item(), a.dtype, tensor=True))
            else:
                raise TypeError(f"xlatorch: a compiled graph got a {type(a).__name__} on "
                                f"'{getattr(a, 'device', '?')}' where it expects an xla tensor")  # fmt: skip
        vals += [next_key() for _ in range(self.random)]
        vals = (tuple(vals),)
        COUNTERS[self.spec.name] += 1
        node = Node(self.spec, vals, self.info, (self.spec, signature(vals)))
        if self.info.checked:
            node.tick = (next(TICKS), owner())
            node.src = user_frame()
        outs = [None if o is None else wrap(o) for o in node.outs]
        if self.host:
            env = dict(zip(self.inputs, args))
            env.update(self.constants)
            for n in self.host:
                env[n] = n.target(*map_arg(n.args, env.__getitem__), **map_arg(n.kwargs, env.__getitem__))
            outs = [env[o] if o is not None and d is None else t for o, d, t in zip(self.outputs, self.on_device, outs)]
        return outs

    def _lower(self, inputs, found=None):
        env = {n: _literal(t) for n, t in self.constants.items()}
        n_in = len(self.inputs)
        for p, v in zip(self.inputs, inputs[:n_in]):
            env[p] = v
        seeds = inputs[n_in:]

        def get(a):
            if isinstance(a, torch.fx.Node):
                return env[a]
            if type(a) is _Seed:
                return seeds[a.i]
            if type(a) is _Num:
                return a.jax()
            if isinstance(a, (tuple, list)):
                return tuple(get(x) for x in a)
            return a

        for kind, n, spec, args, info in self.steps:
            if kind == "getitem":
                env[n] = env[args[0]][args[1]]
            elif kind == "identity":
                env[n] = env[args]
            elif kind == "convert":
                env[n] = pointwise.cast(env[args], to_jax(info))
            elif kind == "linalg_check":
                if found is not None:
                    found.append(checks.linalg_info(env[args[0]], args[1], args[2], torch.linalg.LinAlgError))
                env[n] = (None,)
            else:
                res = emit_node(spec, tuple(get(a) for a in args), info, None, found if info.checked else None)
                env[n] = res[0] if len(res) == 1 and not isinstance(n.meta.get("val"), (tuple, list)) else res
        return tuple(None if o is None else env[o] for o in self.on_device)

    def _check(self, out, inputs):
        found: list = []
        self._stash[id(inputs)] = self._lower(inputs, found)
        return found

    def _emit(self, out, inputs):
        res = self._stash.pop(id(inputs), None)
        return res if res is not None else self._lower(inputs)
