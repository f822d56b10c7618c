"""``xs``: SPMD sharding annotations (``torch_xla.distributed.spmd``), partitioned by XLA through JAX."""

from xlatorch.distributed.spmd.fsdp import SpmdFullyShardedDataParallel
from xlatorch.distributed.spmd.xla_sharding import (
    HybridMesh,
    Mesh,
    ShardingSpec,
    ShardingType,
    XLAShard,
    XLAShardedTensor,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_1d_mesh,
    get_global_mesh,
    get_sharding_spec,
    mark_sharding,
    mark_sharding_with_gradients,
    set_global_mesh,
)

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "set_global_mesh", "get_global_mesh", "mark_sharding",
           "clear_sharding", "get_sharding_spec", "XLAShard", "XLAShardedTensor", "ShardingSpec",
           "enable_manual_sharding", "disable_manual_sharding", "SpmdFullyShardedDataParallel", "ShardingType",
           "mark_sharding_with_gradients"]  # fmt: skip
