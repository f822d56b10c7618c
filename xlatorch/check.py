"""Will my model fall back, cut the graph or recompile? Asked before running it.

``python -m xlatorch.check FILE_OR_MODULE:FACTORY [--steps N] [--run]`` (also
``tools/coverage_report --static FILE:FACTORY``). ``FACTORY()`` returns ``(model, inputs,
loss_fn)`` or ``(model, inputs, loss_fn, make_optimizer)``: the model on CPU, example inputs
(a tuple of arguments or a dict of keyword arguments, on CPU), a function of the model's
output giving the loss (None: forward only), and ``make_optimizer(params)`` (default
``torch.optim.AdamW``).

The check moves them to the xla device and traces ``N`` training steps (forward, loss,
backward, optimizer step, ``xm.mark_step``; default 3) as a **dry run**
(``runtime/execute/dry.py``): every op takes the path it takes in a real run, and nothing is
uploaded, compiled or run. It lists, each with the user's source line and a fix:

- ops that **fall back** to CPU (no lowering): each is a graph cut and a round trip;
- **graph cuts** besides ``mark_step``: host reads (``.item()``, ``print``, ``.cpu()``) and
  data-dependent shapes (``nonzero``, ``x[mask]``);
- **recompiles** in the steady state: a graph that still changes at step 3, named as
  ``xlatorch.debug`` names a compile's reason (a Python number baked in as a size or dim);
- an **error** a real run raises at trace time (unsupported dtype, wrong device, shapes).

What it predicts is what a real run counts (``check(..., dry=False)`` runs the same steps
for real and reports them the same way; ``--run`` prints both). One difference is
unavoidable: values read on the host are zeros in a dry run, so a Python branch on such a
value may take another path than with the real data.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import threading
import time
import traceback

import torch
from torch.utils._pytree import tree_map

import xlatorch.core.xla_model as xm
from xlatorch.debug import explain, knob
from xlatorch.fallback import cpu as fallback
from xlatorch.runtime.base import record
from xlatorch.runtime.base.source import fmt_src, is_user_code
from xlatorch.runtime.execute import dry

__all__ = ["Finding", "Report", "check", "load_factory", "main"]

STEADY = 2  # steps 0 and 1 compile by design (the first step, then with optimizer state); later ones must not


@dataclasses.dataclass
class Finding:
    """One thing the check found.

    Attributes:
      kind: ``fallback``, ``graph cut``, ``recompile`` or ``error``.
      what: the op (``aten::cdist``), the cut's cause (``.item()``), the compile's reason, or
        the error.
      source: ``path:line`` of the user's code, or None when unknown.
      count: how often it happened over the traced steps.
      fix: what to do about it.
    """

    kind: str
    what: str
    source: str | None
    count: int
    fix: str

    def __str__(self) -> str:
        return f"{self.kind:<10} {self.what}  at {self.source or '?'}  ({self.count}x)\n{'':<11}fix: {self.fix}"


@dataclasses.dataclass
class Report:
    """What a traced run of ``steps`` training steps did: ``findings``, plus the raw counts
    the findings come from (for comparing a dry run with a real one).

    Attributes:
      fallbacks: ``{(op, "path:line"): calls}`` of ops run on CPU.
      cuts: ``{(cause, "path:line"): count}`` of graph cuts besides ``mark_step``.
      recompiles: compile reasons of graphs compiled from step ``STEADY`` on.
      error: the exception the steps raised, or None.
      graphs: graphs compiled (a dry run: that a real run would compile) over the steps.
    """

    findings: list[Finding]
    fallbacks: dict
    cuts: dict
    recompiles: list[str]
    error: BaseException | None
    graphs: int
    steps: int
    seconds: float
    dry: bool

    def __str__(self) -> str:
        how = "traced as a dry run (nothing uploaded, compiled or run)" if self.dry else "run on the device"
        head = f"xlatorch.check: {self.steps} training step(s) {how} in {self.seconds:.2f} s; {self.graphs} graph(s)"
        if not self.findings:
            return head + "\nNo CPU fallbacks, graph cuts besides mark_step, steady-state recompiles or errors."
        return "\n".join([head] + [str(f) for f in self.findings])


def load_factory(target: str):
    """The callable named by ``FILE.py:NAME`` or ``package.module:NAME``."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"xlatorch.check: expected FILE_OR_MODULE:FACTORY (e.g. model.py:make_model), got {target!r}")
    if path.endswith(".py") or os.path.exists(path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"xlatorch.check: no such file: {path}")
        spec = importlib.util.spec_from_file_location("__xlatorch_check_target__", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"xlatorch.check: {path} has no {name!r}") from None


def _unpack(made):
    if not isinstance(made, (tuple, list)) or len(made) not in (3, 4):
        raise TypeError("xlatorch.check: the factory must return (model, inputs, loss_fn) or "
                        f"(model, inputs, loss_fn, make_optimizer), got {type(made).__name__}")  # fmt: skip
    model, inputs, loss_fn = made[:3]
    make_opt = made[3] if len(made) == 4 else (lambda params: torch.optim.AdamW(params))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"xlatorch.check: the factory's model must be a torch.nn.Module, got {type(model).__name__}")
    return model, inputs, loss_fn, make_opt


PHASE = ["setup"]  # the part of the step being traced: where a finding without a user line happened


def train(model, inputs, loss_fn, make_opt, steps: int, device=None) -> None:
    """The steps the check traces: move model and inputs to ``device``, then per step forward,
    loss, backward, optimizer step and ``xm.mark_step()`` (forward only if ``loss_fn`` is None)."""
    device = device or xm.xla_device()
    PHASE[0] = "moving the model and inputs to the device"
    model.to(device)
    inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)
    opt = make_opt(model.parameters()) if loss_fn is not None else None
    for _ in range(steps):
        if opt is not None:
            PHASE[0] = "optimizer.zero_grad()"
            opt.zero_grad(set_to_none=True)
        PHASE[0] = "the model's forward"
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        if loss_fn is not None:
            PHASE[0] = "the loss function"
            loss = loss_fn(out)
            PHASE[0] = "backward()"
            loss.backward()
            PHASE[0] = f"the optimizer's step ({type(opt).__name__})"
            opt.step()
        PHASE[0] = "xm.mark_step()"
        xm.mark_step()


def _where() -> str:
    """Where in the step the runtime was called from: the innermost frame of the user's code
    below ``train`` (``path:line``), else the innermost frame outside xlatorch (torch's code,
    e.g. ``torch/optim/adam.py:380``) and the step's phase. On autograd's device thread
    (a backward pass) the user's frame is looked for on the main thread."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    library = None
    frames = [sys._getframe(1)]
    if threading.current_thread() is not threading.main_thread():
        frames.append(sys._current_frames().get(threading.main_thread().ident))
    for f in frames:
        while f is not None and f.f_code is not train.__code__:
            fn = f.f_code.co_filename
            if is_user_code(fn):
                return fmt_src((fn, f.f_lineno), full=True)
            if library is None and not fn.startswith(here):
                tail = fn.split("site-packages" + os.sep, 1)[-1]
                library = f"{tail}:{f.f_lineno}"
            f = f.f_back
    return f"{library or '?'} (in {PHASE[0]})"


class _Cuts:
    """A sync hook counting graph cuts besides ``mark_step`` by (cause, line): the user's line,
    else the library's line and the step's phase (a cut inside ``torch.optim``)."""

    def __init__(self):
        self.counts = collections.Counter()

    def __call__(self, reason, graph_nodes) -> None:
        if reason in ("mark_step", "eager"):
            return
        self.counts[(record.current_cause() or reason, _where())] += 1


def _user_src(tb) -> str | None:
    """``path:line`` of the innermost frame of ``tb`` in the user's code."""
    found = None
    for fs in traceback.extract_tb(tb):
        if is_user_code(fs.filename):
            found = fmt_src((fs.filename, fs.lineno), full=True)
    return found


FIXES = {
    ".item()": "keep the value on the device (e.g. collect losses as tensors and read them once per epoch), or read "
    "it right after xm.mark_step()",
    "print": "print after xm.mark_step(), or every N steps: printing a tensor reads it on the host",
    "torch.equal": "use (a == b).all() and keep the result on the device",
    "data-dependent": "use a fixed-shape form: torch.where(mask, x, 0) or masked_fill instead of x[mask] or "
    "nonzero(); the shape of the result depends on the data",
}
_READ_FIX = ("read it on the host after xm.mark_step() (xm.add_step_closure), and as seldom as you can: reading a "
             "tensor on the host makes the host wait for the device")  # fmt: skip


def _cut_fix(cause: str) -> str:
    for k, fix in FIXES.items():
        if cause.startswith(k):
            return fix
    return _READ_FIX


def _fallback_fix(op: str) -> str:
    return (f"{op} has no lowering: it runs on CPU, a graph cut and a copy of its inputs to the host at every call. "
            f"Write it with ops that are lowered, or add a lowering for it to ops.yaml (tools/gen_ops.py)")  # fmt: skip


def _recompile_fix(reason: str) -> str:
    if "constant" in reason:
        return ("a Python number that changes every step is baked into the graph (a size, a dim, a slice bound): keep "
                "it fixed (pad or bucket the shapes), or pass it as a tensor")  # fmt: skip
    if "shape" in reason:
        return "an input's shape changes every step: pad or bucket it to a few fixed shapes (e.g. drop_last=True)"
    return "the step's graph still changes at step 3; make every step trace the same ops on the same shapes"


def _findings(fallbacks, cuts, recompiles, error, steps) -> list[Finding]:
    out = []
    for (op, src), n in sorted(fallbacks.items(), key=lambda kv: -kv[1]):
        out.append(Finding("fallback", f"aten::{op.removeprefix('aten::')}", src, n, _fallback_fix(op)))
    for (cause, src), n in sorted(cuts.items(), key=lambda kv: -kv[1]):
        if cause.startswith("CPU fallback"):
            continue  # listed as the fallback itself
        out.append(Finding("graph cut", cause, src, n, _cut_fix(cause)))
    for rec in recompiles:
        out.append(Finding("recompile", rec.reason, rec.source, 1, _recompile_fix(rec.reason)))
    if error is not None:
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        src = getattr(error, "xlatorch_source", None)  # an op whose lowering failed (runtime/execute/dry.py)
        src = fmt_src(src, full=True) if src else _user_src(error.__traceback__)
        fix = "a real run raises here too, at this line: fix the call (the message says what is wrong)"
        out.append(Finding("error", text, src, 1, fix))
    return out


def check(factory, steps: int = 3, dry_run: bool = True, lower: bool = True) -> Report:
    """Trace (``dry_run=True``: without uploading, compiling or running anything) or run
    ``steps`` training steps of what ``factory()`` returns and report every CPU fallback,
    graph cut besides ``mark_step``, steady-state recompile and error, with the user's line.

    Args:
      factory: a callable returning ``(model, inputs, loss_fn[, make_optimizer])`` (module docstring).
      steps: training steps to trace (at least 3 to see steady-state recompiles).
      dry_run: False runs the same steps on the device and reports them the same way.
      lower: trace each new graph's lowering with JAX (no XLA compile): finds ops whose
        lowering fails (about 1 ms per node, once per graph); False skips it.
    """
    model, inputs, loss_fn, make_opt = _unpack(factory())
    t0 = time.perf_counter()
    fallbacks = collections.Counter()
    cuts = _Cuts()
    before = {id(r) for r in explain.compile_reasons()}
    xm.mark_step()  # whatever was pending before is not this check's
    step0 = explain._step
    error = None
    history = list(explain._HISTORY)

    def on_fallback(op, line):
        fallbacks[(op, _where())] += 1

    fallback.SITE_HOOKS.append(on_fallback)
    record.SYNC_HOOKS.append(cuts)
    try:
        with knob.sources(), dry.dry_run(lower) if dry_run else contextlib.nullcontext():
            if dry_run:  # its compile reasons compare its own graphs only, not those compiled for real before
                explain._HISTORY.clear()
            try:
                train(model, inputs, loss_fn, make_opt, steps)
            except Exception as e:  # reported as a finding: a real run raises it too
                error = e
            if error is not None and dry_run:  # what the failed step left pending reads dry data: settle it dry
                xm.mark_step()
    finally:
        fallback.SITE_HOOKS.remove(on_fallback)
        record.SYNC_HOOKS.remove(cuts)
        if dry_run:  # and a real run afterwards does not see the dry run's graphs
            explain._HISTORY.clear()
            explain._HISTORY.extend(history)
    seconds = time.perf_counter() - t0
    recs = [r for r in explain.compile_reasons() if id(r) not in before]
    recompiles = [r for r in recs if r.step - step0 >= STEADY]
    cuts = dict(cuts.counts)
    return Report(_findings(fallbacks, cuts, recompiles, error, steps), dict(fallbacks), cuts, recompiles, error,
                  len(recs), steps, seconds, dry_run)  # fmt: skip


def main(argv=None) -> int:
    """The command line: 0 when nothing was found, 1 when something was, 2 when the factory failed."""
    ap = argparse.ArgumentParser(prog="python -m xlatorch.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("target", help="FILE.py:FACTORY or package.module:FACTORY")
    ap.add_argument("--steps", type=int, default=3, help="training steps to trace (default 3)")
    ap.add_argument("--run", action="store_true", help="then run the same steps for real and report them too")
    ap.add_argument(
        "--no-lower",
        action="store_true",
        help="skip tracing each graph's lowering (faster, and misses ops whose lowering fails)",
    )
    a = ap.parse_args(argv)
    try:
        factory = load_factory(a.target)
        report = check(factory, a.steps, lower=not a.no_lower)
    except Exception as e:
        print(f"xlatorch.check: could not check {a.target}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report)
    if a.run:
        print()
        print(check(factory, a.steps, dry_run=False))
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
