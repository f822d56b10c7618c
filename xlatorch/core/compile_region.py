"""``xlatorch.compile`` (``torch_xla.compile``): a region of the program traced and run as one graph.

Entering a region runs what is pending (``mark_step``), so work from before it (data loading,
eager ops) never leaks into its graph; its ops are traced lazily (eager mode is off inside);
leaving it runs the region's graph (``mark_step``: its results are device data). The region's
state lives in the runtime (``runtime/base/regions.py``), where the sync path reads it:

- ``full_graph=True``: a sync inside the region that would run part of its graph (``.item()``,
  ``print``, a CPU fallback or data-dependent op reading a pending value, ``mark_step``)
  raises instead, naming the cause and the user's line;
- ``max_different_graphs=N``: a compiled function counts the distinct graphs it produced over
  its calls, and raises at the (N+1)th with the compile explainer's account of what changed;
- ``name``: labels the region's compiles and graph cuts in debug output, and names the HLO
  module of each graph compiled in it (``jit_<name>``, in XLA's dumps);
- ``custom_compile_options``: XLA compiler options for every graph compiled in the region
  (part of the cache key). Unlike torch_xla, where they stay set for later compiles too,
  they apply to the region only.

Regions nest: an inner region is part of the outer one's graph (it does not sync); its
``full_graph`` and ``max_different_graphs`` hold inside it as well as the outer's.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from xlatorch.runtime.base import regions
from xlatorch.runtime.base.source import user_frame
from xlatorch.runtime.execute import eager

__all__ = ["compile", "CompileRegion"]

# (name, identity of f) -> (weak reference to f, Session): ``xlatorch.compile(f, max_different_graphs=N)``
# called again for the same function counts on (as in torch_xla, whose sessions are keyed the same way).
_SESSIONS: dict = {}


class CompileRegion:
    """A ``torch_xla.compile`` region: a context manager, and (called with a function) a
    decorator. Entering it syncs what is pending; leaving it syncs the region's graph.
    Re-entrant and usable from several threads (each entry is the thread's own)."""

    def __init__(self, full_graph: bool = False, name: str | None = None, session=None, options=None):
        self.full_graph = full_graph
        self.name = name
        self.session = session
        self.options = options

    def __enter__(self) -> None:
        from xlatorch.core.xla_model import mark_step

        outer = regions.current()
        if outer is None:  # an inner region is part of the outer one's graph
            saved = eager.ON
            eager.enable(False)
            try:
                mark_step()  # what is pending runs before the region, apart from its graph
            except BaseException:
                eager.enable(saved)
                raise
        r = regions.push(self.name, self.full_graph, self.session, self.options, user_frame())
        if outer is None:
            r.saved = saved

    def __exit__(self, typ, exc, tb) -> bool:
        from xlatorch.core.xla_model import mark_step

        r = regions.current()
        if r is None:  # pragma: no cover - an exit with no matching entry
            return False
        if r.outer is not None:
            regions.pop(r)
            return False
        try:
            if typ is None:
                r.ending = True  # the one sync a full graph makes; its graph still counts
                try:
                    mark_step()
                finally:
                    regions.pop(r)
            else:
                # The body raised: its work so far runs (as torch_xla's region does), outside
                # the region's rules, and the body's error is the one the user sees.
                regions.pop(r)
                mark_step()
        finally:
            eager.enable(r.saved)
        return False

    def __call__(self, fn: Callable) -> Callable:
        """``fn`` run inside this region at every call."""
        return _wrap(self, fn)


def _wrap(region: CompileRegion, f: Callable) -> Callable:
    def compiled(*args, **kwargs):
        with region:
            return f(*args, **kwargs)

    if inspect.isfunction(f) or inspect.ismethod(f):
        functools.update_wrapper(compiled, f, updated=())
    compiled.__wrapped__ = f
    return compiled


def _identity(f) -> tuple:
    self = getattr(f, "__self__", None)
    if inspect.ismethod(f):  # a bound method is a new object at each attribute access
        return id(f.__func__), id(self)
    return id(f), None


def _ref(f):
    try:
        return weakref.WeakMethod(f) if inspect.ismethod(f) else weakref.ref(f)
    except TypeError:  # not weakly referenceable: held for the process, as torch_xla does
        return lambda: f


def _session(f, name, limit: int):
    if f is None:
        return regions.Session(limit)
    key = (name, _identity(f))
    held = _SESSIONS.get(key)
    if held is not None:
        live = held[0]()
        if live is not None and (live is f or live == f):
            held[1].limit = limit
            return held[1]
    for k in [k for k, (ref, _) in _SESSIONS.items() if ref() is None]:  # functions that died
        del _SESSIONS[k]
    s = regions.Session(limit)
    _SESSIONS[key] = (_ref(f), s)
    return s


def compile(
    f: Callable | None = None,
    full_graph: bool | None = False,
    name: str | None = None,
    max_different_graphs: int | None = None,
    custom_compile_options: dict[str, Any] | None = None,
):
    """Trace ``f`` (or the ``with`` block) lazily and run it as one XLA graph at its end.

    Pending work is run first; inside, ops are traced (eager mode is off); at the end the
    region's graph is compiled (once per graph structure) and run, and its results are
    device data. Usable as ``@xlatorch.compile``, ``@xlatorch.compile(...)``,
    ``xlatorch.compile(f)`` and ``with xlatorch.compile(): ...``.

    Args:
      f: the function or module to compile; None: return a context manager (which also
        decorates a function).
      full_graph: raise (``RuntimeError`` naming the cause and the user's line) when the
        region would run in more than one graph: a host read (``.item()``, ``print``), a
        CPU fallback or a ``mark_step`` inside it that needs a pending value.
      name: the graph's name in debug output and in XLA's dumps; default: ``f``'s name.
      max_different_graphs: raise when the region (over all calls of ``f``) produces more
        than this many distinct graphs, naming what changed from the closest one before.
      custom_compile_options: XLA compiler options (``DebugOptions`` fields, e.g.
        ``{"xla_cpu_enable_fast_math": True}``) for the graphs compiled in the region;
        part of their cache key. ``{}`` or None: none besides the defaults.

    Returns:
      The compiled function (``f`` given), else a ``CompileRegion``.
    """
    if max_different_graphs is not None and (type(max_different_graphs) is not int or max_different_graphs < 1):
        raise ValueError(f"max_different_graphs must be a whole number >= 1, got {max_different_graphs!r}")
    if custom_compile_options is not None and not isinstance(custom_compile_options, dict):
        raise TypeError(f"custom_compile_options must be a dict, got {type(custom_compile_options).__name__}")
    if name is None and f is not None:
        name = getattr(f, "__name__", None) or type(f).__name__
    session = None if max_different_graphs is None else _session(f, name, max_different_graphs)
    region = CompileRegion(bool(full_graph), name, session, dict(custom_compile_options or {}) or None)
    return region if f is None else _wrap(region, f)
