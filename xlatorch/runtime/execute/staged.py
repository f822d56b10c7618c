"""A sync's graph run as stages (``runtime/plan/stages.py`` decides them): host stages with
PyTorch's CPU kernels (``host.py``), compiled stages cached per stage, the step committed whole.
``sync.py`` calls ``run_stages`` at a cache miss whose graph splits."""

from __future__ import annotations

import time

from xlatorch.runtime.base import record, regions
from xlatorch.runtime.base.record import COUNTERS
from xlatorch.runtime.execute import faults, host, settle
from xlatorch.runtime.execute.compile import executable
from xlatorch.runtime.execute.execution import uninterrupted
from xlatorch.runtime.ir.values import Data
from xlatorch.runtime.lower import cache, checks
from xlatorch.runtime.lower.executable import CompileRequest, check_memory
from xlatorch.runtime.plan import keep, prechecks, stages
from xlatorch.runtime.plan.collect import pack

__all__ = ["run_stages", "may_donate"]


def may_donate(v, out_avals) -> bool:
    """Whether device data ``v`` may be donated to a step with outputs of ``out_avals``: no live
    tensor holds it (or the user marked it donatable), an output can reuse it, and it is not small
    integer data held on the host too (``Data.host``: token ids, positions; maybe not uploaded
    yet, it saves nothing). Other data held on the host (a tiny float graph run there) is
    donated as if the device alone held it: which data a step donates is part of its key, and
    must not depend on whether an earlier graph ran on the host (a decode loop's prefill after
    its cache was reset there compiled again)."""
    return (v.holders == 0 or v.donor) and v.aval in out_avals and (v.host is None or not stages.small_integral(v.aval))


def run_stages(step, stage, commit) -> bool:
    """Run the step's graph as the stages ``stages.split`` gave its nodes, then commit the step
    whole. Nothing is committed before the last stage has run, so on a failure (a check that
    fires, an error) this returns False having changed nothing, and the caller runs the graph
    whole, which reports it as usual. Unless a stage donated: the step's donatable leaves go to
    the last stage reading each (``stages.donors``) when that is the last stage that compiles
    (``stages.donating``) and it has no check rows to read. After one did, an error fails the
    step whole instead: storages get back their data from before it where it still exists, the
    others carry the error.

    A compiled stage's checks are decided on the host when they can be (``prechecks.decided``,
    with the whole graph's in ``Step.prepare``, or for the stage, seeing the values the host
    stages made: a generation step's token ids and cache positions; the host stages take the
    values it computed instead of computing them again): it then compiles without them
    (``keep.UNCHECKED`` in its key) and reads no rows, so it may donate (a static KV cache
    updated in place is not copied at every token).
    Otherwise its rows are read after it runs, and one that is set makes the step run whole,
    from its leaves. A borrowed plan runs only if its compiled stages are cached as they ran
    before (``_VARIANTS``), or returns before its donating stage runs."""
    settle.settle()  # before the try below: an earlier step's error is not a stage's to swallow
    t_run = time.perf_counter_ns()
    g, gdev, timed = step.graph, step.storages[0].dev, step.timed
    nodes, leaves, enc = g.nodes, g.leaves, g.enc
    cut: dict = {}  # id(Out) -> Data: values computed by the stages so far
    # The host values found deciding the whole graph's checks (its small integer values): the host
    # stages take them, and the stages' checks see them. Not the values not found then: a host
    # stage may make their operands.
    views = {k: v for k, v in step.views.items() if v is not None} if step.views else {}
    outs = None  # the last compiled stage's arrays: what ran on the device
    whole = type(stage) is stages.Whole  # a tiny graph: on the host, or whole as usual
    borrowed = type(stage) is stages.Borrowed  # runs only if it compiles nothing, else whole as before
    parts = stages.stages(enc, g.root_refs, stage)
    out_avals = {st.value.aval for st in step.storages}
    donors = {} if whole else stages.donors(leaves, enc, stage, [v for v in step.data if may_donate(v, out_avals)])
    last = stages.donating(parts, nodes)
    donated = False
    try:
        for s, ks, refs in parts if borrowed else ():  # each compiled stage, as a plain key or as run before
            k = _stage_key(stages.encode(nodes, leaves, enc, stage, ks, refs, {}), gdev)
            if s & 1 and k not in cache.CACHE and _VARIANTS.get(k) not in cache.CACHE:
                return False
        for s, ks, refs in parts:
            roots = [nodes[r // 4096].outs[r % 4096] for r in refs]
            sn = [nodes[k] for k in ks]
            if not s & 1:  # a stage of changing nodes: on the host if it may
                uploaded = host.on_host(sn, cut, roots, gdev, whole, views)
                if uploaded is not None:
                    for o, d in zip(roots, uploaded):
                        cut[id(o)] = d
                    continue
                if whole or (borrowed and not donated):
                    return False
            sl, senc, srefs = stages.encode(nodes, leaves, enc, stage, ks, refs, cut)
            data = [v for v in sl if type(v) is Data]
            packed, kinds = pack(sl)
            checked = any(n.info.checked for n in sn)
            # Decided with the whole graph's (``step.keep``): a stage's checks are some of its checks,
            # on the same values; else decided for this stage, which sees what earlier stages made
            rows = checked and step.keep is not keep.UNCHECKED and not prechecks.decided(sn, cut, views)
            kept = keep.UNCHECKED if checked and not rows else ()
            out_avals = {o.aval for o in roots}
            # Only the last stage that compiles donates (after it only host stages that cannot fail a
            # check), so an error after a donation is its own execution's, as on the whole path.
            donate = () if s != last or rows else tuple(
                i for i, d in enumerate(data) if donors.get(id(d)) == s and d.aval in out_avals)  # fmt: skip
            key = plain = _stage_key((sl, senc, srefs), gdev)
            if donate or kept:  # the same key with what it donates and keeps; a borrowed plan finds it by ``plain``
                key = plain[:3] + (donate, gdev, kept) + plain[6:]
                _variant(plain, key)
            if borrowed and not donated and key not in cache.CACHE:
                return False  # nothing donated yet: only this stage or a later one donates
            req = CompileRequest(key, sn, sl, kinds, srefs, data, packed, donate, gdev, kept, cut, None, not s & 1)
            exe = executable(req, timed)
            check_memory(exe, gdev, sn, step.reason)
            record.add_sample("TensorsGraphSize", len(sn))
            cache.touch(exe)
            with timed("ExecuteDispatchTime"):
                donated |= bool(donate)
                outs = exe.compiled([d.array for d in data], packed)
            if exe.checks is not None:
                if checks.failure(exe.checks.rows, outs[-1], checks.where(exe.checks.rows, sn)) is not None:
                    return False
                outs = outs[:-1]
            for o, arr in zip(roots, outs):
                cut[id(o)] = Data(arr, o.aval, gdev)
    except Exception as e:
        if donated:
            faults.give_back_or_fail(step.storages, e)
            raise
        return False
    COUNTERS["GraphOnHost" if whole else "StagedSync"] += 1
    if donated:
        COUNTERS["StagedDonation"] += 1
    with uninterrupted():
        commit(step, [cut[id(st.value)] for st in step.storages], t_run, outs)
    return True


# A stage's plain key (nothing donated, checks read) -> its key as it last ran (donating, or
# lowered without checks): a borrowed plan's stages were compiled so.
_VARIANTS: dict = {}


def _variant(plain, key) -> None:
    if len(_VARIANTS) >= 256:
        _VARIANTS.clear()
    _VARIANTS[plain] = key


def _stage_key(encoded, gdev) -> tuple:
    """A stage's plain executable-cache key, from ``stages.encode``: nothing donated (slot 3),
    nothing kept (slot 5; ``keep.UNCHECKED`` there: its checks were decided on the host)."""
    sl, senc, srefs = encoded
    key = (tuple(senc), srefs, tuple([v.sig for v in sl]), (), gdev, (), None)
    opts = regions.options_key() if regions.ACTIVE or regions.CUSTOM else None
    return key if opts is None else key + (opts,)
