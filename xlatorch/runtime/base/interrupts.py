"""Ctrl-C reaches the user's code, never the middle of the machinery.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread runs next: in a
device tensor's ``__torch_dispatch__`` called from C++, in a PyTorch hook run by autograd,
in a JAX callback, or between an executable's launch and the commit of its results. From
there it either unwinds through C++ frames that cannot take an exception (the process
aborts: ``terminate called without an active exception``) or leaves storages reading
buffers the step had already donated (the model is lost). CPU PyTorch has neither
problem: its kernels run in C++, where Python never raises.

So, when the program uses Python's default SIGINT handler, xlatorch installs one that
raises ``KeyboardInterrupt`` at once when the main thread is in the user's own code, and
otherwise at the next line the innermost user frame executes (through that frame's
``f_trace``): after the op, the backward pass or the sync in progress has finished. A
program whose code never runs again (an endless loop inside a library) gets the
exception at a Ctrl-C pressed more than two seconds after the first, raised where it
lands. A device backward pass runs in the calling thread (runtime/trace/modules.py), inside
autograd's engine, where an exception aborts the process (torch's Python device guard) even
from the user's own hook: a Ctrl-C there, first or later, waits for the pass to return
(``ENGINE_ENTRIES``: the Python frame that entered the engine). ``XLATORCH_DEFER_SIGINT=0``
keeps Python's handler. A handler the program installs itself is left alone.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from xlatorch.runtime.base import config
from xlatorch.runtime.base.source import is_user_code
from xlatorch.runtime.base.threads import _in_backward

__all__ = ["install", "handler", "ENGINE_ENTRIES"]

# Code objects of the functions that call into autograd's engine for a device backward pass
# (runtime/trace/modules.py adds its wrapper): a Ctrl-C in the pass waits for that frame.
ENGINE_ENTRIES: set = set()

_pending = False
_since = 0.0
_PATIENCE = 2.0  # seconds a deferred Ctrl-C waits for the user's next line; a later one then raises at once
_saved: tuple = (None, None)  # the tracing this replaced: (global trace function, the frame's own)


def _raise_here(frame, event, arg):
    """The user frame's trace function: raises the deferred interrupt at its next line."""
    global _pending
    glob, local = _saved
    frame.f_trace = local
    sys.settrace(glob)
    if not _pending:
        return local
    _pending = False
    raise KeyboardInterrupt


def _no_calls(frame, event, arg):
    return None  # enables per-frame tracing without tracing new calls


def _engine_entry(frame):
    """The frame that entered autograd's engine, when this thread runs a backward pass."""
    if _in_backward() == -1:
        return None
    f = frame
    while f is not None and f.f_code not in ENGINE_ENTRIES:
        f = f.f_back
    return f


def handler(sig, frame):
    global _pending, _since, _saved
    entry = _engine_entry(frame)
    f = frame if entry is None else entry.f_back  # in a backward pass: a frame outside the engine
    while f is not None and not is_user_code(f.f_code.co_filename):
        f = f.f_back
    if f is None and entry is not None:
        f = entry.f_back  # torch.autograd's own frame: raises as it returns
    if _pending and (entry is not None or time.monotonic() - _since < _PATIENCE):
        return  # already on its way to the user's next line (or out of the engine)
    if entry is None and (f is None or f is frame or _pending):
        # In the user's code, or no user frame is on the stack, or the first Ctrl-C has
        # waited in vain (code that never returns to the user's): raise here, as Python would.
        _pending = False
        raise KeyboardInterrupt
    _pending = True
    _since = time.monotonic()
    glob = sys.gettrace()
    _saved = (glob, f.f_trace)
    f.f_trace = _raise_here
    f.f_trace_lines = True
    if glob is None:  # per-frame tracing needs some global trace function (a debugger's stays)
        sys.settrace(_no_calls)


def install() -> None:
    """Use the deferring handler if SIGINT still has Python's default one (main thread only)."""
    if not config.env("XLATORCH_DEFER_SIGINT"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)
