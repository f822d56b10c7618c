"""Which dtypes CPU's kernels refuse, as ``ops.yaml`` ``refuse_dtypes`` rules.

For every OpInfo that exercises a lowered entry, every sample in a dtype the OpInfo says CPU
does not support (int64, bool, complex64) is run on CPU; where CPU raises, the ATen op that
raised is found (a dispatch mode records it; each one the samples reach: a 2-d ``pad`` reaches
another kernel than a 1-d one) and called again with those tensors in each of twelve dtypes.
The dtypes that raise the same error, with the dtype's name replaced by ``{scalar_type}``, are
the op's refused dtypes. Prints one rule per op, for review: an entry already holding a rule is
marked, and float16 / bfloat16 are left out (where CPU merely lacks a kernel the device
computes what an accelerator does).

    python tools/cpu_dtypes.py [OpInfo name ...]
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from codegen import registry, schema  # noqa: E402
from codegen.gen import ROOT  # noqa: E402
from xlatorch.runtime.trace.nodes import dtype_name  # noqa: E402

SAMPLED = (torch.int64, torch.bool, torch.complex64, torch.float64)
ALL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64,
       torch.complex64, torch.complex128)  # fmt: skip


class _FirstFailure(TorchDispatchMode):
    """Records the first ATen call that raised."""

    failed = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.failed is None:
                self.failed = (func, args, kwargs or {})
            raise


def _error(func, args, kwargs, dtype) -> tuple | None:
    """CPU's error for ``func(*args, **kwargs)`` (the dtype's name as ``{scalar_type}``), or None."""
    try:
        func(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever CPU raises
        first = str(e).splitlines()[0] if str(e) else ""
        return type(e).__name__, first.replace(f"'{dtype_name(dtype)}'", "'{scalar_type}'")
    return None


def _cast(tree, dtype, to):
    return tree_map(lambda t: t.to(to) if isinstance(t, torch.Tensor) and t.dtype == dtype else t, tree)


def _failures(names) -> dict:
    """``{ATen op: [(sample dtype, (op, args, kwargs))]}`` for the samples CPU refuses."""
    entries = registry.load(os.path.join(ROOT, "ops.yaml"), schema.load()[0])
    lowered = {n for e in entries if e.lower or e.helper for n in {e.schema.op, *(e.test.get("opinfo") or [])}}
    found: dict = {}
    for op in op_db:
        if not {op.name, op.aten_name} & lowered or (names and op.name not in names):
            continue
        for dtype in set(SAMPLED) - set(op.supported_dtypes("cpu")):
            try:
                samples = list(op.sample_inputs("cpu", dtype))
            except Exception:  # noqa: BLE001, S112 - no samples of this dtype
                continue
            seen = set()  # one call per ATen op and dtype: samples reach several (a 1-d and a 2-d pad)
            for s in samples:
                rec = _FirstFailure()
                try:
                    with rec:
                        op(s.input, *s.args, **s.kwargs)
                except Exception:  # noqa: BLE001, S110 - recorded
                    pass
                if rec.failed is not None and str(rec.failed[0]) not in seen:
                    seen.add(str(rec.failed[0]))
                    found.setdefault(str(rec.failed[0]), []).append((dtype, rec.failed))
    return found


def _rules(calls) -> list:
    """The refused dtypes of one ATen op, grouped by CPU's error."""
    known = {_error(func, args, kwargs, dtype) for dtype, (func, args, kwargs) in calls}
    refused: dict = {}
    for dtype, (func, args, kwargs) in calls:
        for d in ALL:
            err = _error(func, *_cast((args, kwargs), dtype, d), d)
            if err in known and d not in refused:
                refused[d] = err
    groups: dict = {}
    for d, err in refused.items():
        groups.setdefault(err, []).append(str(d).removeprefix("torch."))
    return list(groups.items())


def main(argv) -> int:
    warnings.filterwarnings("ignore")
    entries = {e.name: e for e in registry.load(os.path.join(ROOT, "ops.yaml"), schema.load()[0])}
    for name, calls in sorted(_failures(set(argv)).items()):
        key = name.removeprefix("aten.")
        items = [
            f"{{dtypes: [{', '.join(ds)}], error: {json.dumps(f'{exc}: {msg}')}}}" for (exc, msg), ds in _rules(calls)
        ]
        have = " (has a rule)" if key in entries and entries[key].refuse_dtypes else ""
        print(
            f"{key.removesuffix('.default')}:{have}\n  refuse_dtypes: "
            + (items[0] if len(items) == 1 else "[" + ", ".join(items) + "]")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
