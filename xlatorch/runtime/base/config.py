"""Modes read once at import, that several stages read (flags that one module reads live there).

``XLATORCH_CHECKS``: ``1`` (default) computes the checks CPU PyTorch makes on data inside the
compiled graph and reads them when the step's results are next needed; ``sync`` reads each
sync's checks before it returns; ``0`` turns them off (runtime/lower/checks.py).
"""

from __future__ import annotations

import os

__all__ = ["CHECKS", "CHECKS_DEFER"]

_MODE = os.environ.get("XLATORCH_CHECKS", "1").strip().lower()
CHECKS = _MODE not in ("0", "false", "off", "no")
CHECKS_DEFER = _MODE != "sync"  # read a sync's rows when its results are next needed (see above)
