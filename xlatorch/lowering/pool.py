"""Pooling: average, adaptive and max pools in 1-3 dimensions and their backwards."""

from __future__ import annotations
