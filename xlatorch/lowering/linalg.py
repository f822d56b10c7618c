"""Linear algebra beyond matmul: norms, solves, factorisations, distances."""

from __future__ import annotations
