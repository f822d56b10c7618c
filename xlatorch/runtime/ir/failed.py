"""Errors that outlive the op that raised them: failed values.

A value whose computation failed (a sync that could not compile or run, or an op
that raised on autograd's device thread, where an exception would abort the
process) becomes a *failed value*: an IR node that raises the original error when
lowered. Failed values are never pending, so steps that do not read them still
work; a sync whose graph reads one computes everything else, poisons the tensors
that depend on it, and raises the original error (runtime/execute/faults.py).
"""

from __future__ import annotations

from xlatorch.runtime.ir.ops import ONE, STATIC, Info, OpSpec
from xlatorch.runtime.ir.values import Node, Out

__all__ = ["FailedValueError", "failed_value", "fail_node", "is_failed", "is_failed_storage", "cause"]


class FailedValueError(RuntimeError):
    """Reading a tensor whose computation failed earlier."""


def _raise(out, error):
    raise FailedValueError(f"xlatorch: this tensor's value could not be computed: {error}") from error


_SPEC = None


def _spec():
    global _SPEC
    if _SPEC is None:
        _SPEC = OpSpec("xlatorch::failed", None, _raise, ("error",), (STATIC,), (False,), ONE)
    return _SPEC


def failed_value(aval, error: Exception) -> Out:
    """A value of ``aval`` that raises ``error`` when a graph that reads it is lowered."""
    error = cause(error)
    return Node(_spec(), (error,), Info((aval,), None), ("failed", id(error))).outs[0]


def fail_node(node: Node, error: Exception) -> None:
    """Turn ``node`` (already in graphs and tensors) into a failed value raising ``error``."""
    node.spec = _spec()
    node.args = (cause(error),)
    node.key = ("failed", id(node.args[0]))


def is_failed_storage(st) -> bool:
    """Whether a storage's value is a failed value."""
    v = st.value
    return type(v) is Out and v.node.spec is _SPEC


def is_failed(node: Node) -> bool:
    return node.spec is _SPEC


def cause(error: Exception) -> Exception:
    """The original error behind a chain of failed values."""
    while isinstance(error, FailedValueError) and error.__cause__ is not None:
        error = error.__cause__
    return error
