"""Indexing and scattering: scatter/index_put/index_add families, masked ops, as_strided."""

from __future__ import annotations
