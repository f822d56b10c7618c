"""FSDP across processes (``torch_xla.distributed.fsdp``): each replica keeps 1/N of every
parameter and of the optimizer state; parameters are all-gathered around each unit's forward
and backward, gradients reduce-scattered. See docs/processes-and-spmd.md."""

from xlatorch.distributed.fsdp.state_dict_utils import (
    consolidate_sharded_model_checkpoints,
    consolidate_sharded_state_dicts,
)
from xlatorch.distributed.fsdp.utils import checkpoint_module
from xlatorch.distributed.fsdp.xla_fully_sharded_data_parallel import XlaFullyShardedDataParallel

FullyShardedDataParallel = XlaFullyShardedDataParallel

__all__ = ["XlaFullyShardedDataParallel", "FullyShardedDataParallel", "consolidate_sharded_state_dicts",
           "consolidate_sharded_model_checkpoints", "checkpoint_module"]  # fmt: skip
