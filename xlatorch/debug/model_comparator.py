"""``torch_xla.debug.model_comparator``: save a model's intermediate tensors from two runs (say
CPU and the xla device) and report where they differ.

``configure(dir)`` (or ``$MODELCMP_SAVEDIR``) turns ``save(name, tensor)`` on: each call writes
``tensor`` to ``dir/[step-N/]<name>.<k>``, ``k`` counting the saves of that name (per step).
``compare(dir1, dir2)`` pairs the files of two such runs. With no directory, ``save`` does
nothing, so the calls can stay in a model. ``save`` syncs (it moves the tensor to the CPU).

Run as a script: ``python -m xlatorch.debug.model_comparator DIR1 DIR2`` prints the report and
exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

import torch

__all__ = ["compare", "compare_tensors", "configure", "save", "tensor_file_compare"]

_SAVE_DIR: str | None = None
_COUNTS: dict[str, int] = {}
_STEP: int | None = None
_SAVED = re.compile(r"(.*)\.(\d+)$")


def configure(save_dir: str | None) -> None:
    """Save into ``save_dir`` from now on (None: back to ``$MODELCMP_SAVEDIR``), counting names anew."""
    global _SAVE_DIR, _COUNTS, _STEP
    _SAVE_DIR, _COUNTS, _STEP = save_dir, {}, None


def _save_dir() -> str | None:
    return _SAVE_DIR if _SAVE_DIR is not None else os.environ.get("MODELCMP_SAVEDIR")


def _master() -> bool:
    from xlatorch.core import xla_model as xm

    return xm.is_master_ordinal()


def _caller_name() -> str:
    # A tensor saved without a name is named after the line that saved it: ``model.py.l42``.
    for frame in reversed(traceback.extract_stack()):
        if os.path.basename(frame.filename) != os.path.basename(__file__):
            return f"{os.path.basename(frame.filename)}.l{frame.lineno}"
    return "noname"


def save(name: str | None, tensor: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """Write ``tensor`` (moved to the CPU: a sync) as ``<name>.<k>`` in the save directory, under
    ``step-<step>/`` when ``step`` is given; only the master ordinal writes. Returns ``tensor``.
    Does nothing when no directory is configured.

    Args:
      name: the tensor's name (None: the caller's file and line).
      tensor: the tensor.
      step: the training step, a folder of its own (names are counted anew each step).
    """
    global _COUNTS, _STEP
    save_dir = _save_dir()
    if save_dir is None:
        return tensor
    data = tensor.detach().cpu()
    if not _master():
        return tensor
    name = _caller_name() if name is None else name
    path = save_dir
    if step is not None:
        path = os.path.join(save_dir, f"step-{step}")
        os.makedirs(path, exist_ok=True)
        if step != _STEP:
            _STEP, _COUNTS = step, {}
    k = _COUNTS.get(name, 0)
    _COUNTS[name] = k + 1
    torch.save(data, os.path.join(path, f"{name}.{k}"))
    return tensor


def _index_of(sizes: list[int], flat: int) -> list[int]:
    index = []
    for size in reversed(sizes):
        flat, i = divmod(flat, size)
        index.append(i)
    return index[::-1]


def compare_tensors(tensor1, tensor2, rtol: float = 1e-05, atol: float = 1e-08, max_diffs: int = 25) -> str:
    """The elements of two tensors farther apart than ``max(rtol * max(|a|, |b|), atol)``, largest
    error first, one line each (``[i, j]: a vs. b\\terror=e``), at most ``max_diffs``; ``''``
    when none is. Tensors of different shapes give one line saying so."""
    sizes1, sizes2 = list(tensor1.size()), list(tensor2.size())
    if sizes1 != sizes2:
        return f"Tensors have different shape: {sizes1} vs. {sizes2}\n"
    diffs = []
    for i, (a, b) in enumerate(zip(tensor1.flatten().tolist(), tensor2.flatten().tolist())):
        if a == b or (a != a and b != b):  # equal, infinities and NaNs included
            continue
        error = abs(a - b)
        if not error <= max(max(abs(a), abs(b)) * rtol, atol):  # a NaN against a number differs
            diffs.append((error, i, a, b))
    diffs.sort(key=lambda d: d[0] if d[0] == d[0] else float("inf"), reverse=True)
    report = "".join(f"{_index_of(sizes1, i)}: {a} vs. {b}\terror={e}\n" for e, i, a, b in diffs[:max_diffs])
    if len(diffs) > max_diffs:
        report += f"... aborting after {max_diffs} differences\n"
    return report


def _parse_path(path: str) -> tuple[str, int, int | None, str]:
    """``(name, k, step, save dir)`` of a saved file's path."""
    folder = os.path.dirname(path)
    step = None
    m = re.match(r"step-(\d+)$", os.path.basename(folder))
    if m:
        step, folder = int(m.group(1)), os.path.dirname(folder)
    m = _SAVED.match(os.path.basename(path))
    if not m:
        raise ValueError(f"model_comparator: {path} is not a saved tensor's file (<name>.<k>)")
    return m.group(1), int(m.group(2)), step, folder


def tensor_file_compare(path1: str, path2: str, rtol: float = 1e-05, atol: float = 1e-08, max_diffs: int = 25) -> str:
    """``compare_tensors`` of two saved files, headed by the tensor's name, count and step."""
    report = compare_tensors(torch.load(path1), torch.load(path2), rtol=rtol, atol=atol, max_diffs=max_diffs)
    if not report:
        return ""
    name, k, step, _ = _parse_path(path1)
    head = f'Changes in saved tensor "{name}" with id={k}{f" at step={step}" if step is not None else ""}\n'
    return head + "".join(f"  {line}\n" for line in report.split("\n"))


def _saved_files(save_dir: str) -> set[str]:
    files = set()
    for root, _, names in os.walk(save_dir):
        for name in names:
            if _SAVED.match(name):
                files.add(os.path.relpath(os.path.join(root, name), save_dir))
    return files


def compare(save_dir1: str, save_dir2: str, rtol: float = 1e-05, atol: float = 1e-08, max_diffs: int = 25) -> str:
    """Compare every tensor saved in two directories (step folders included); a file in only
    one of them is a ``Mismatch`` line. ``''`` when the runs agree."""
    files1, files2 = _saved_files(save_dir1), _saved_files(save_dir2)
    report = ""
    for path in sorted(files1 | files2):
        if path not in files2:
            report += f"Mismatch: {path} not in {save_dir2}\n"
        elif path not in files1:
            report += f"Mismatch: {path} not in {save_dir1}\n"
        else:
            report += tensor_file_compare(os.path.join(save_dir1, path), os.path.join(save_dir2, path),
                                          rtol=rtol, atol=atol, max_diffs=max_diffs)  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare the tensors two runs saved with model_comparator.save")
    parser.add_argument("--rtol", type=float, default=1e-05)
    parser.add_argument("--atol", type=float, default=1e-08)
    parser.add_argument("--max_diffs", type=int, default=25)
    parser.add_argument("savedir1", metavar="SAVEDIR1")
    parser.add_argument("savedir2", metavar="SAVEDIR2")
    args = parser.parse_args(argv)
    report = compare(args.savedir1, args.savedir2, rtol=args.rtol, atol=args.atol, max_diffs=args.max_diffs)
    if report:
        print(report, file=sys.stderr)
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
