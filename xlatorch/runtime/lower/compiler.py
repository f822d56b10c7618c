"""Options handed to XLA's compiler with the graphs xlatorch compiles.

Every graph rounds bfloat16 and float16 values where PyTorch does, after each op
(``xla_allow_excess_precision=false``; ``_AS_CPU_ROUNDS``).

A graph that will run once or a few times should compile fast; a training step's graph runs
thousands of times and should run fast. Two kinds of graph are the first kind: the stages of
a staged sync whose nodes changed shape (``runtime/plan/stages.py``: a growing ``generate()``
loop compiles one per length) and the graph computing an optimizer's new state before its
first step (``runtime/plan/births.py``). On CPU they compile at XLA's lowest optimization level
with its classic fusion emitters, in one LLVM module: the first two options alone cut a fifth
each, together a half, the third a fifth more (``bench.generate``, dynamic cache: first call
8.0 -> 4.3 -> 3.8 s, no slower per token). Every other graph gets XLA's defaults: the
classic emitters alone would cut the first step of small Hugging Face models by 20-40%
(``bench.first_steps``), but they make the steady MNIST step 15% slower (``bench.bench``);
the lowest level makes a step 2-3x slower.

A graph compiled this way that is run again and again after all (a shape that keeps coming
back) is compiled once more, with the defaults, at its ``RUNS_BEFORE_OPTIMIZING``-th cache
hit (counter ``OptimizedRecompile``): a fixed point, so the same program gives the same
numbers run after run. Only a graph with enough work for the defaults to pay back a compile
is (``worth_optimizing``: XLA's own cost analysis, so the choice is the same every run): a
``generate()`` loop's per-length attention stages (22 nodes, 2e4 flops) run in 0.046 ms at
either level, and recompiling their 30 lengths stalled the dynamic-cache loop's ninth call
5 s (0.24 s before and after); a 256x1024 MLP layer (5e8 flops) runs 1 ms faster per call.

On CPU a graph compiled to run fast that has a weight-gradient convolution (the batch
dimension contracted: a window as large as the image, ``_WEIGHT_GRADIENT``) has its
convolutions compiled by XLA's own (Eigen) kernels instead of YNNPACK's
(``_EIGEN_CONVOLUTIONS``). YNNPACK runs those 2-2.4x slower (MNIST's second conv 11.6 -> 4.9
ms, a ResNet 3x3 64-channel layer at 56x56 49 -> 23 ms) and forward and input-gradient
convolutions about as fast: a ResNet conv's forward and backward 81 -> 56 ms, the MNIST
step 0.59x torch_xla's time from 1.08x (``bench.vs_torch_xla``, with the max pools of
``lowering/pool.py``). Depthwise convolutions (grouped: not this pattern) run faster on
YNNPACK (a graph with both gives them up too), and graphs without a weight gradient
(inference) keep it: there it wins as often
as it loses. Finding the pattern reads the module's text: 13 ms of the GPT bench's 0.9 s
first step.

``XLATORCH_XLA_OPTIONS="name=value,..."`` gives every graph these options instead
(``XLATORCH_XLA_OPTIONS=``, empty: XLA's defaults everywhere); names are fields of XLA's
``DebugOptions``, e.g. ``xla_cpu_use_fusion_emitters=false``. Options are part of the
persistent cache's key.

Inside a ``torch_xla.compile(custom_compile_options={...})`` region (``base/regions.py``) every
graph compiled gets those options too, over the ones above; they are part of its cache key.
"""

from __future__ import annotations

import re

from xlatorch.runtime.base import config, regions

__all__ = ["options", "compile", "worth_optimizing"]

RUNS_BEFORE_OPTIMIZING = 16
# Flops plus bytes accessed (XLA's cost analysis) below which a fast-compiled graph is kept.
MIN_WORK_TO_OPTIMIZE = 10**7
_FAST_COMPILE = {
    "cpu": {
        "xla_cpu_use_fusion_emitters": False,
        "xla_backend_optimization_level": 0,
        "xla_cpu_parallel_codegen_split_count": 1,  # one LLVM module: a small graph gains nothing from more
    }
}

# Every graph: a bfloat16 / float16 value is rounded wherever its op's result is, as PyTorch
# rounds each op's result. XLA's default lets a fusion keep such intermediates in float32
# (it drops the convert pairs between ops): a chain of half-float ops whose first is a matmul
# (Muon's Newton-Schulz step, ``b * A + c * (A @ A)``) then differed from CPU in half its
# elements, where every op alone matched.
_AS_CPU_ROUNDS = {"xla_allow_excess_precision": False}

# XLA's CPU library fusions: its defaults (dots, reductions, convolutions) less convolutions.
_EIGEN_CONVOLUTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
}
# A convolution whose input has batch and feature swapped, ungrouped: the weight gradient of a
# convolution as JAX writes it (``jax.vjp``, ``lowering/nn.convolution_backward``).
_WEIGHT_GRADIENT = re.compile(
    r"stablehlo\.convolution[^\n]*dim_numbers = \[f, b,[^\n]*batch_group_count = 1 : i64, feature_group_count = 1 : i64"
)


def options(once: bool = False, platform: str | None = None) -> dict | None:
    """The compiler options for a graph on ``platform`` (default: JAX's default backend), or
    None; ``once``: the graph is expected to run once or a few times. A ``torch_xla.compile``
    region's ``custom_compile_options`` are added (they win)."""
    base = _options(once, platform)
    if regions.CUSTOM:  # torch_xla.set_custom_compile_options
        base = {**(base or {}), **regions.CUSTOM}
    region = regions.current() if regions.ACTIVE else None
    if region is not None and region.options:
        return {**(base or {}), **region.options}
    return base


def _options(once: bool, platform: str | None) -> dict | None:
    given = config.env("XLATORCH_XLA_OPTIONS")  # {} when set empty: no options at all
    if given is not None:
        return given or None
    if not once:
        return dict(_AS_CPU_ROUNDS)
    if platform is None:
        import jax

        platform = jax.default_backend()
    return {**_AS_CPU_ROUNDS, **_FAST_COMPILE.get(platform, {})}


def compile(lowered, once: bool = False):
    """``lowered.compile()`` (a ``jax.stages.Lowered``) with ``options(once)``; an error
    caused by options the user set says where they came from."""
    opts = options(once)
    if not once and config.env("XLATORCH_XLA_OPTIONS") is None and _weight_gradient_on_cpu(lowered):
        opts = {**_EIGEN_CONVOLUTIONS, **(opts or {})}
    try:
        return lowered.compile(compiler_options=opts)
    except Exception as e:
        given = config.env("XLATORCH_XLA_OPTIONS")
        if given:
            e.add_note(f"xlatorch: compiled with XLATORCH_XLA_OPTIONS {given} (unset it for the defaults)")
        region = regions.current() if regions.ACTIVE else None
        if region is not None and region.options:
            e.add_note(f"xlatorch: compiled with torch_xla.compile's custom_compile_options {region.options}")
        raise


def _weight_gradient_on_cpu(lowered) -> bool:
    """Whether ``lowered`` is for the CPU and computes a convolution's weight gradient."""
    import jax

    if jax.default_backend() != "cpu":
        return False
    text = lowered.as_text()
    return "stablehlo.convolution" in text and _WEIGHT_GRADIENT.search(text) is not None


def worth_optimizing(compiled) -> bool:
    """Whether a graph compiled to compile fast (a ``jax.stages.Compiled``) has work enough
    for XLA's defaults to pay back a second compile: ``MIN_WORK_TO_OPTIMIZE`` flops plus
    bytes accessed, by XLA's cost analysis (True where there is none)."""
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if "flops" not in cost and "bytes accessed" not in cost:
            return True
        work = float(cost.get("flops", 0.0)) + float(cost.get("bytes accessed", 0.0))
    except Exception:
        return True
    return work >= MIN_WORK_TO_OPTIMIZE
