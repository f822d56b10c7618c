"""``torch_xla.distributed.spmd.debugging``: how a tensor is laid out over the devices, printed.

``visualize_tensor_sharding(t)`` prints a grid of ``t``'s tiles (a 1-D or 2-D tensor's), each
naming the devices that hold it; ``visualize_sharding`` does the same from XLA's sharding text
(``{devices=[2,2]0,1,2,3}``, iota forms ``<=[4]``, ``last_tile_dim_replicate``, ``{replicated}``,
``{maximal device=N}``). Plain text: torch_xla draws the same grid with ``rich``.
"""

from __future__ import annotations

import re

import numpy as np

from xlatorch.distributed.spmd.xla_sharding import get_sharding_spec

__all__ = ["visualize_sharding", "visualize_tensor_sharding", "construct_v1_sharding_str"]


def _device_ids(spec: str, count: int) -> np.ndarray:
    """The device ids of a tile assignment: an explicit list, or XLA's iota form
    ``<=[dims]`` with an optional transpose ``T(perm)``."""
    m = re.match(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if m is None:
        return np.array([int(x) for x in spec.split(",")[:count]])
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


def tiles(sharding: str) -> tuple[tuple[int, int], list[list[str]]]:
    """``(rows, cols)`` of the tile grid and, per tile in row order, the devices holding it."""
    s = sharding.strip()
    if not s or "replicated" in s and "last_tile_dim_replicate" not in s:
        return (1, 1), [["all"]]
    m = re.search(r"maximal device=(\d+)", s)
    if m:
        return (1, 1), [[m.group(1)]]
    m = re.search(r"devices=\[([\d,]+)\]([^\s}]+)", s)
    if m is None:
        raise ValueError(f"xlatorch: cannot read the sharding {sharding!r}")
    dims = [int(x) for x in m.group(1).split(",")]
    ids = _device_ids(m.group(2), int(np.prod(dims))).reshape(dims)
    if "last_tile_dim_replicate" in s:
        groups = ids.reshape(-1, dims[-1])
        dims = dims[:-1]
    else:
        groups = ids.reshape(-1, 1)
    if len(dims) > 2:
        raise ValueError(f"xlatorch: visualize_sharding draws 1-D and 2-D shardings; this one has {len(dims)} dims")
    shape = (1, dims[0]) if len(dims) == 1 else (dims[0], dims[1])
    return shape, [[str(d) for d in g] for g in groups]


def visualize_sharding(sharding: str, use_color: bool = True, scale: float = 1.0, min_width: int = 9,
                       max_width: int = 80) -> str:  # fmt: skip
    """Print the tile grid of XLA's sharding text; returns what was printed. ``use_color`` and
    ``scale`` are torch_xla's (``rich``) and do not apply to the plain grid."""
    from xlatorch import runtime as xr

    (rows, cols), groups = tiles(sharding)
    kind = xr.device_type()
    labels = [f"{kind} {','.join(g)}" for g in groups]
    width = max(min_width, min(max_width // max(cols, 1) - 1, max(len(x) for x in labels) + 2))
    line = "+" + "+".join("-" * width for _ in range(cols)) + "+"
    out = [line]
    for r in range(rows):
        out.append("|" + "|".join(labels[r * cols + c].center(width) for c in range(cols)) + "|")
        out.append(line)
    text = "\n".join(out)
    print(text)
    return text


def construct_v1_sharding_str(t) -> str:
    """``t``'s sharding in XLA's explicit (V1) text: devices listed, not in iota form."""
    s = get_sharding_spec(t)
    m = re.search(r"devices=\[([\d,]+)\](<=[^\s}]+)", s)
    if m is None:
        return s
    dims = [int(x) for x in m.group(1).split(",")]
    ids = ",".join(str(int(i)) for i in _device_ids(m.group(2), int(np.prod(dims))))
    return s.replace(m.group(0), f"devices=[{m.group(1)}]{ids}")


def visualize_tensor_sharding(t, **kwargs) -> str:
    """Print ``t``'s tile grid over the devices (see ``visualize_sharding``)."""
    return visualize_sharding(construct_v1_sharding_str(t), **kwargs)
