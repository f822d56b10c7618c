"""``torch_xla.experimental.distributed_checkpoint``: ``torch.distributed.checkpoint`` for
device tensors, sharded (SPMD) or not.

- ``SPMDSavePlanner`` / ``SPMDLoadPlanner``: planners for ``dist_cp.save`` / ``dist_cp.load``;
  each process writes and reads only the blocks of a sharded tensor that its devices hold, and
  a checkpoint loads onto any mesh or sharding (``planners.py``);
- ``CheckpointManager``: periodic checkpoints by step, kept up to ``max_to_keep``, written in the
  background by ``save_async``, each committed atomically (``manager.py``);
- ``prime_optimizer``: optimizer state to load into (``util.py``);
- ``CheckedFileSystemWriter`` / ``CheckedFileSystemReader`` (xlatorch's): the file layout of
  PyTorch's, plus a CRC-32 per item; damaged checkpoints raise ``CheckpointCorruptError``
  naming the file (``storage.py``).
"""

from xlatorch.experimental.distributed_checkpoint.manager import CheckpointManager
from xlatorch.experimental.distributed_checkpoint.planners import SPMDLoadPlanner, SPMDSavePlanner
from xlatorch.experimental.distributed_checkpoint.storage import (
    CheckedFileSystemReader,
    CheckedFileSystemWriter,
    CheckpointCorruptError,
)
from xlatorch.experimental.distributed_checkpoint.util import prime_optimizer

__all__ = ["CheckpointManager", "SPMDSavePlanner", "SPMDLoadPlanner", "prime_optimizer",
           "CheckedFileSystemWriter", "CheckedFileSystemReader", "CheckpointCorruptError"]  # fmt: skip
