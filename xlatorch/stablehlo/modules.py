"""StableHLO modules as bytes: portable artifacts (versioned bytecode), their text and version.

A portable artifact is StableHLO serialised through VHLO for a target version: what
``jax.export`` writes and what torch_xla saves as ``functions/<name>.bytecode``; consumers
within the version's compatibility window read it.
"""

from __future__ import annotations

import re

__all__ = ["portable", "module_text", "artifact_version"]


def _hlo():
    from jax._src.lib.mlir.dialects import hlo

    return hlo


def _is_artifact(code: bytes) -> bool:
    return code.startswith(b"ML\xefR") and b"StableHLO_v" in code[:32]


def artifact_version(code: bytes) -> str:
    """The StableHLO version a portable artifact was written for (``"1.8.0"``), or ``"0.0.0"``."""
    m = re.search(rb"StableHLO_v(\d+\.\d+\.\d+)", code[:64])
    return m.group(1).decode() if m else "0.0.0"


def portable(code: bytes | str, what: str) -> bytes:
    """``code`` (a portable artifact, or a StableHLO module as MLIR bytecode or text) as a
    portable artifact, checked by reading it back. ``what`` names it in the ValueError raised
    when it is none of these."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    hlo = _hlo()
    if isinstance(code, str):
        code = code.encode()
    try:
        with mlir.make_ir_context() as ctx:
            if _is_artifact(code):
                hlo.deserialize_portable_artifact(ctx, code)
                return code
            module = ir.Module.parse(code)
            target = hlo.get_version_from_compatibility_requirement(hlo.StablehloCompatibilityRequirement.WEEK_4)
            return hlo.serialize_portable_artifact(module, target)
    except Exception as e:
        raise ValueError(f"xlatorch.stablehlo: {what} is not a StableHLO module ({e})") from e


def module_text(code: bytes, debug_info: bool = False) -> str:
    """The MLIR text of a portable artifact; ``debug_info`` keeps the locations (op names)."""
    from jax._src.interpreters import mlir

    with mlir.make_ir_context() as ctx:
        module = _hlo().deserialize_portable_artifact(ctx, code)
        return module.operation.get_asm(enable_debug_info=debug_info)
