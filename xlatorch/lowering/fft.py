"""FFTs: the _fft_r2c / _fft_c2r / _fft_c2c family."""

from __future__ import annotations
