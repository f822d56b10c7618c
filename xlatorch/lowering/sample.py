"""Resampling: padding modes, upsampling, grid sampling, col2im."""

from __future__ import annotations
