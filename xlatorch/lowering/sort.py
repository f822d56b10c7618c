"""Sorting and selection: sort, topk and friends."""

from __future__ import annotations
