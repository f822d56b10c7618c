"""The device RNG: one 64-bit seed per random op, derived on the host.

Each random op gets its own seed as a traced scalar argument, so random ops never
change a graph's hash, every call draws new numbers, and the sequence depends
only on the seed set by ``torch.manual_seed`` / ``xm.set_rng_state``.
"""

from __future__ import annotations

import torch

from xlatorch.runtime.ir.values import Scalar

_MASK = (1 << 64) - 1
_state = {"seed": 101}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def next_key() -> Scalar:
    """The seed leaf for the next random op."""
    # The state advances by one splitmix step per op, so get_seed()/set_seed() round-trip.
    s = _state["seed"] = _splitmix64(_state["seed"])
    return Scalar(s - (1 << 64) if s >= 1 << 63 else s, torch.int64)


def set_seed(seed: int) -> None:
    _state["seed"] = int(seed) & _MASK


def get_seed() -> int:
    return _state["seed"]
