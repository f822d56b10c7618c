"""What a saved StableHLO program is: torch_xla's dataclasses, its JSON form, and its directory.

A program bundle (``StableHLOModelBundle``) is one or more StableHLO functions (bytecode, text
and a ``StableHLOFunctionMeta`` saying where each argument of ``main`` comes from: a user
input, a weight of the state dict, or a constant the export made), the weights and the
constants. On disk (``save_bundle`` / ``load_bundle``), in torch_xla's layout::

    functions/<name>.meta       StableHLOFunctionMeta as JSON (StableHLOJSONSerializer)
    functions/<name>.bytecode   the StableHLO module, a portable artifact (versioned bytecode)
    functions/<name>.mlir       its text, when exported with include_human_readable_text
    data/<state dict key>       each weight, one ``np.save`` file (absent: saved without weights)
    constants/<i>               each additional constant, one ``np.save`` file
    version                     this layout's version and the StableHLO version, as JSON

Every file is written atomically (a temporary file, then a rename) and checked on load; an
error names the file it is about.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlatorch.stablehlo.modules import portable

__all__ = ["VariableType", "VariableSignature", "InputLocation", "StableHLOFunctionMeta", "StableHLOFunc",
           "StableHLOModelBundle", "StableHLOJSONSerializer", "stablehlo_obj_hook", "save_bundle", "load_bundle",
           "BUNDLE_FORMAT_VERSION"]  # fmt: skip

BUNDLE_FORMAT_VERSION = 1


class VariableType(enum.Enum):
    """Where an argument of a StableHLO ``main`` comes from."""

    INPUT_ARG = "input_arg"  # an argument the caller passes
    PARAMETER = "parameter"  # a weight: an entry of the bundle's state dict
    CONSTANT = "constant"  # a tensor the export made: an entry of the bundle's constants


@dataclass
class VariableSignature:
    """Shape and dtype (a torch dtype's name: ``float32``) of one argument or result;
    ``dynamic_dims``: its dimensions that may vary (always empty here: xlatorch specialises
    dynamic dimensions to the example inputs)."""

    shape: list[int]
    dtype: str
    dynamic_dims: list[int] = dataclasses.field(default_factory=list)


@dataclass
class InputLocation:
    """One argument of ``main``: user input ``position`` (in the flattened inputs), weight
    ``name``, or constant ``position``."""

    type_: VariableType
    position: int = -1
    name: str = ""

    @classmethod
    def parameter(cls, name: str) -> InputLocation:
        return cls(type_=VariableType.PARAMETER, name=name)

    @classmethod
    def input_arg(cls, position: int) -> InputLocation:
        return cls(type_=VariableType.INPUT_ARG, position=position)

    @classmethod
    def constant(cls, position: int) -> InputLocation:
        return cls(type_=VariableType.CONSTANT, position=position)


@dataclass
class StableHLOFunctionMeta:
    """What a StableHLO function's ``main`` takes and returns, in its order."""

    name: str
    stablehlo_version: str
    input_signature: list[VariableSignature]
    output_signature: list[VariableSignature]
    input_locations: list[InputLocation]
    unused_inputs: list[tuple[InputLocation, VariableSignature]]  # user inputs the program does not read
    input_pytree_spec: str | None = None  # torch pytree specs (treespec_dumps) of the inputs / outputs
    output_pytree_spec: str | None = None


@dataclass
class StableHLOFunc:
    """One function of a bundle: its meta, StableHLO bytecode and text (or None)."""

    meta: StableHLOFunctionMeta
    bytecode: bytes
    text: str | None


@dataclass
class StableHLOModelBundle:
    """A saved program: weights (numpy arrays by state dict key), constants, functions."""

    state_dict: dict[str, Any]
    additional_constants: list[np.ndarray]
    stablehlo_funcs: list[StableHLOFunc]


class StableHLOJSONSerializer(json.JSONEncoder):
    """JSON for the dataclasses above (as dicts of their fields) and ``VariableType`` (its value)."""

    def default(self, obj):
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        if isinstance(obj, VariableType):
            return obj.value
        return super().default(obj)


_HOOK_TARGETS = (StableHLOFunctionMeta, StableHLOFunc, VariableSignature, InputLocation)


def stablehlo_obj_hook(dct: dict):
    """``json.load``'s ``object_hook`` for files written with :class:`StableHLOJSONSerializer`:
    a dict with exactly one dataclass's fields becomes that dataclass (``type_`` values become
    ``VariableType``); any other dict is returned as it is."""
    keys = set(dct)
    for cls in _HOOK_TARGETS:
        if keys == {f.name for f in dataclasses.fields(cls)}:
            if "type_" in dct:
                dct = {**dct, "type_": VariableType(dct["type_"])}
            return cls(**dct)
    return dct


# -- files ---------------------------------------------------------------------------------


def _write(path: str, data: bytes) -> None:
    """``data`` to ``path`` atomically: a crash leaves the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _npy(array) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def _safe_name(key: str, what: str) -> str:
    if not key or key in (".", "..") or "/" in key or os.sep in key or key.startswith(".tmp-"):
        raise ValueError(f"xlatorch.stablehlo: cannot save {what} {key!r} as a file name")
    return key


def save_bundle(bundle: StableHLOModelBundle, directory: os.PathLike | str, save_weights: bool = True) -> None:
    """Write ``bundle`` under ``directory`` (created if missing) in torch_xla's layout."""
    directory = os.fspath(directory)
    if save_weights:
        data_dir = os.path.join(directory, "data")
        os.makedirs(data_dir, exist_ok=True)
        for key, val in bundle.state_dict.items():
            _write(os.path.join(data_dir, _safe_name(key, "weight")), _npy(val))
    func_dir = os.path.join(directory, "functions")
    os.makedirs(func_dir, exist_ok=True)
    for func in bundle.stablehlo_funcs:
        name = _safe_name(func.meta.name, "function")
        _write(os.path.join(func_dir, name + ".bytecode"), bytes(func.bytecode))
        if func.text is not None:
            _write(os.path.join(func_dir, name + ".mlir"), func.text.encode())
        # The meta last: a directory whose .meta exists has the function's other files.
        _write(os.path.join(func_dir, name + ".meta"), json.dumps(func.meta, cls=StableHLOJSONSerializer).encode())
    const_dir = os.path.join(directory, "constants")
    os.makedirs(const_dir, exist_ok=True)
    for i, c in enumerate(bundle.additional_constants):
        _write(os.path.join(const_dir, str(i)), _npy(c))
    versions = sorted({f.meta.stablehlo_version for f in bundle.stablehlo_funcs})
    info = {"format": "torch_xla.stablehlo bundle", "format_version": BUNDLE_FORMAT_VERSION,
            "stablehlo_version": versions[-1] if versions else None, "producer": "xlatorch"}  # fmt: skip
    _write(os.path.join(directory, "version"), (json.dumps(info) + "\n").encode())


def _files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith(".tmp-"))


def _load_npy(path: str, sig: VariableSignature | None) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            arr = np.load(f, allow_pickle=False)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"xlatorch.stablehlo: {path} is not a numpy array file ({e})") from e
    if sig is not None:
        want = _np_dtype(sig.dtype)
        # bfloat16 and other ml_dtypes arrays come back as raw bytes (|V2): view them as the
        # signature's dtype.
        if want is not None and arr.dtype != want and arr.dtype.itemsize == want.itemsize and arr.dtype.kind in "Vu":
            arr = arr.view(want)
        if list(arr.shape) != list(sig.shape):
            raise ValueError(f"xlatorch.stablehlo: {path} holds an array of shape {list(arr.shape)}; the program "
                             f"expects {list(sig.shape)}")  # fmt: skip
    return arr


def _np_dtype(name: str):
    import ml_dtypes

    special = {"bfloat16": ml_dtypes.bfloat16, "bool": np.bool_, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
               "float8_e5m2": ml_dtypes.float8_e5m2}  # fmt: skip
    try:
        return np.dtype(special.get(name, name))
    except TypeError:
        return None


def _read_meta(path: str) -> StableHLOFunctionMeta:
    try:
        with open(path, "rb") as f:
            meta = json.load(f, object_hook=stablehlo_obj_hook)
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"xlatorch.stablehlo: {path} is not a valid function meta ({e})") from e
    if not isinstance(meta, StableHLOFunctionMeta):
        raise ValueError(f"xlatorch.stablehlo: {path} is not a valid function meta (its fields are not "
                         "StableHLOFunctionMeta's)")  # fmt: skip
    if len(meta.input_locations) != len(meta.input_signature) or not all(
        isinstance(x, InputLocation) for x in meta.input_locations
    ):
        raise ValueError(f"xlatorch.stablehlo: {path} is not a valid function meta (input_locations and "
                         "input_signature disagree)")  # fmt: skip
    return meta


def load_bundle(directory: os.PathLike | str) -> StableHLOModelBundle:
    """Read a directory written by :func:`save_bundle` (or by torch_xla's ``save_as_stablehlo``).

    Raises:
      FileNotFoundError: the directory, its ``functions/``, a function's bytecode, or a
        weight / constant file that a function needs is missing (the error names it).
      ValueError: a file is corrupt (the error names it), or the layout's version is newer.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"xlatorch.stablehlo: no saved program at {directory} (not a directory)")
    vpath = os.path.join(directory, "version")
    if os.path.exists(vpath):  # torch_xla's own directories have none
        try:
            with open(vpath, "rb") as f:
                fmt = int(json.load(f)["format_version"])
        except Exception as e:
            raise ValueError(f"xlatorch.stablehlo: {vpath} is not a valid version file ({e})") from e
        if fmt > BUNDLE_FORMAT_VERSION:
            raise ValueError(f"xlatorch.stablehlo: {vpath}: layout version {fmt} is newer than this xlatorch reads "
                             f"({BUNDLE_FORMAT_VERSION})")  # fmt: skip
    func_dir = os.path.join(directory, "functions")
    if not os.path.isdir(func_dir):
        raise FileNotFoundError(f"xlatorch.stablehlo: {func_dir} is missing: {directory} is not a saved program")
    funcs = []
    for name in _files(func_dir):
        if not name.endswith(".meta"):
            continue
        meta = _read_meta(os.path.join(func_dir, name))
        stem = name[: -len(".meta")]
        code_path = os.path.join(func_dir, stem + ".bytecode")
        if not os.path.exists(code_path):
            raise FileNotFoundError(f"xlatorch.stablehlo: {code_path} is missing (the bytecode of function {stem!r})")
        with open(code_path, "rb") as f:
            code = portable(f.read(), code_path)  # checked here: a corrupt file is named at load
        text_path = os.path.join(func_dir, stem + ".mlir")
        text = None
        if os.path.exists(text_path):
            with open(text_path, encoding="utf-8") as f:
                text = f.read()
        funcs.append(StableHLOFunc(meta, code, text))
    if not funcs:
        raise FileNotFoundError(f"xlatorch.stablehlo: {func_dir} holds no function (<name>.meta)")
    # Weights and constants: each one a function reads must be there (unless the program was
    # saved without weights: no data/ at all); other files of data/ are loaded too.
    needs: dict = {}
    for func in funcs:
        for loc, sig in zip(func.meta.input_locations, func.meta.input_signature):
            if loc.type_ is not VariableType.INPUT_ARG:
                needs[(loc.type_, loc.name if loc.type_ is VariableType.PARAMETER else loc.position)] = sig
    state_dict = {}
    data_dir = os.path.join(directory, "data")
    if os.path.isdir(data_dir):
        for kind, key in needs:
            path = os.path.join(data_dir, str(key))
            if kind is VariableType.PARAMETER and not os.path.exists(path):
                raise FileNotFoundError(f"xlatorch.stablehlo: weight file {path} is missing (weight {key!r})")
        for name in _files(data_dir):
            state_dict[name] = _load_npy(os.path.join(data_dir, name), needs.get((VariableType.PARAMETER, name)))
    constants = []
    const_dir = os.path.join(directory, "constants")
    n_const = 1 + max((k for (kind, k) in needs if kind is VariableType.CONSTANT), default=-1)
    for i in range(n_const):
        path = os.path.join(const_dir, str(i))
        if not os.path.exists(path):
            raise FileNotFoundError(f"xlatorch.stablehlo: constant file {path} is missing")
        constants.append(_load_npy(path, needs.get((VariableType.CONSTANT, i))))
    return StableHLOModelBundle(state_dict=state_dict, additional_constants=constants, stablehlo_funcs=funcs)
