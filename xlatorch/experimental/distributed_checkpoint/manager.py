"""``CheckpointManager``: periodic distributed checkpoints of a training run, kept by step,
written in the background if asked, each committed whole or not at all.

Layout under ``path``: one directory per step (``<path>/<step>/``), holding PyTorch's
distributed-checkpoint files, ``.checksums`` and ``.manager_metadata`` (the step and when it
was taken, JSON). A checkpoint is written into ``<path>/.<step>.tmp/`` and renamed to
``<path>/<step>`` only once every process's data, ``.metadata`` and ``.manager_metadata`` are
on disk (fsynced): a crash or a failed save leaves at most a hidden temporary directory, which
the next manager removes, never a step directory that ``all_steps`` lists or ``restore`` reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint.api import CheckpointException

import xlatorch.core.xla_model as xm
import xlatorch.runtime as xr
from xlatorch.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict
from xlatorch.experimental.distributed_checkpoint.planners import SPMDLoadPlanner, SPMDSavePlanner
from xlatorch.experimental.distributed_checkpoint.storage import (
    CheckedFileSystemReader,
    CheckedFileSystemWriter,
    CheckpointCorruptError,
)
from xlatorch.runtime.base import preemption
from xlatorch.runtime.execute.serialization import atomic_write, fsync_dir

__all__ = ["CheckpointManager"]

_MANAGER_METADATA_FILE = ".manager_metadata"
_log = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints taken every ``save_interval`` steps into ``path``, one directory per step.

    Args:
      path: the directory holding the checkpoints (created if missing).
      save_interval: take a checkpoint when ``step % save_interval == 0``.
      max_to_keep: keep at most this many checkpoints, deleting the oldest taken (by time,
        not step) after each save; 0 keeps all.
      max_pending_async: how many ``save_async`` checkpoints may be in flight; one more
        waits for the oldest to finish.
      num_of_threads: threads writing each process's files (one file per thread).
      process_group: the CPU process group (gloo) that coordinates the processes of a
        multi-process job; default: a new gloo group over ``torch.distributed``'s default
        group if one is initialized, else none (one process).
      chkpt_on_preemption: also take a checkpoint at the first step after this process
        receives ``SIGTERM`` (and, with a process group, after any process of it does).

    ``save`` / ``save_async`` / ``restore`` must be called by every process of the job,
    with the same step, as ``torch.distributed.checkpoint`` requires.
    """

    def __init__(self, path: str, save_interval: int, max_to_keep: int = 0, max_pending_async: int = 1,
                 num_of_threads: int = 1, process_group=None, chkpt_on_preemption: bool = True):  # fmt: skip
        if save_interval <= 0:
            raise ValueError("xlatorch: save_interval must be positive")
        if max_pending_async <= 0:
            raise ValueError("xlatorch: max_pending_async must be positive")
        if max_to_keep < 0:
            raise ValueError("xlatorch: max_to_keep must be 0 (keep all) or positive")
        self.base_path = os.fspath(path)
        self.save_interval = save_interval
        self.max_to_keep = max_to_keep
        self.chkpt_on_preemption = chkpt_on_preemption
        self.num_of_threads = num_of_threads
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.new_group(backend="gloo")  # dist_cp's collectives are host objects
        elif process_group is None and xr.process_count() > 1:
            raise RuntimeError("xlatorch: a multi-process job's CheckpointManager needs a CPU process group: "
                               "dist.init_process_group('gloo', init_method='xla://') first")  # fmt: skip
        self.pg = process_group
        # Preemption notices are agreed on in a group of their own: a background save's
        # collectives on ``pg`` must never interleave with the training thread's.
        multi = process_group is not None and dist.get_world_size(process_group) > 1
        self._notice_pg = dist.new_group(backend="gloo") if multi and chkpt_on_preemption else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xlatorch-checkpoint")
        self._async_sem = threading.Semaphore(max_pending_async)
        self._async_futures: list = []
        self._save_mutex = threading.Lock()
        if self._rank() == 0:
            os.makedirs(self.base_path, exist_ok=True)
            self._remove_temporaries()
        self._barrier()
        self._tracked = self._load_tracked()
        if chkpt_on_preemption:
            preemption.activate()

    # --- where checkpoints live ---------------------------------------------------------

    def _rank(self) -> int:
        return dist.get_rank(self.pg) if self.pg is not None else 0

    def _barrier(self) -> None:
        if self.pg is not None and dist.get_world_size(self.pg) > 1:
            dist.barrier(group=self.pg)

    def _get_path(self, step: int) -> str:
        return os.path.join(self.base_path, str(step))

    def _temp_path(self, step: int) -> str:
        return os.path.join(self.base_path, f".{step}.tmp")

    def _remove_temporaries(self) -> None:
        for name in os.listdir(self.base_path):
            if name.startswith(".") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.base_path, name), ignore_errors=True)

    def _load_tracked(self) -> list[dict]:
        """Every committed checkpoint under the base path, oldest first."""
        found, invalid = [], []
        for name in os.listdir(self.base_path):
            full = os.path.join(self.base_path, name)
            if name.startswith(".") or not os.path.isdir(full):
                continue
            try:
                with open(os.path.join(full, _MANAGER_METADATA_FILE)) as f:
                    md = json.load(f)
                found.append({"step": int(md["step"]), "ts": float(md["ts"])})
            except Exception:
                invalid.append(full)
        if invalid:
            _log.warning("xlatorch: ignoring directories that are not committed checkpoints: %s", invalid)
        return sorted(found, key=lambda m: m["ts"])

    def _delete_step(self, step: int) -> None:
        if self._rank() == 0:
            path = self._get_path(step)
            if os.path.exists(path):
                # Renamed first: a crash mid-delete leaves a temporary, never half a checkpoint.
                doomed = os.path.join(self.base_path, f".{step}.deleted.tmp")
                shutil.rmtree(doomed, ignore_errors=True)
                os.replace(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        self._tracked = [m for m in self._tracked if m["step"] != step]

    def _release_oldest(self) -> None:
        if self.max_to_keep > 0:
            while len(self._tracked) > self.max_to_keep:
                self._delete_step(self._tracked[0]["step"])

    # --- saving ---------------------------------------------------------------------------

    def _save(self, step: int, state_dict) -> None:
        """Write ``state_dict`` as the checkpoint of ``step`` and commit it (every process)."""
        with self._save_mutex:
            tmp = self._temp_path(step)
            if self._rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            self._barrier()
            try:
                writer = CheckedFileSystemWriter(tmp, thread_count=self.num_of_threads)
                dist_cp.save(state_dict=state_dict, storage_writer=writer, planner=SPMDSavePlanner(),
                             process_group=self.pg)  # fmt: skip
            except BaseException:
                if self._rank() == 0:  # dist_cp failed on every process: nobody writes there now
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            md = {"step": step, "ts": time.time()}
            if self._rank() == 0:
                data = json.dumps(md).encode()
                atomic_write(os.path.join(tmp, _MANAGER_METADATA_FILE), lambda f: f.write(data))
                fsync_dir(tmp)
                if os.path.exists(self._get_path(step)):
                    self._delete_step(step)
                os.replace(tmp, self._get_path(step))  # the commit
                fsync_dir(self.base_path)
            self._tracked = [m for m in self._tracked if m["step"] != step] + [md]
            self._release_oldest()
            self._barrier()

    def should_save(self, step: int) -> bool:
        """Whether ``step`` takes a checkpoint: it is a multiple of ``save_interval``, or a
        preemption (``SIGTERM``) was seen and ``chkpt_on_preemption`` is set."""
        if self.chkpt_on_preemption and self.reached_preemption(step):
            _log.warning("xlatorch: preemption seen at step %d: taking a checkpoint", step)
            return True
        return step % self.save_interval == 0

    def save(self, step: int, state_dict, force: bool = False) -> bool:
        """Take a checkpoint of ``state_dict`` now if ``should_save(step)`` (or ``force``).

        Syncs pending values, then each process writes the blocks it owns (see
        ``SPMDSavePlanner``). Returns whether a checkpoint was taken."""
        if not (force or self.should_save(step)):
            return False
        xm.mark_step()
        self._save(step, state_dict)
        return True

    def save_async(self, step: int, state_dict, force: bool = False) -> bool:
        """Like ``save``, but only the copy to host memory happens now: the blocks this process
        owns are downloaded (one sync first if anything is pending), then written and committed
        by a background thread while training goes on. Waits first if ``max_pending_async``
        checkpoints are still being written. ``all_steps`` lists the step once it is committed."""
        if not (force or self.should_save(step)):
            return False
        xm.mark_step()
        snapshot = _sharded_cpu_state_dict(state_dict)
        self._async_sem.acquire()
        future = self._pool.submit(self._save_logged, step, snapshot)
        future.add_done_callback(lambda _: self._async_sem.release())
        self._async_futures.append(future)
        return True

    def _save_logged(self, step, snapshot) -> None:
        try:
            self._save(step, snapshot)
        except BaseException:
            _log.exception("xlatorch: the asynchronous checkpoint of step %d failed (nothing was committed)", step)
            raise

    def join(self) -> None:
        """Wait for every pending ``save_async``; raise the first one's error, if any failed."""
        futures, self._async_futures = self._async_futures, []
        wait(futures)
        for f in futures:
            f.result()

    # --- restoring ------------------------------------------------------------------------

    def restore(self, step: int, state_dict) -> None:
        """Load the checkpoint of ``step`` into ``state_dict`` in place (device tensors keep
        their sharding; see ``SPMDLoadPlanner``). Call ``model.load_state_dict`` after it for
        values that are not tensors. A damaged or incomplete checkpoint raises
        ``CheckpointCorruptError`` naming the file."""
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(f"xlatorch: no checkpoint of step {step} under {self.base_path}; tracked: {steps}")
        reader = CheckedFileSystemReader(self._get_path(step))
        reader.read_metadata()  # a missing or damaged .metadata raises here, naming it
        try:
            dist_cp.load(state_dict=state_dict, storage_reader=CheckedFileSystemReader(self._get_path(step)),
                         planner=SPMDLoadPlanner(), process_group=self.pg)  # fmt: skip
        except CheckpointException as e:
            for err in _errors(e):
                if isinstance(err, CheckpointCorruptError):
                    raise CheckpointCorruptError(str(err)) from e
            raise

    def all_steps(self) -> list[int]:
        """Every step with a committed checkpoint, ascending."""
        return sorted(m["step"] for m in self._tracked)

    # --- preemption -----------------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption (``SIGTERM``, here or on any process of the group) was seen.
        With a process group of several processes this is a small collective: every process
        must call it at the same steps (``save`` does)."""
        if not self.chkpt_on_preemption:
            raise RuntimeError("xlatorch: preemption detection is off: create the CheckpointManager with "
                               "chkpt_on_preemption=True")  # fmt: skip
        seen = preemption.reached(step)
        if self._notice_pg is not None:
            import torch

            flag = torch.tensor([int(seen)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._notice_pg)
            seen = bool(flag.item())
        return seen


def _errors(e: CheckpointException) -> list:
    out = []
    for v in getattr(e, "failures", {}).values():
        with contextlib.suppress(Exception):
            out.append(v[0] if isinstance(v, tuple) else v)
    return out
