"""Small helpers torch_xla programs call (``torch_xla.utils.utils``)."""

from __future__ import annotations

import os

__all__ = ["getenv_as", "as_list", "SampleGenerator", "DataWrapper"]

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
