"""Normalisation layers: batch norm and group norm, forward and backward."""

from __future__ import annotations
