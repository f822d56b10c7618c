"""Pointwise math whose lowering is more than one expression."""

from __future__ import annotations
