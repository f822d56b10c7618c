"""``torch_xla.experimental.deprecation``: keep an old name working while pointing at the new."""

from __future__ import annotations

import functools
import importlib
import logging

__all__ = ["deprecated", "mark_deprecated", "register_deprecated"]


def deprecated(module, new, old_name: str | None = None, extra_msg: str | None = None):
    """``new``, logging once (at its first call) that ``module.old_name`` is deprecated in its
    favour."""
    warned = [False]
    old_name = old_name or new.__name__

    @functools.wraps(new)
    def wrapped(*args, **kwargs):
        if not warned[0]:
            msg = f"{module.__name__}.{old_name} is deprecated. Use {new.__module__}.{new.__name__} instead."
            logging.warning(msg + (f" {extra_msg}" if extra_msg else ""))
            warned[0] = True
        return new(*args, **kwargs)

    return wrapped


def mark_deprecated(new, extra_msg: str | None = None):
    """Decorator: the decorated function becomes ``new``, warning once under its old name."""

    def decorator(func):
        return deprecated(importlib.import_module(func.__module__), new, old_name=func.__name__, extra_msg=extra_msg)

    return decorator


def register_deprecated(module, new, extra_msg: str | None = None) -> None:
    """Set ``module.<new's name>`` to ``new``, warning once that the name moved."""
    setattr(module, new.__name__, deprecated(module, new, extra_msg=extra_msg))
