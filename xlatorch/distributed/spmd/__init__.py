"""``xs``: SPMD sharding annotations (``torch_xla.distributed.spmd``), partitioned by XLA through JAX."""

from xlatorch.distributed.spmd.api import auto_policy, xla_distribute_module, xla_distribute_tensor
from xlatorch.distributed.spmd.fsdp import SpmdFullyShardedDataParallel
from xlatorch.distributed.spmd.xla_sharding import (
    HybridMesh,
    Mesh,
    ShardingSpec,
    ShardingType,
    XLAPatchedLinear,
    XLAShard,
    XLAShardedTensor,
    annotate_custom_sharding,
    apply_backward_optimization_barrier,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_1d_mesh,
    get_global_mesh,
    get_sharding_spec,
    mark_sharding,
    mark_sharding_with_gradients,
    set_global_mesh,
    shard_as,
    wrap_if_sharded,
    xla_patched_nn_linear_forward,
)

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "set_global_mesh", "get_global_mesh", "mark_sharding",
           "clear_sharding", "get_sharding_spec", "XLAShard", "XLAShardedTensor", "ShardingSpec",
           "enable_manual_sharding", "disable_manual_sharding", "SpmdFullyShardedDataParallel", "ShardingType",
           "mark_sharding_with_gradients", "auto_policy", "xla_patched_nn_linear_forward", "XLAPatchedLinear",
           "wrap_if_sharded", "shard_as", "annotate_custom_sharding", "xla_distribute_tensor", "xla_distribute_module",
           "apply_backward_optimization_barrier"]  # fmt: skip
