"""The environment variables xlatorch reads: one table, one parser, checked at import.

Each variable is one ``VARS`` entry: how its value is parsed, its default, and the values it
accepts. ``env(name)`` reads one (its default when unset or empty); a value the entry does not
accept raises ``ValueError`` naming the variable and what it accepts. Every variable that is
set is read once when this module loads, so ``import xlatorch`` fails on a bad value instead
of the first step (or the first rendezvous) failing later. A module that reads a variable
when it is used (the job's variables, read when the job is joined) reads it through ``env``
too; a flag read per op is a module global of the module that reads it, set from ``env``.

torch_xla's own variables (``XLA_*``, ``LTC_*``, ``PT_XLA_DEBUG``) keep torch_xla's reading of
a boolean (``sys_util::GetEnvBool``: ``true``/``false`` in any case, else C's ``atoi != 0``),
so a program written for torch_xla runs the same; xlatorch's switches take
``1/0, true/false, yes/no, on/off``.

Modes that several stages read live here too. ``XLATORCH_CHECKS``: ``1`` (default) computes
the checks CPU PyTorch makes on data inside the compiled graph and reads them when the step's
results are next needed; ``sync`` reads each sync's checks before it returns; ``0`` turns them
off (runtime/lower/checks.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["VARS", "env", "check", "CHECKS", "CHECKS_DEFER"]


class Var(NamedTuple):
    parse: Callable[[str], Any]  # the stripped value -> what the program reads; ValueError if not accepted
    default: Any  # when unset (or empty, unless ``empty`` says otherwise)
    accepted: str  # for the error: the values it accepts
    empty: bool = False  # an empty value is a value of its own (not the default)


class _Reject(ValueError):
    """A value not accepted, with the reason to show (a bare ``ValueError`` shows the value)."""


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
_SWITCH = "1/0, true/false, yes/no or on/off"


def _switch(v: str) -> bool:
    v = v.lower()
    if v in _ON or v in _OFF:
        return v in _ON
    raise ValueError


def _torch_xla_bool(v: str) -> bool:
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    m = re.match(r"[+-]?\d+", v)
    return bool(m and int(m.group(0)))


def _whole(lo: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        n = int(v)
        if n < lo:
            raise ValueError
        return n

    return parse


def _bytes(v: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)i?B?", v, re.IGNORECASE)
    if not m or not int(m.group(1)):
        raise ValueError
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def _seconds(v: str) -> float:
    s = float(v)
    if not s > 0:  # also NaN
        raise ValueError
    return s


def _level(v: str) -> int:
    """A debug level: a whole number >= 0, or a switch's word (on: 1)."""
    try:
        return _whole(0)(v)
    except ValueError:
        return int(_switch(v))


def _one_of(*names: str, upper: bool = False) -> Callable[[str], str]:
    def parse(v: str) -> str:
        v = v.upper() if upper else v.lower()
        if v not in names:
            raise ValueError
        return v

    return parse


def _checks(v: str) -> str:
    v = v.lower()
    return "sync" if v == "sync" else "1" if _switch(v) else "0"


def _steps(v: str) -> tuple[int, int]:
    start, stop = (int(s) for s in v.split(":"))
    if not 0 <= start < stop:
        raise ValueError
    return start, stop


def _address(v: str) -> str:
    host, _, port = v.rpartition(":")
    if not host or not 0 < int(port) < 65536:
        raise ValueError
    return v


def _text(v: str) -> str:
    return v


def _xla_options(text: str) -> dict:
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not name:
            raise _Reject(f"{item!r} is not name=value")
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
        else:
            try:
                out[name] = int(value)
            except ValueError:
                out[name] = value
    return out


_TORCH_XLA_BOOL = "true/false, or a number (not 0: on), as torch_xla reads it"
_PATH = "a path"

VARS: dict[str, Var] = {
    # the platform and precision (torch_xla's names)
    "PJRT_DEVICE": Var(_one_of("CPU", "GPU", "CUDA", "ROCM", "TPU", upper=True), None, "CPU, GPU, CUDA, ROCM or TPU"),
    "XLA_USE_BF16": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    "XLA_DOWNCAST_BF16": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    "LTC_USE_BF16": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    "LTC_DOWNCAST_BF16": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    # debugging and profiling
    "XLATORCH_DEBUG": Var(_level, None, f"a debug level 0-3, or {_SWITCH} (on: 1)"),
    "PT_XLA_DEBUG": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    "PT_XLA_DEBUG_LEVEL": Var(_level, 1, "a debug level 0-3"),
    "XLA_IR_DEBUG": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    "XLA_HLO_DEBUG": Var(_torch_xla_bool, False, _TORCH_XLA_BOOL),
    "XLATORCH_COMPARE": Var(_switch, False, _SWITCH),  # each mark_step compares its ops with CPU
    "XLATORCH_PROFILE": Var(_text, None, "a directory to write the profile to"),
    "XLATORCH_PROFILE_STEPS": Var(_steps, (0, 5), "START:STOP, two whole numbers with 0 <= START < STOP (e.g. 0:5)"),
    "XLA_METRICS_FILE": Var(_text, None, _PATH),
    "XLATORCH_FALLBACK_REPORT": Var(_text, None, _PATH),
    # compiling
    "XLATORCH_CACHE_DIR": Var(_text, None, "a directory, or empty to turn the persistent cache off", empty=True),
    "XLATORCH_CACHE_MAX_BYTES": Var(_bytes, 1 << 30, "a size in bytes >= 1, e.g. 1073741824, 512M or 2G"),
    "XLATORCH_EXECUTABLE_CACHE_SIZE": Var(_whole(1), None, "a whole number >= 1 (compiled graphs kept in memory)"),
    "XLATORCH_XLA_OPTIONS": Var(_xla_options, None, "name=value XLA compiler options, separated by commas", empty=True),
    "XLATORCH_HOIST_BIRTHS": Var(_switch, True, _SWITCH),
    "XLATORCH_SHARE_SCALARS": Var(_switch, True, _SWITCH),  # equal host scalars read as one (lower/executable.py)
    "XLATORCH_GC_FREEZE": Var(_switch, True, _SWITCH),
    # checks and faults
    "XLATORCH_CHECKS": Var(_checks, "1", f"sync, or {_SWITCH}"),
    "XLATORCH_CHECKS_UNDO": Var(_one_of("graph", "keep"), None, "graph or keep"),
    "XLATORCH_DEFER_SIGINT": Var(_switch, True, _SWITCH),
    # devices, processes and hosts
    "CPU_NUM_DEVICES": Var(_whole(1), None, "a whole number >= 1"),
    "XLA_USE_SPMD": Var(_switch, False, _SWITCH),  # torch_xla's: SPMD from the device's first use
    "XLATORCH_COORDINATOR": Var(_address, None, "HOST:PORT"),
    "XLATORCH_WORLD_SIZE": Var(_whole(1), None, "a whole number >= 1"),
    "XLATORCH_RANK": Var(_whole(0), None, "a whole number >= 0"),
    "XLATORCH_LOCAL_RANK": Var(_whole(0), None, "a whole number >= 0"),
    "XLATORCH_LOCAL_WORLD_SIZE": Var(_whole(1), None, "a whole number >= 1"),
    "XLATORCH_NUM_HOSTS": Var(_whole(1), 1, "a whole number >= 1"),
    "XLATORCH_HOST_INDEX": Var(_whole(0), 0, "a whole number >= 0"),
    "XLATORCH_INIT_TIMEOUT": Var(_whole(1), 120, "a whole number of seconds >= 1"),
    # a process of the job silent this long is lost: the others stop, naming it
    "XLATORCH_HEARTBEAT_TIMEOUT": Var(_whole(2), 60, "a whole number of seconds >= 2"),
    "XLATORCH_RENDEZVOUS_TIMEOUT": Var(_seconds, 300.0, "a number of seconds > 0"),
}


def env(name: str) -> Any:
    """The value of environment variable ``name`` (one of ``VARS``), parsed; its default when
    unset or empty.

    Raises:
      ValueError: the value is not one the variable accepts (the message names both).
    """
    var = VARS[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    v = raw.strip()
    if not v and not var.empty:
        return var.default
    try:
        return var.parse(v)
    except _Reject as e:
        raise ValueError(f"xlatorch: {name}: {e} (expected {var.accepted})") from None
    except ValueError:
        raise ValueError(f"xlatorch: {name}={raw!r} is not accepted: expected {var.accepted}") from None


def check() -> None:
    """Read every variable that is set: the first bad one raises (see ``env``)."""
    for name in VARS:
        if name in os.environ:
            env(name)


check()

_MODE = env("XLATORCH_CHECKS")
CHECKS = _MODE != "0"
CHECKS_DEFER = _MODE != "sync"  # read a sync's rows when its results are next needed (see above)
