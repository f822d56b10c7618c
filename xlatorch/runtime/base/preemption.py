"""Preemption notices: ``SIGTERM`` (what a cloud scheduler sends before it reclaims a
machine) recorded instead of ending the process, so that training can checkpoint at its next
step and then stop (torch_xla's preemption sync manager, for one process).

``activate()`` installs the handler (main thread only; a handler installed before it still
runs); ``reached(step)`` says whether a notice arrived since the last time it said so.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["activate", "deactivate", "reached"]

_state = {"active": False, "seen": False, "previous": None}


def _on_sigterm(signum, frame) -> None:
    _state["seen"] = True
    previous = _state["previous"]
    if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
        previous(signum, frame)


def activate() -> bool:
    """Record ``SIGTERM`` from now on; False where signals cannot be handled (not the main thread)."""
    if _state["active"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _state["previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
    _state["active"] = True
    return True


def deactivate() -> None:
    """Give ``SIGTERM`` back to the handler it had before ``activate``."""
    if _state["active"] and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _state["previous"] or signal.SIG_DFL)
        _state.update(active=False, seen=False, previous=None)


def reached(step: int) -> bool:
    """Whether a ``SIGTERM`` arrived since the last True (``step``: the caller's step, for logs)."""
    seen = _state["seen"]
    _state["seen"] = False
    return seen
