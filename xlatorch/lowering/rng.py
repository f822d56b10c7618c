"""The JAX key of a random op, from the fresh 64-bit seed each call gets (runtime/ir/rng.py).

Its bits come from XLA's RngBitGenerator (JAX's ``rbg`` implementation), not from JAX's
default Threefry, which hashes every element through 20 rounds unrolled into the op's
kernels: a 2-layer BERT training step (hidden 32, seven dropouts) took 9.8 s of XLA compile
on a 2-core CPU with Threefry, 6.5 s with RngBitGenerator and 5.3 s with no dropout at all
(one run each); a lone dropout of 1M elements 0.49 s against 0.31 s, and the same 11 ms a run.

The numbers are the same whatever the sharding (XLA generates the whole tensor, then each
device takes its part), for every replica of a program and every run from the same seed;
they are not the same on another platform (CPU and GPU generate differently), as PyTorch's
own CPU and CUDA generators are not. A random op never runs on the host
(``plan/stages.bookkeeping``), so where a stage ran cannot change a program's numbers.
"""

from __future__ import annotations

import jax

__all__ = ["key"]


def key(seed):
    """The key of one random op from its traced int64 ``seed``."""
    return jax.random.key(seed, impl="rbg")
