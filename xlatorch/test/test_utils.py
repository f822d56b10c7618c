"""``torch_xla.test.test_utils``: what torch_xla's example training scripts import to report
progress (TensorBoard summaries, timestamps, training updates) and to isolate tests."""

from __future__ import annotations

import multiprocessing
import unittest
from datetime import datetime

from xlatorch import runtime as xr
from xlatorch.debug import metrics as met

__all__ = ["mp_test", "write_to_summary", "close_summary_writer", "get_summary_writer", "now",
           "print_training_update", "print_test_update"]  # fmt: skip


def mp_test(func):
    """Wrap a test so that it runs in a child process (a ``unittest.TestCase`` method asserts
    that the child exited with 0); returns the child's exit code."""

    def wrapper(*args, **kwargs):
        proc = multiprocessing.Process(target=func, args=args, kwargs=kwargs)
        proc.start()
        proc.join()
        if args and isinstance(args[0], unittest.TestCase):
            args[0].assertEqual(proc.exitcode, 0)
        return proc.exitcode

    return wrapper


def write_to_summary(summary_writer, global_step=None, dict_to_write=None, write_xla_metrics: bool = False) -> None:
    """Add each ``dict_to_write`` item as a scalar to a TensorBoard ``SummaryWriter`` (None:
    nothing); ``write_xla_metrics``: also every counter of ``met`` and ``aten_ops_sum``, the
    sum of the ``aten::`` counters (CPU fallbacks)."""
    if summary_writer is None:
        return
    for k, v in (dict_to_write or {}).items():
        summary_writer.add_scalar(k, v, global_step)
    if write_xla_metrics:
        aten = 0
        for name in met.counter_names():
            value = met.counter_value(name)
            if name.startswith("aten::"):
                aten += value
            summary_writer.add_scalar(name, value, global_step)
        summary_writer.add_scalar("aten_ops_sum", aten, global_step)


def close_summary_writer(summary_writer) -> None:
    """Flush and close ``summary_writer`` (None: nothing)."""
    if summary_writer is not None:
        summary_writer.flush()
        summary_writer.close()


def get_summary_writer(logdir):
    """A TensorBoard ``SummaryWriter`` writing to ``logdir`` (tensorboardX, else
    ``torch.utils.tensorboard``), or None when ``logdir`` is empty."""
    if not logdir:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(log_dir=logdir)
    writer.add_text("log_dir", logdir, 0)
    return writer


def now(format: str = "%H:%M:%S") -> str:
    """The local time, as ``format``."""
    return datetime.now().strftime(format)


def _device_spec(device) -> str:
    return f"{device}/{xr.global_ordinal()}"


def print_training_update(device, step_num, loss, rate, global_rate, epoch=None, summary_writer=None) -> None:
    """Print one training progress line (device/ordinal, epoch, step, loss, rates, time).
    Reading ``loss`` syncs when it is a pending tensor; call it from a step closure."""
    update = [f"Training Device={_device_spec(device)}", f"Epoch={epoch}" if epoch is not None else None,
              f"Step={step_num}", f"Loss={float(loss):.5f}", f"Rate={rate:.2f}", f"GlobalRate={global_rate:.2f}",
              f"Time={now()}"]  # fmt: skip
    print("|", " ".join(u for u in update if u), flush=True)
    if summary_writer is not None:
        write_to_summary(summary_writer, dict_to_write={"examples/sec": rate})


def print_test_update(device, accuracy, epoch=None, step=None) -> None:
    """Print one evaluation line (device/ordinal, epoch, step, accuracy, time)."""
    update = [f"Test Device={_device_spec(device)}", f"Step={step}" if step is not None else None,
              f"Epoch={epoch}" if epoch is not None else None,
              f"Accuracy={accuracy:.2f}" if accuracy is not None else None, f"Time={now()}"]  # fmt: skip
    print("|", " ".join(u for u in update if u), flush=True)
