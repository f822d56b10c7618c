"""torch_xla's ``_internal.pjrt`` launchers: ``run_multiprocess`` (a function on every device of
this host, its results by ordinal) and ``spawn``, on xlatorch's ``xmp.spawn``.

xlatorch runs one process per device (torch_xla runs one thread per CPU device inside one
process): ``run_multiprocess`` starts ``$CPU_NUM_DEVICES`` processes on CPU (else one per
local device), and in each ``xm.xla_device()`` is ``xla:0``.
"""

from __future__ import annotations

import os
import pickle
import tempfile

from xlatorch.distributed import xla_multiprocessing as xmp

__all__ = ["run_multiprocess", "spawn", "spawn_threads"]


def _run_and_keep(index: int, fn, args, kwargs, folder: str) -> None:
    result = fn(*args, **kwargs)
    from xlatorch.runtime.base import topology

    path = os.path.join(folder, f"{topology.global_ordinal()}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def run_multiprocess(fn, *args, start_method: str = "spawn", **kwargs) -> dict:
    """``fn(*args, **kwargs)`` in one process per device of this host; ``{global ordinal: result}``.

    Results travel by pickle (they must be picklable: move device tensors to CPU first). A
    worker that raises or dies makes this raise ``xmp.WorkerError`` (the others are stopped)."""
    from xlatorch.runtime.base import topology

    if topology._devices:
        raise RuntimeError("xlatorch: run_multiprocess after this process used the xla device: "
                           "start the processes before using the device")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="xlatorch-run-") as folder:
        xmp.spawn(_run_and_keep, args=(fn, args, kwargs, folder), start_method=start_method)
        out = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".pkl"):
                with open(os.path.join(folder, name), "rb") as f:
                    out[int(name[:-4])] = pickle.load(f)
    return out


def spawn(fn, nprocs=None, start_method: str = "spawn", args=()):
    """``xmp.spawn(fn, args, nprocs)``: ``fn(index, *args)`` in every process of the job."""
    return xmp.spawn(fn, args=args, nprocs=nprocs, start_method=start_method)


def spawn_threads(fn, args=()):
    """torch_xla runs ``fn`` in one thread per device of one process; xlatorch runs a replica
    per process: use ``xmp.spawn`` (or ``dp.DataParallel`` for threads)."""
    raise NotImplementedError("xlatorch: pjrt.spawn_threads (a replica per thread) is not supported: "
                              "use xmp.spawn, one process per device, or dp.DataParallel")  # fmt: skip
