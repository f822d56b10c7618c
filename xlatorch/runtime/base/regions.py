"""Regions of the user's program that change what a sync may do: ``torch_xla.compile``.

A region (``xlatorch.compile``, ``xlatorch/core/compile_region.py``) is pushed for the user
thread that enters it; the sync path consults it (``current``): a ``full_graph`` region
raises at a sync that would run part of its graph before its end, a region with
``max_different_graphs`` counts the distinct graphs it produced, ``name`` labels its graphs
in debug output and dumps, ``options`` are handed to XLA with every graph compiled in it
(and are part of their cache keys). Ops on autograd's device thread belong to the thread
that called ``backward`` (``threads.owner``), so a backward pass inside a region is in it.

``CUSTOM`` holds the compiler options set for the whole process
(``torch_xla.set_custom_compile_options``); a region's own options win over them.

Cheap when unused: the sync path tests ``ACTIVE`` (an empty dict) and ``CUSTOM`` once per
sync; nothing here is read per op.
"""

from __future__ import annotations

from xlatorch.runtime.base.threads import owner

__all__ = ["Region", "Session", "ACTIVE", "CUSTOM", "current", "push", "pop", "options_key", "set_custom_options"]

CUSTOM: dict = {}  # process-wide XLA compiler options (torch_xla.set_custom_compile_options)


def set_custom_options(options: dict) -> None:
    """XLA compiler options for every graph compiled from now on (replacing earlier ones; an
    empty dict clears them). Part of each graph's cache key."""
    CUSTOM.clear()
    CUSTOM.update(options or {})


class Session:
    """The distinct graphs a region produced over its uses (``max_different_graphs``): a
    function compiled with ``xlatorch.compile`` keeps one session across its calls."""

    __slots__ = ("limit", "keys", "summaries")

    def __init__(self, limit: int):
        self.limit = limit
        self.keys: set = set()  # trace-level keys of the graphs seen (structure and input avals)
        self.summaries: list = []  # what the debug tools need to say how a new graph differs (no tensors)


class Region:
    """One entered region: ``name`` (or None), ``full_graph``, ``session`` (a ``Session`` or
    None), ``options`` (XLA compiler options, a dict, or None) and ``outer`` (the region it
    is nested in). The effective ``full_graph``, ``name`` and ``options`` include the outer
    region's; ``ending``: its own closing sync is running (the one sync a full graph makes)."""

    __slots__ = ("name", "full_graph", "session", "options", "outer", "ending", "where", "saved")

    def __init__(self, name, full_graph, session, options, outer, where):
        self.outer = outer
        self.name = name if name is not None or outer is None else outer.name
        self.full_graph = bool(full_graph) or (outer is not None and outer.full_graph)
        self.session = session
        self.options = options if options is not None or outer is None else outer.options
        self.ending = False
        self.where = where  # ``(file, line)`` where the user entered it, or None
        self.saved = None  # what the API restores when the outermost region ends (eager mode)

    def sessions(self):
        """The sessions counting graphs made now: this region's and its outer ones'."""
        r = self
        while r is not None:
            if r.session is not None:
                yield r.session
            r = r.outer


# User thread -> its innermost region. Keyed by the user thread so that ops run for it on
# autograd's device thread see it too.
ACTIVE: dict[int, Region] = {}


def current() -> Region | None:
    """The region the calling thread's work belongs to, or None."""
    if not ACTIVE:
        return None
    return ACTIVE.get(owner())


def push(name, full_graph, session, options, where) -> Region:
    """Enter a region on the calling thread (nested in the one it is in, if any)."""
    tid = owner()
    r = Region(name, full_graph, session, options, ACTIVE.get(tid), where)
    ACTIVE[tid] = r
    return r


def pop(r: Region) -> None:
    """Leave region ``r`` (the calling thread's innermost)."""
    tid = owner()
    if r.outer is None:
        ACTIVE.pop(tid, None)
    else:
        ACTIVE[tid] = r.outer


def options_key() -> tuple | None:
    """The current region's compiler options as part of a cache key, or None (no region, or
    one that sets none): graphs compiled with other options are other executables."""
    r = ACTIVE.get(owner()) if ACTIVE else None
    opts = {**CUSTOM, **(r.options if r is not None and r.options else {})}
    if not opts:
        return None
    return tuple(sorted((k, repr(v)) for k, v in opts.items()))
