"""Small helpers torch_xla programs call (``torch_xla.utils.utils``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
from concurrent import futures

__all__ = ["getenv_as", "as_list", "SampleGenerator", "DataWrapper", "FnDataGenerator", "Cleaner", "LazyProperty",
           "TmpFolder", "TimedScope", "timed", "eprint", "null_print", "get_print_fn", "check_env_flag", "shape",
           "flatten_nested_tuple", "list_copy_append", "for_each_instance", "for_each_instance_rewrite",
           "get_free_tcp_ports", "parallel_work"]  # fmt: skip

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def getenv_as(name: str, type, defval=None):
    """Environment variable ``name`` converted to ``type`` (``bool`` understands 1/0,
    true/false, yes/no, on/off), or ``defval`` when it is not set.

    Raises:
      ValueError: the value does not convert, naming the variable.
    """
    value = os.environ.get(name)
    if value is None:
        return defval
    if type is bool:
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"environment variable {name}={value!r} is not a boolean (1/0, true/false, yes/no, on/off)")
    try:
        return type(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"environment variable {name}={value!r} is not a valid {type.__name__}") from e


def as_list(t) -> list:
    """``t`` as a list: lists as they are, tuples converted, anything else wrapped."""
    if isinstance(t, list):
        return t
    if isinstance(t, tuple):
        return list(t)
    return [t]


class SampleGenerator:
    """An iterable giving ``data`` ``sample_count`` times: synthetic input in place of a
    ``DataLoader`` (``len()`` is ``sample_count``)."""

    def __init__(self, data, sample_count: int):
        self._data = data
        self._count = sample_count

    def __iter__(self):
        for _ in range(self._count):
            yield self._data

    def __len__(self) -> int:
        return self._count


class DataWrapper:
    """Base class for a batch of a type the device loaders do not know: they send the
    tensors ``get_tensors()`` returns and rebuild the batch with ``from_tensors``."""

    def get_tensors(self) -> list:
        """The tensors to send to the device."""
        raise NotImplementedError("DataWrapper subclasses implement get_tensors()")

    def from_tensors(self, tensors):
        """A batch like this one holding ``tensors`` (on the device) instead."""
        raise NotImplementedError("DataWrapper subclasses implement from_tensors(tensors)")


class FnDataGenerator:
    """``count`` synthetic batches: ``data = gen_tensor(batch_size, *dims)`` and its target
    ``func(data)``, as ``(data, target)`` pairs."""

    def __init__(self, func, batch_size: int, gen_tensor, dims=None, count: int = 1):
        self._func, self._batch_size, self._gen_tensor = func, batch_size, gen_tensor
        self._dims = list(dims) if dims else [1]
        self._count = count

    def __iter__(self):
        for _ in range(self._count):
            data = self._gen_tensor(self._batch_size, *self._dims)
            yield data, self._func(data)

    def __len__(self) -> int:
        return self._count


class Cleaner:
    """Calls ``func`` when it is garbage collected."""

    def __init__(self, func):
        self.func = func

    def __del__(self):
        self.func()


class LazyProperty:
    """``value`` is ``gen_fn()``, computed at its first read."""

    def __init__(self, gen_fn):
        self._gen_fn = gen_fn

    @property
    def value(self):
        """``gen_fn()``'s result (called once)."""
        if self._gen_fn is not None:
            self._value = self._gen_fn()
            self._gen_fn = None
        return self._value


class TmpFolder:
    """A new temporary directory ``name``, removed with everything in it when this object is
    garbage collected."""

    def __init__(self):
        self.name = tempfile.mkdtemp()
        name = self.name
        self.cleaner = Cleaner(lambda: shutil.rmtree(name, ignore_errors=True))


def null_print(*args, **kwargs) -> None:
    """Prints nothing (``get_print_fn``'s quiet choice)."""


def eprint(*args, **kwargs) -> None:
    """``print`` to standard error."""
    print(*args, file=sys.stderr, **kwargs)


def get_print_fn(debug=None):
    """``eprint`` when ``debug`` (default ``$DEBUG``) is set and non-zero, else ``null_print``."""
    if debug is None:
        debug = int(os.environ.get("DEBUG", "0"))
    return eprint if debug else null_print


def timed(fn, msg: str = "", printfn=eprint):
    """``fn()``, printing ``msg`` and how long it took, in ms."""
    printfn = printfn or get_print_fn()
    start = time.time()
    result = fn()
    printfn(f"{msg}{1000.0 * (time.time() - start):.3f}ms")
    return result


class TimedScope:
    """A ``with`` block that prints ``msg`` and how long the block took, in ms (and the error
    set by ``set_error`` if any)."""

    def __init__(self, msg: str = "", printfn=eprint):
        self._msg, self._printfn, self._error = msg, printfn or get_print_fn(), None

    def __enter__(self):
        self._start = time.time()
        return self

    def __exit__(self, *exc):
        ms = 1000.0 * (time.time() - self._start)
        self._printfn(f"{self._msg}{ms:.3f}ms" + (f" (error: {self._error})" if self._error is not None else ""))

    def set_error(self, error) -> None:
        """Report ``error`` with the time."""
        self._error = error


def check_env_flag(name: str, default: str = "") -> bool:
    """Whether environment variable ``name`` (default ``default``) is ON, 1, YES, TRUE or Y."""
    return os.getenv(name, default).upper() in ("ON", "1", "YES", "TRUE", "Y")


def shape(inputs):
    """The shapes of ``inputs`` (a tensor, or lists/tuples of them), nested alike."""
    if isinstance(inputs, (list, tuple)):
        return [shape(x) for x in inputs]
    return list(inputs.shape)


def flatten_nested_tuple(inputs) -> tuple:
    """The leaves of nested tuples, in order, as one flat tuple."""
    if not isinstance(inputs, tuple):
        return (inputs,)
    return tuple(leaf for x in inputs for leaf in flatten_nested_tuple(x))


def list_copy_append(ilist: list, item) -> list:
    """A copy of ``ilist`` with ``item`` appended."""
    return list(ilist) + [item]


def _walk(value, select_fn, fn, seen):
    if id(value) in seen:
        return
    seen.add(id(value))
    if select_fn(value):
        fn(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(k, select_fn, fn, seen)
            _walk(v, select_fn, fn, seen)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            _walk(v, select_fn, fn, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for v in vars(value).values():
            _walk(v, select_fn, fn, seen)


def for_each_instance(value, select_fn, fn) -> None:
    """Call ``fn(x)`` on every ``x`` in ``value`` (nested lists, tuples, sets, dicts and
    objects' attributes, each visited once) for which ``select_fn(x)`` is true."""
    _walk(value, select_fn, fn, set())


def _rewrite(value, select_fn, fn, done):
    if id(value) in done:
        return done[id(value)]
    if select_fn(value):
        out = fn(value)
    elif isinstance(value, dict):
        out = {k: _rewrite(v, select_fn, fn, done) for k, v in value.items()}
    elif isinstance(value, (list, tuple, set)):
        items = [_rewrite(v, select_fn, fn, done) for v in value]
        out = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        out = value
        for k, v in vars(value).items():
            setattr(out, k, _rewrite(v, select_fn, fn, done))
    else:
        out = value
    done[id(value)] = out
    return out


def for_each_instance_rewrite(value, select_fn, fn):
    """``value`` with every ``x`` for which ``select_fn(x)`` is true replaced by ``fn(x)``:
    lists, tuples, sets and dicts are rebuilt, objects' attributes set in place."""
    return _rewrite(value, select_fn, fn, {})


def get_free_tcp_ports(n: int = 1) -> list[int]:
    """``n`` TCP ports free on this host now (the OS picks them)."""
    ports = []
    for _ in range(n):
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("", 0))
            ports.append(s.getsockname()[1])
    return ports


def parallel_work(num_workers: int, fn, *args) -> list:
    """``fn`` over the zipped ``args`` (``fn(a[i], b[i], ...)``) on ``num_workers`` threads;
    the results in order."""
    with futures.ThreadPoolExecutor(max_workers=num_workers) as pool:
        return list(pool.map(fn, *args))
