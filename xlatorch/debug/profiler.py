"""``xp``: profiling an xlatorch program (``torch_xla.debug.profiler``), built on JAX's profiler.

Profiling
---------
One line captures a trace of the first five steps (``mark_step``s) of a program::

    XLATORCH_PROFILE=/tmp/trace python train.py          # XLATORCH_PROFILE_STEPS=10:13 for steps 10-12

or, in code, of whatever runs inside the block::

    import xlatorch.debug.profiler as xp
    with xp.trace("/tmp/trace"):
        for step in range(3):
            with xp.StepTrace("train", step_num=step):   # a step span; mark_step at its end
                train_step()

A capture writes ``<dir>/plugins/profile/<timestamp>/``: ``perfetto_trace.json.gz`` (open it
at ui.perfetto.dev, or load it with ``json``/``gzip``), ``<host>.trace.json.gz`` (the same
events with metadata) and ``<host>.xplane.pb`` (for TensorBoard or XProf:
``pip install xprof; xprof --logdir /tmp/trace``, or ``tensorboard --logdir /tmp/trace`` with
``tensorboard-plugin-profile``). Nothing beyond jax is needed to capture.

The host timeline shows xlatorch's phases as spans: ``xlatorch.trace`` (host time between
syncs: recording ops and the user's Python), ``xlatorch.mark_step``, ``xlatorch.sync``
(graph cutting and hashing; its ``reason`` is an argument), ``xlatorch.compile`` (lowering
and XLA compilation, on a cache miss), ``xlatorch.execute`` (dispatching the executable: it
runs asynchronously, so its device time is in XLA's own events, e.g. one per fused kernel on
CPU), ``xlatorch.transfer_to_device`` / ``xlatorch.transfer_from_device``, and the user's
``xp.Trace`` / ``xp.StepTrace`` spans. Every emitted HLO op carries the ATen op it came from
in its ``op_name`` metadata (``jit(...)/aten::mm/dot_general``), which TensorBoard/XProf's
op views show; on CPU the device events are named after XLA's fused kernels.

``xp.start_server(9012)`` lets TensorBoard/XProf's "Capture profile" sample the running
program instead. Not profiling costs one flag check per sync and per transfer, and nothing
per op.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import tempfile
import threading
import time

import jax

from xlatorch.runtime.base import config, record
from xlatorch.runtime.lower.executable import NEWEST

__all__ = [
    "start_trace", "stop_trace", "trace", "trace_detached", "trace_steps", "Trace", "StepTrace",
    "start_server", "stop_server", "trace_me", "set_tracer_marked_step", "get_tracer_marked_step",
]  # fmt: skip

# True while the runtime should emit spans: a trace is running or scheduled, or a profiler
# server may start one. graph.sync, mark_step and transfers read it once each.
ACTIVE = False

_is_enabled = jax.profiler.TraceAnnotation.is_enabled  # is a capture running (~30 ns; a span ~400 ns)
_tls = threading.local()  # per thread: ``window`` (the open xlatorch.trace span), ``depth``
_lock = threading.RLock()


class _State:
    log_dir: str | None = None  # of the running capture
    server = None
    server_port: int | None = None
    schedule: tuple | None = None  # trace_steps' (log_dir, start step, stop step, options)
    steps = 0  # mark_steps seen since trace_steps was called
    exit_hook = False


_state = _State()


def _refresh() -> None:
    global ACTIVE
    ACTIVE = _state.log_dir is not None or _state.server is not None or _state.schedule is not None
    # What the runtime times with, and its sync/step spans (xlatorch.runtime.base.record).
    record.TIMED = timed if ACTIVE else record.timed
    record.PHASE = phase if ACTIVE else None


# --- spans ---------------------------------------------------------------------------------


def _begin(name: str, **kwargs):
    """An open span, or None when nothing is being captured (no span object at all then)."""
    if not _is_enabled():
        return None
    span = jax.profiler.TraceAnnotation(name, **kwargs)
    span.__enter__()
    return span


def _end(span) -> None:
    if span is not None:
        span.__exit__(None, None, None)


def _close_window() -> None:
    w = getattr(_tls, "window", None)
    if w is not None:
        _tls.window = None
        _end(w)


def _open_window() -> None:
    # The time between two of xlatorch's host phases on this thread: op tracing and user code.
    if getattr(_tls, "window", None) is None:
        _tls.window = _begin("xlatorch.trace")


@contextlib.contextmanager
def phase(name: str, **kwargs):
    """A span for one of xlatorch's host phases (sync, mark_step). Outermost phases close the
    thread's ``xlatorch.trace`` window and reopen it after, so spans always nest."""
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        _close_window()
    _tls.depth = depth + 1
    span = _begin(name, **kwargs)
    try:
        yield
    finally:
        _end(span)
        _tls.depth = depth
        if depth == 0:
            _open_window()


_SPANS = {
    "CompileTime": "xlatorch.compile",
    "ExecuteDispatchTime": "xlatorch.execute",
    "TransferToDeviceTime": "xlatorch.transfer_to_device",
    "TransferFromDeviceTime": "xlatorch.transfer_from_device",
}


def _memory_args(exe) -> dict:
    """A graph's memory figures as span arguments (bytes; ``new``: outputs not aliased plus
    temporaries, what a run allocates)."""
    m = getattr(exe, "memory", None)
    if m is None:
        return {}
    return {"graph": exe.gid, "argument_bytes": m.argument, "output_bytes": m.output, "alias_bytes": m.alias,
            "temp_bytes": m.temp, "generated_code_bytes": m.code, "new_bytes": m.new}  # fmt: skip


class timed(record.timed):
    """``record.timed`` that is also a span of the same extent (``CompileTime`` ->
    ``xlatorch.compile`` ...): the runtime uses it instead while ``ACTIVE``. The compile and
    execute spans carry the graph's memory figures (``_memory_args``)."""

    __slots__ = ("span",)

    def __enter__(self):
        name = _SPANS[self.name]
        if name == "xlatorch.execute":  # the executable checked just before it runs
            self.span = _begin(name, **_memory_args(NEWEST[1]))
        else:
            self.span = _begin(name)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.span is not None and self.name == "CompileTime" and not exc[0]:
            args = _memory_args(NEWEST[0])  # the executable this compile made
            if args:
                self.span.set_metadata(**args)
        _end(self.span)


def _on_step() -> None:
    """After each ``mark_step`` (a ``record.STEP_HOOKS`` hook): counts the step for ``trace_steps``."""
    if _state.schedule is not None:
        _state.steps += 1
        _advance_schedule()


class Trace:
    """A user annotation: a span named ``name`` on the host timeline while the block runs.

    Args:
      name: the span's name.
      **kwargs: shown as the span's arguments (e.g. ``batch=3``).

    Example::

        with xp.Trace("forward"):
            loss = model(x)
    """

    _annotation = jax.profiler.TraceAnnotation

    def __init__(self, name: str, **kwargs):
        self.name = name
        self.kwargs = kwargs
        self._span = None

    def __enter__(self):
        if _is_enabled():  # any capture, xp's or not
            # Pause xlatorch.trace around the boundary so the two spans nest (it resumes inside).
            outer = getattr(_tls, "depth", 0) == 0
            if outer:
                _close_window()
            self._span = self._annotation(self.name, **self.kwargs)
            self._span.__enter__()
            if outer:
                _open_window()
        return self

    def __exit__(self, *exc):
        span, self._span = self._span, None
        if span is not None:
            outer = getattr(_tls, "depth", 0) == 0
            if outer:
                _close_window()
            span.__exit__(None, None, None)
            if outer:
                _open_window()


class StepTrace(Trace):
    """A training step: a step span (TensorBoard/XProf's per-step analysis uses it) that ends
    with ``xm.mark_step()``, as in torch_xla.

    Args:
      name: the span's name (e.g. ``"train_step"``).
      step_num: the step's number, shown with the span.
      **kwargs: further span arguments.
    """

    _annotation = jax.profiler.StepTraceAnnotation

    def __init__(self, name: str, step_num: int | None = None, **kwargs):
        if step_num is not None:
            kwargs["step_num"] = step_num
        super().__init__(name, **kwargs)

    def __exit__(self, *exc):
        if exc[0] is None:
            from xlatorch.core import xla_model as xm

            xm.mark_step()
        super().__exit__(*exc)


# --- captures ------------------------------------------------------------------------------


def start_trace(log_dir: str | os.PathLike, *, create_perfetto_trace: bool = True,
                python_tracer_level: int = 0, host_tracer_level: int = 2) -> None:  # fmt: skip
    """Start capturing a profile of this process into ``log_dir``.

    Args:
      log_dir: a TensorBoard log directory; the capture goes to ``plugins/profile/<time>/``.
      create_perfetto_trace: also write ``perfetto_trace.json.gz`` (Perfetto's JSON).
      python_tracer_level: 1 records every Python call too (very detailed; xlatorch's op
        tracing becomes several times slower while captured), 0 (default) only the spans.
      host_tracer_level: detail of the runtime's own host events (1 fewest .. 3 most).

    Raises:
      RuntimeError: if a capture is already running.
      OSError: if ``log_dir`` cannot be written (JAX would find out only when the capture stops).
    """
    from xlatorch.runtime.base.topology import jax_device

    _writable(log_dir)
    jax_device()  # join the job the environment describes before JAX's backend starts
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = python_tracer_level
    opts.host_tracer_level = host_tracer_level
    with _lock:
        jax.profiler.start_trace(str(log_dir), create_perfetto_trace=create_perfetto_trace,
                                 profiler_options=opts)  # fmt: skip
        _state.log_dir = str(log_dir)
        _refresh()
    if getattr(_tls, "depth", 0) == 0:
        _open_window()


def _writable(log_dir) -> None:
    """Raise ``OSError`` naming ``log_dir`` unless a capture can be written there (creating it)."""
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as e:
        raise OSError(e.errno, f"xlatorch: a profile cannot be written to {str(log_dir)!r}: {e.strerror or e}") from e


def _warn(what: str, error: BaseException) -> None:
    """A scheduled capture failed: say so and let the program go on (a diagnostic never stops it)."""
    why = (error.strerror if isinstance(error, OSError) and error.strerror else str(error)).removeprefix("xlatorch: ")
    sys.stderr.write(f"xlatorch: {what}: {why}; the program goes on without a profile\n")
    sys.stderr.flush()


def stop_trace() -> str:
    """Stop the capture and write it, after the computations already dispatched finish (so
    their device time is in it). Returns the directory the capture was written to.

    Raises:
      RuntimeError: if no capture is running.
      JaxRuntimeError: if JAX cannot write the capture.
    """
    from xlatorch.runtime.execute.sync import wait

    with _lock:
        if _state.log_dir is None:
            raise RuntimeError("xlatorch: no profiler trace is running (start one with xp.start_trace)")
        try:
            wait()  # the dispatched steps' device time belongs in this capture
        except Exception:  # noqa: BLE001  (a failed execution raises where its value is read)
            pass
        _close_window()
        log_dir = _state.log_dir
        try:
            jax.profiler.stop_trace()
        finally:
            _state.log_dir = None
            _refresh()
    runs = os.path.join(log_dir, "plugins", "profile")
    return max((os.path.join(runs, d) for d in os.listdir(runs)), key=os.path.getmtime)


def trace(service_addr: str | os.PathLike, logdir: str | None = None, duration_ms: int = 1000,
          num_tracing_attempts: int = 3, host_tracer_level: int = 2, device_tracer_level: int = 1,
          delay_ms: int = 0, timeout_s: int = 120, interval_s: int = 5, **kwargs):  # fmt: skip
    """Capture a profile: of a block, ``with xp.trace(log_dir):``, or (torch_xla's form)
    ``xp.trace(service_addr, logdir, duration_ms)``, which samples this process for
    ``duration_ms`` through its profiler server (``xp.start_server``) and blocks until written.

    Args:
      service_addr: with ``logdir`` omitted, the log directory; otherwise the profiler server,
        ``"localhost:PORT"`` of a server this process started.
      logdir: where the server capture is written.
      duration_ms: how long the server capture lasts.
      num_tracing_attempts, device_tracer_level, timeout_s, interval_s: torch_xla's remote
        capture options; accepted, unused (the capture is in-process).
      host_tracer_level: detail of the runtime's host events (1 fewest .. 3 most).
      delay_ms: wait this long before capturing.
      **kwargs: ``start_trace`` options (``python_tracer_level``, ``create_perfetto_trace``).

    Returns:
      For a block, a context manager; its ``as`` value is filled with the capture's directory
      on exit (``.path``). Otherwise None.

    Raises:
      NotImplementedError: sampling another process (use TensorBoard/XProf's "Capture profile").
    """
    if logdir is None:
        return _Capture(service_addr, host_tracer_level=host_tracer_level, **kwargs)
    host, _, port = str(service_addr).rpartition(":")
    local = host.split("//")[-1] in ("localhost", "127.0.0.1", "")
    if _state.server is None or not local or port != str(_state.server_port):
        raise NotImplementedError(
            f"xlatorch: xp.trace samples this process through its own server (xp.start_server), "
            f"not {service_addr}; capture other processes from TensorBoard/XProf "
            "('Capture profile', pip install xprof), or profile in-process with xp.trace(log_dir)"
        )
    time.sleep(delay_ms / 1000)
    start_trace(logdir, host_tracer_level=host_tracer_level, **kwargs)
    time.sleep(duration_ms / 1000)
    stop_trace()
    return None


class _Capture:
    """``with xp.trace(log_dir) as cap:`` ... ``cap.path`` is the written capture's directory."""

    def __init__(self, log_dir, **options):
        self.log_dir, self.options, self.path = log_dir, options, None

    def __enter__(self):
        start_trace(self.log_dir, **self.options)
        return self

    def __exit__(self, *exc):
        self.path = stop_trace()


def trace_detached(service_addr: str, logdir: str, duration_ms: int = 1000, **kwargs) -> threading.Thread:
    """``xp.trace(service_addr, logdir, duration_ms)`` on a background thread: the program goes
    on while it is sampled. Returns the (daemon) thread."""
    t = threading.Thread(target=trace, args=(service_addr, logdir, duration_ms), kwargs=kwargs, daemon=True)
    t.start()
    return t


def trace_steps(log_dir: str | os.PathLike, start: int = 0, stop: int = 5, **options) -> None:
    """Capture steps ``start`` .. ``stop - 1`` (counted in ``mark_step`` calls from now) into
    ``log_dir``; what ``XLATORCH_PROFILE=<dir>`` (``XLATORCH_PROFILE_STEPS=start:stop``) does.

    With ``start=0`` the capture begins at once (before the first step's transfers and op
    tracing; when the device is first used, if this runs at import). A capture still running
    when the program exits is written then. In a job of several processes each writes to
    ``<log_dir>/process_<ordinal>``.

    Args:
      log_dir: the log directory.
      start: the first step captured.
      stop: the step before which the capture ends.
      **options: ``start_trace`` options.

    Raises:
      ValueError: unless ``0 <= start < stop``.
      OSError: if ``log_dir`` cannot be written.
    """
    if not 0 <= start < stop:
        raise ValueError(f"xlatorch: trace_steps needs 0 <= start < stop, got {start}:{stop}")
    _writable(log_dir)
    with _lock:
        _state.schedule = (str(log_dir), start, stop, options)
        _state.steps = 0
        _refresh()
        if not _state.exit_hook:
            atexit.register(_stop_at_exit)
            _state.exit_hook = True
    from xlatorch.runtime.base import topology

    if topology._devices:  # otherwise devices_ready() starts it (no backend before the job is joined)
        _advance_schedule()


def devices_ready() -> None:
    """Called once when xlatorch first uses the device: a scheduled capture may start."""
    if _state.schedule is not None:
        _advance_schedule()


record.STEP_HOOKS.append(_on_step)
record.DEVICE_HOOKS.append(devices_ready)


def _advance_schedule() -> None:
    """Start or stop ``trace_steps``' capture at its step. It is a diagnostic: when it fails,
    it says so and the program goes on, without it."""
    log_dir, start, stop, options = _state.schedule
    if _state.steps == start and _state.log_dir is None:
        from xlatorch import runtime as xr

        if xr.world_size() > 1:
            log_dir = os.path.join(log_dir, f"process_{xr.global_ordinal()}")
        try:
            start_trace(log_dir, **options)
        except Exception as e:  # noqa: BLE001 - see above
            _state.schedule = None
            _refresh()
            _warn(f"the profile of steps {start}:{stop} could not start", e)
    elif _state.steps >= stop and _state.log_dir is not None:
        _state.schedule = None
        _stop_scheduled()


def _stop_scheduled() -> None:
    log_dir = _state.log_dir
    try:
        stop_trace()
    except Exception as e:  # noqa: BLE001 - see _advance_schedule
        _warn(f"the profile could not be written to {log_dir}", e)


def _stop_at_exit() -> None:
    _state.schedule = None
    if _state.log_dir is not None:
        _stop_scheduled()


def start_server(port: int, only_on_master: bool = True):
    """Start a profiler server on ``port`` that TensorBoard/XProf's "Capture profile" (or
    ``xp.trace("localhost:PORT", logdir)``) samples this process through.

    While a server runs, xlatorch keeps its spans armed (a few hundred nanoseconds per sync
    when no capture is running).

    Args:
      port: the port.
      only_on_master: start it only in the process of local ordinal 0.

    Returns:
      The server (None where not started); it runs until ``stop_server()``.
    """
    from xlatorch.core import xla_model as xm

    if only_on_master and not xm.is_master_ordinal():
        return None
    with _lock:
        _state.server = jax.profiler.start_server(port)
        _state.server_port = port
        _refresh()
    return _state.server


def stop_server() -> None:
    """Stop the profiler server started by ``start_server``."""
    with _lock:
        jax.profiler.stop_server()
        _state.server = _state.server_port = None
        _refresh()


def _from_environment() -> None:
    """``XLATORCH_PROFILE=<dir>`` [``XLATORCH_PROFILE_STEPS=start:stop``, default 0:5]: a
    directory that cannot be written is reported, and the program runs unprofiled."""
    log_dir = config.env("XLATORCH_PROFILE")
    if not log_dir:
        return
    start, stop = config.env("XLATORCH_PROFILE_STEPS")
    try:
        trace_steps(log_dir, start, stop)
    except OSError as e:
        _warn(f"XLATORCH_PROFILE={log_dir}", e)


def trace_me(scope: str):
    """A decorator: every call of the function is a ``Trace(scope)`` span of the profile."""

    def decorator(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with Trace(scope):
                return fn(*args, **kwargs)

        return traced

    return decorator


# torch_xla's flag for tracer-driven step markers: recorded for programs that set and read it;
# xlatorch's spans mark steps at every sync whatever its value.
_TRACER_MARKED_STEP = False


def set_tracer_marked_step(value: bool) -> None:
    global _TRACER_MARKED_STEP
    _TRACER_MARKED_STEP = bool(value)


def get_tracer_marked_step() -> bool:
    return _TRACER_MARKED_STEP
