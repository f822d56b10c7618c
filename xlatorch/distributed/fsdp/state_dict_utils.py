"""Whole-model state dicts from FSDP's sharded ones.

Each rank's ``model.state_dict()`` holds its shard of every parameter, under
``<fsdp unit path>._fsdp_shard_FSDP_SHARD_SEPARATOR_<original path with '.' spelled that way>``,
and the full buffers. ``model.get_shard_metadata()`` says, per unit, each shard's original
name and size, and for flattened units how the flat vector splits into parameters. Stitching
is: concatenate the ranks' shards in rank order, drop the padding, reshape, unflatten, and
drop the wrappers' path components (``_fsdp_wrapped_module``, and torch_xla's
``_fpw_module``) so that the keys are the unwrapped model's.
"""

from __future__ import annotations

import glob
import math
from collections import OrderedDict

import torch

__all__ = ["consolidate_sharded_state_dicts", "consolidate_sharded_model_checkpoints"]

_SHARD = "_fsdp_shard"
_WRAPPERS = ("_fsdp_wrapped_module.", "_fpw_module.")


def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _split_shard_key(key: str) -> tuple[str, str] | None:
    """(unit path, shard parameter name) of a sharded key, None for anything else."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.startswith(_SHARD):
            return ".".join(parts[:i]), ".".join(parts[i:])
    return None


def consolidate_sharded_state_dicts(state_dict_list, shard_metadata) -> OrderedDict:
    """The unwrapped model's full state dict from every rank's FSDP ``state_dict()``.

    Args:
      state_dict_list: one ``model.state_dict()`` per rank, in rank order.
      shard_metadata: ``model.get_shard_metadata()`` of any rank.
    """
    if len(state_dict_list) != shard_metadata["world_size"]:
        raise ValueError(f"{len(state_dict_list)} state dicts for a world of {shard_metadata['world_size']} ranks")
    buffer_info = shard_metadata.get("buffer_info", {})
    full: OrderedDict = OrderedDict()
    for key, value in state_dict_list[0].items():
        where = _split_shard_key(key)
        if where is None:  # a buffer: whole on every rank
            if key in buffer_info:
                value = value.to(buffer_info[key]["_orig_dtype"])
            full[key] = value
            continue
        prefix, shard_name = where
        info = shard_metadata["shard_info"][prefix][shard_name]
        size = torch.Size(info["_orig_size"])
        cat = torch.cat([sd[key] for sd in state_dict_list], dim=0)
        if cat.dim() == 1:  # flattened and padded
            value = cat[: math.prod(size)].reshape(size)
        else:  # sharded along dim 0 (shard_param_on_dim_0)
            value = cat[: size[0]]
        full[_join(prefix, info["_orig_name"])] = value
    for name, (names, shapes, numels) in shard_metadata.get("flatten_info", {}).items():
        if name not in full:
            continue
        flat = full.pop(name)
        prefix = name.rpartition(".")[0]
        for n, s, t in zip(names, shapes, flat.split(list(numels))):
            full[_join(prefix, n)] = t.reshape(s)
    return OrderedDict((_clean(k), v) for k, v in full.items())


def consolidate_sharded_model_checkpoints(ckpt_prefix: str, ckpt_suffix: str = "*.pth", save_path: str = "",
                                          save_model: bool = True):  # fmt: skip
    """Stitch the files ``ckpt_prefix + ckpt_suffix`` (a glob; one per rank, each a dict with
    ``"model"``: the FSDP ``state_dict()`` and ``"shard_metadata"``: ``get_shard_metadata()``)
    into one state dict of the unwrapped model.

    Returns ``(full_state_dict, path)``; with ``save_model`` the dict is also saved as
    ``{"model": full_state_dict}`` to ``save_path`` (default ``ckpt_prefix + "_consolidated.pth"``),
    else ``path`` is None.
    """
    paths = glob.glob(ckpt_prefix + ckpt_suffix)
    if not paths:
        raise FileNotFoundError(f"no checkpoint files match {ckpt_prefix + ckpt_suffix}")
    ckpts = sorted((torch.load(p, map_location="cpu", weights_only=False) for p in paths),
                   key=lambda c: c["shard_metadata"]["rank"])  # fmt: skip
    ranks = [c["shard_metadata"]["rank"] for c in ckpts]
    world = ckpts[0]["shard_metadata"]["world_size"]
    if ranks != list(range(world)):
        raise ValueError(f"files matching {ckpt_prefix + ckpt_suffix} hold ranks {ranks}; expected one file for "
                         f"each of the {world} ranks")  # fmt: skip
    full = consolidate_sharded_state_dicts([c["model"] for c in ckpts], ckpts[0]["shard_metadata"])
    path = None
    if save_model:
        path = save_path or ckpt_prefix + "_consolidated.pth"
        torch.save({"model": full}, path)
        print(f"saved consolidated model to {path}")
    return full, path
