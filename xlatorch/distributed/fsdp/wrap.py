"""Auto-wrap policies (``torch_xla.distributed.fsdp.wrap``).

A policy is ``policy(module, recurse, unwrapped_params) -> bool``: with ``recurse=True`` it says
whether to look inside ``module`` for children to wrap; with ``recurse=False``, whether to wrap
``module`` itself (holding ``unwrapped_params`` parameters not yet wrapped below it).
``recursive_wrap`` walks a module tree with one and wraps bottom-up, so inner units are wrapped
before the units that hold them (FSDP needs its children wrapped first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "recursive_wrap"]  # fmt: skip


def always_wrap_policy(*args, **kwargs) -> bool:
    """Wrap every submodule (and look inside every one)."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, lambda_fn: Callable) -> bool:
    """Look inside everything; wrap the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                 transformer_layer_cls: set) -> bool:  # fmt: skip
    """Look inside everything; wrap each instance of one of ``transformer_layer_cls`` (a
    transformer block) as its own unit. What is left goes to the outer wrapper."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set | None = None,
                                exclude_wrap_modules: set | None = None) -> bool:  # fmt: skip
    """Wrap a module once it holds at least ``min_num_params`` unwrapped parameters.

    Modules of ``force_leaf_modules`` (default ``{nn.MultiheadAttention}``, whose forward reads
    its weights directly) are never looked inside; ``exclude_wrap_modules`` (default
    ``{nn.ModuleList, nn.ModuleDict}``, which have no forward) are never wrapped.
    """
    leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    exclude = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    if unwrapped_params < min_num_params:
        return False
    return not isinstance(module, tuple(leaves) if recurse else tuple(exclude))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}


def recursive_wrap(module: nn.Module, auto_wrap_policy: Callable, wrapper_cls: Callable,
                   ignored_modules=(), ignored_params=(), only_wrap_children: bool = False,
                   **kwargs: Any) -> tuple[nn.Module, int]:  # fmt: skip
    """Wrap ``module``'s subtree with ``wrapper_cls(child, **kwargs)`` where the policy says so.

    Returns (the module, wrapped or not; how many parameters were wrapped in its subtree).
    ``only_wrap_children``: never wrap ``module`` itself (the caller is its wrapper).
    """
    ignored_modules, ignored = set(ignored_modules), {id(p) for p in ignored_params}
    total = sum(p.numel() for p in module.parameters() if id(p) not in ignored)
    if not auto_wrap_policy(module=module, recurse=True, unwrapped_params=total):
        return module, 0
    wrapped = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        new, n = recursive_wrap(child, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_params, **kwargs)
        if new is not child:
            setattr(module, name, new)
        wrapped += n
    if not only_wrap_children and auto_wrap_policy(module=module, recurse=False, unwrapped_params=total - wrapped):
        overrides = getattr(module, "_wrap_overrides", {})
        return wrapper_cls(module, **{**kwargs, **overrides}), total
    return module, wrapped
