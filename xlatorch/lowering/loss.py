"""Loss functions and their backwards."""

from __future__ import annotations
