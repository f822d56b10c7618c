"""Replica-level operations. One process, one replica until multi-process lands (issue 5)."""

from __future__ import annotations


def world_size() -> int:
    return 1


def global_ordinal() -> int:
    return 0


def local_ordinal() -> int:
    return 0


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Average gradients across replicas; with a single replica they are already the average."""
    if world_size() == 1:
        return
    raise NotImplementedError("multi-replica gradient reduction lands with multi-process training")
