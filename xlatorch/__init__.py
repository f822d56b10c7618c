"""xlatorch: PyTorch/XLA in Python. ``import xlatorch`` registers the ``xla`` device.

Ordinary PyTorch code on ``xlatorch.device()`` (or ``xm.xla_device()``) records ops
lazily; ``xlatorch.sync()`` compiles the pending graph with XLA through JAX (once per
graph structure) and runs it.
"""

from __future__ import annotations

import sys as _sys

if _sys.argv[:1] == ["-m"]:  # Python is locating a ``python -m`` module: if it is the compat runner,
    from xlatorch.compat import exec_if_runner  # it replaces this process with the user's program here

    exec_if_runner()

import contextlib
import functools
import gc
import importlib
import os

import jax

jax.config.update("jax_enable_x64", True)  # int64 / float64 are exact, as in PyTorch
from xlatorch import runtime as _xr  # noqa: E402

_xr._from_environment()  # PJRT_DEVICE=CPU|GPU|TPU
from xlatorch.runtime.lower import compile_cache  # noqa: E402

compile_cache.configure()  # before any compile: JAX's persistent cache lives in ours

import torch  # noqa: E402
import torch._decomp  # noqa: E402

# First, before any module builds a torch.device("xla"): until the rename, "xla" parses
# as the built-in XLA device type, which has no device guard here.
if torch._C._get_privateuse1_backend_name() != "xla":
    torch.utils.rename_privateuse1_backend("xla")

from xlatorch._generated import dispatch as _table  # noqa: E402
from xlatorch.runtime import device as _device  # noqa: E402
from xlatorch.runtime.trace.dispatch import DECOMPS as _DECOMPS  # noqa: E402
from xlatorch.runtime.trace.dispatch import SHIMS as _SHIMS  # noqa: E402
from xlatorch.runtime.trace.dispatch import decomposition as _decomposition  # noqa: E402

_SHIMS.update(_table.SHIMS)
_DECOMPS.update({op: _decomposition(op, _table.VALIDATE_DECOMPOSED.get(op, (None, None))) for op in _table.DECOMPOSED})
_device.install(_table.SPECS)
_device.check_runtime(_table.RUNTIME)
_device.register(_table.FACTORIES)
from xlatorch.runtime.trace import fx as _fx  # noqa: E402

_fx.SPECS.update({s.overload: s for s in _table.SPECS.values() if s.overload is not None})

import xlatorch.debug  # noqa: E402,F401  (the compile explainer, sync report and metrics hook into the runtime)
from xlatorch.amp import autocast_mode as _autocast  # noqa: E402
from xlatorch.core.compile_region import compile  # noqa: E402  (torch_xla.compile)
from xlatorch.debug import profiler as _profiler  # noqa: E402
from xlatorch.fallback import cpu as _fallback  # noqa: E402,F401  (ops with no lowering run on CPU)
from xlatorch.runtime.base import config as _config  # noqa: E402
from xlatorch.runtime.base import interrupts as _interrupts  # noqa: E402
from xlatorch.runtime.execute import serialization as _serialization  # noqa: E402,F401  (torch.load of device tensors)
from xlatorch.runtime.trace import loops as _loops  # noqa: E402

_loops.install()  # torch's while_loop and cond on xla tensors: one XLA loop / conditional
_autocast.install()  # torch.autocast("xla"): the policy table's kernels on AutocastPrivateUse1
_interrupts.install()  # Ctrl-C is raised in the user's code, not inside dispatch or a sync

_torch_compile = torch.compile


def _compile_with_xla_backends(*args, **kwargs):
    import xlatorch.dynamo  # noqa: F401  (backend="openxla" / "xlatorch"; Dynamo meets xla tensors)

    if kwargs.get("backend") in ("openxla", "xlatorch"):
        # XLA compiles one program per shape anyway: a new shape is a new static graph, not
        # a symbolic one (which could only run op by op).
        kwargs.setdefault("dynamic", False)
    return _torch_compile(*args, **kwargs)


torch.compile = functools.wraps(_torch_compile)(_compile_with_xla_backends)

_profiler._from_environment()  # XLATORCH_PROFILE=<dir>: capture the first steps

# The objects of torch, JAX and numpy (~240,000, alive for the whole process) leave the
# garbage collector's view: otherwise each full collection walks them all, and tracing
# and lowering a program's first step trigger several (measured: GPT's first trace
# 0.25 -> 0.07 s). XLATORCH_GC_FREEZE=0 keeps them collectable. First, the modules every
# program imports at its first step anyway (torch's own lazy imports: Dynamo at the first
# call of a ``_disable_dynamo`` wrapper, DTensor at the first copy to the device; JAX's MLIR
# dialects at the first lowering): imported later, their ~125,000 objects stayed in view and
# each full collection took 25-50 ms instead of 0.6 (measured after a first step).
if _config.env("XLATORCH_GC_FREEZE"):
    for _name in ("torch._dynamo", "torch.distributed.tensor", "jaxlib.mlir.dialects.mhlo"):
        try:
            importlib.import_module(_name)
        except ImportError:  # a torch built without distributed, another jaxlib: not frozen, that is all
            pass
    gc.freeze()

if _config.env("XLA_USE_SPMD"):  # torch_xla's switch: SPMD from the start, as xr.use_spmd() gives
    from xlatorch.runtime.base import topology as _topology

    _topology.start_spmd(join=False)

__version__ = "0.1.0"


def device(index: int | None = None) -> torch.device:
    """The ``xla`` device of this process (``xla:0``), or device ``index``."""
    from xlatorch.core.xla_model import xla_device

    return xla_device(index)


def sync(wait: bool = False) -> None:
    """Compile (once) and run everything pending on the device; the step boundary.

    Args:
      wait: block until the computation finishes (otherwise it runs asynchronously).
    """
    from xlatorch.core.xla_model import mark_step

    mark_step(wait=wait)


def launch(fn, args=(), start_method: str = "spawn", debug_single_process: bool = False) -> None:
    """Run ``fn(index, *args)`` on every device of the job (``index``: the global ordinal).

    Started by ``torchrun`` or with ``XLATORCH_RANK`` set: joins that job and calls ``fn``
    in this process. Otherwise spawns one process per device (``xmp.spawn``);
    ``debug_single_process`` runs one replica in this process.
    """
    from xlatorch.distributed import xla_multiprocessing as xmp
    from xlatorch.runtime.base import topology as distributed

    if _config.env("XLATORCH_RANK") is not None or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ):
        distributed.initialize()
        fn(distributed.global_ordinal(), *args)
        return
    xmp.spawn(fn, args=args, nprocs=1 if debug_single_process else None, start_method=start_method)


def devices() -> list[torch.device]:
    """Every xla device this process can address (``[device('xla:0')]`` with one)."""
    return [torch.device("xla", i) for i in range(torch.xla.device_count())]


def device_count() -> int:
    """How many xla devices this process can address."""
    return torch.xla.device_count()


def real_devices() -> list[str]:
    """The hardware devices behind the xla devices, as ``'CPU:0'``, ``'TPU:0'`` ..."""
    from xlatorch import runtime as xr

    return [f"{xr.device_type()}:{i}" for i in range(torch.xla.device_count())]


def manual_seed(seed: int, device=None) -> None:
    """Seed the device's random number generator (``xm.set_rng_state``)."""
    from xlatorch.core.xla_model import set_rng_state

    set_rng_state(seed, device)


@contextlib.contextmanager
def step():
    """A training step: what is pending is run on entry, the step's work on exit (``sync``),
    even when the body raises."""
    sync()
    try:
        yield
    finally:
        sync()


def __getattr__(name: str):
    # ``torch_xla.experimental.eager_mode(True)`` after a bare ``import torch_xla``: loaded on first use.
    # ``torch_xla.xm``: the xla_model module, as torch_xla's package exposes it.
    if name in ("experimental", "xm"):
        import importlib

        return importlib.import_module("xlatorch.experimental" if name == "experimental" else "xlatorch.core.xla_model")
    if name == "eager_mode":  # torch_xla.eager_mode(True): experimental.eager_mode, also at the top
        from xlatorch.experimental import eager_mode

        return eager_mode
    if name == "dist":  # torch.distributed, which torch_xla's package re-exports
        import torch.distributed as dist

        return dist
    raise AttributeError(f"module 'xlatorch' has no attribute {name!r}")


def set_custom_compile_options(options: dict) -> None:
    """XLA compiler options (fields of XLA's ``DebugOptions``) for every graph compiled from
    now on, replacing those set before; ``{}`` clears them. Part of each graph's cache key."""
    from xlatorch.runtime.base import regions

    regions.set_custom_options(options)


def save_as_stablehlo(exported_model, stablehlo_dir, options=None) -> None:
    """``xlatorch.stablehlo.save_as_stablehlo``: write a ``torch.export`` program as StableHLO files."""
    from xlatorch.stablehlo import save_as_stablehlo as save

    save(exported_model, stablehlo_dir, options)


def save_torch_model_as_stablehlo(torchmodel, args, path, options=None) -> None:
    """``xlatorch.stablehlo.save_torch_model_as_stablehlo``: export ``torchmodel`` on ``args`` and save it."""
    from xlatorch.stablehlo import save_torch_model_as_stablehlo as save

    save(torchmodel, args, path, options)


__all__ = ["device", "devices", "device_count", "real_devices", "manual_seed", "step", "sync", "launch", "compile",
           "set_custom_compile_options", "save_as_stablehlo", "save_torch_model_as_stablehlo"]  # fmt: skip
