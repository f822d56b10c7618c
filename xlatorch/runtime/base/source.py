"""The user's source line: the innermost frame outside torch, xlatorch and Python's libraries.

Recorded by the runtime (IR nodes at ``XLA_IR_DEBUG`` / debug level >= 1, checked ops,
graph cuts, CPU fallbacks) for the debug tools and error messages. A filename's verdict
is cached, so a lookup costs one dict probe per frame walked (a few microseconds from inside ``__torch_dispatch__``).
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading

from xlatorch.runtime.base.threads import _in_backward

__all__ = ["user_frame", "user_line", "fmt_src", "is_user_code"]

_USER: dict[str, bool] = {}  # co_filename -> is it user code?
_skip: tuple[str, ...] | None = None
_MAIN = threading.main_thread().ident


def _skip_prefixes() -> tuple[str, ...]:
    global _skip
    if _skip is None:
        import torch

        here = os.path.abspath(__file__)
        for _ in range(__name__.count(".")):  # up to the xlatorch package, wherever this module lives
            here = os.path.dirname(here)
        dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
        dirs |= {os.path.dirname(torch.__file__), here}
        gen = sys.modules.get("xlatorch._generated")  # the generated shims live outside the package
        if gen is not None:
            dirs.update(getattr(gen, "__path__", ()))
        _skip = tuple(d + os.sep for d in dirs)
    return _skip


def _is_user(fn: str) -> bool:
    r = _USER.get(fn)
    if r is None:
        r = _USER[fn] = not fn.startswith("<") and not fn.startswith(_skip_prefixes())
    return r


def is_user_code(filename: str) -> bool:
    """Whether code from ``filename`` is the user's (outside torch, xlatorch and Python's libraries)."""
    return _is_user(filename)


def _walk(f) -> tuple[str, int] | None:
    while f is not None:
        code = f.f_code
        if _is_user(code.co_filename):
            return code.co_filename, f.f_lineno
        f = f.f_back
    return None


def user_frame() -> tuple | None:
    """``(filename, line)`` of the innermost caller outside torch, xlatorch and the Python
    libraries; ``(filename, line, "backward")`` in a backward pass: the line that called
    ``backward()`` (or the user's hook that runs in it). On another thread with no user code
    (autograd's device thread running a backward pass), the main thread's line, where the user
    waits in ``backward()``. None when there is none."""
    src = _walk(sys._getframe(1))
    if src is None:
        if threading.get_ident() != _MAIN:
            main = _walk(sys._current_frames().get(_MAIN))
            if main is not None:
                src = (*main, "backward")
    elif _in_backward() != -1:
        src = (*src, "backward")
    return src


def fmt_src(src: tuple | None, full: bool = False) -> str:
    """``file.py:12`` (the path relative to the working directory when ``full``, else the
    base name; ``, backward`` appended for an op of a backward pass); ``?`` when unknown."""
    if src is None:
        return "?"
    fn, line = src[:2]
    tag = f", {src[2]}" if len(src) > 2 else ""
    return f"{(_rel if full else _base)(fn)}:{line}{tag}"


@functools.lru_cache(maxsize=1024)
def _rel(fn: str) -> str:
    """``fn`` relative to the working directory (as it was first asked) when inside it; cached,
    since relpath costs ~7 us and a graph cut formats one line."""
    try:
        rel = os.path.relpath(fn)
    except ValueError:  # another drive (Windows)
        return fn
    return fn if rel.startswith("..") else rel


@functools.lru_cache(maxsize=1024)
def _base(fn: str) -> str:
    return os.path.basename(fn)


def user_line() -> str | None:
    """``path:line`` of the innermost user frame, as text (None when there is none)."""
    src = _walk(sys._getframe(1))
    return None if src is None else f"{src[0]}:{src[1]}"
