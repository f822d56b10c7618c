"""Arguments CPU refuses: the device raises CPU's exception type with CPU's words, at the call.

PyTorch's meta kernels and Python references (which trace shapes and dtypes here) check what
CPU's kernels check, often in words and exception types of their own: ``amax`` over an empty
dimension is an IndexError naming ``amax()`` on CPU and a RuntimeError without it on meta. Once
a meta kernel or decomposition has refused a call, CPU's kernel is run on zeros of the same
shapes and dtypes and its error is raised (``runtime/trace/nodes.py::error_on_cpu``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import xlatorch.core.xla_model as xm
from tests.cpu_twin import refused_as_on_cpu


def _ones(*shape, dtype=torch.float32):
    return lambda d: torch.ones(*shape, dtype=dtype, device=d)


_REFUSED = {
    # meta: RuntimeError "reducing over zero-size dimension ..."; CPU: IndexError naming amax()
    "amax over an empty dim": lambda d: torch.amax(_ones(2, 0)(d), 1),
    "amin of an empty tensor": lambda d: torch.amin(_ones(0)(d)),
    "aminmax over an empty dim": lambda d: torch.aminmax(_ones(2, 0)(d), dim=1),
    # meta: "duplicate value in the list of dims"
    "amax over a dim twice": lambda d: torch.amax(_ones(2, 2)(d), (0, 0)),
    # the out= overload's meta: "Attempting to cast ..."; CPU: the dtypes must match
    "amax(out=int32)": lambda d: torch.amax(_ones(3)(d), out=torch.empty((), dtype=torch.int32, device=d)),
    # decomposed ops (PyTorch's references): their checks' words
    "trace of a 3-d tensor": lambda d: torch.trace(_ones(2, 2, 2)(d)),
    "vdot of two dtypes": lambda d: torch.vdot(_ones(2)(d), _ones(2, dtype=torch.float16)(d)),
    "roll with more shifts than dims": lambda d: torch.roll(_ones(3)(d), (1, 2), 0),
    "gather with a larger index": lambda d: torch.gather(
        _ones(1, 1)(d), 0, torch.zeros(2, 2, dtype=torch.long, device=d)
    ),
    "layer_norm of another shape": lambda d: F.layer_norm(_ones(2, 3)(d), (2, 2)),
    "softshrink with a negative lambda": lambda d: F.softshrink(_ones(3)(d), -0.5),
    "max_pool3d of an empty dim": lambda d: F.max_pool3d(_ones(1, 1, 0, 2, 2)(d), 1),
    "embedding of a 0-d weight": lambda d: F.embedding(torch.zeros(2, dtype=torch.long, device=d), _ones()(d)),
    "narrow_copy of a negative length": lambda d: torch.narrow_copy(_ones(10)(d), 0, 0, -1),
    "cat of 2-d and 4-d": lambda d: torch.cat([_ones(2, 2)(d), _ones(1, 1, 2, 2)(d)]),
    # multinomial's checks of its arguments, in CPU's order, at the call (JAX's top_k said
    # "k argument to top_k must be no larger than size along axis" at the sync)
    "multinomial of more samples than categories": lambda d: torch.multinomial(_ones(2)(d), 3),
    "multinomial of no samples": lambda d: torch.multinomial(_ones(2)(d), 0),
    "multinomial of a 3-d tensor": lambda d: torch.multinomial(_ones(1, 2, 2)(d), 1),
    "multinomial of ints": lambda d: torch.multinomial(_ones(2, dtype=torch.long)(d), 1),
    # out= of data-dependent ops (runtime/trace/dynamic.py): ran on CPU, where the out= tensor
    # was a copy, so an out= that is the input was taken
    "masked_select(out=its input)": lambda d: (lambda x: torch.masked_select(x, x > 0, out=x))(_ones(4)(d)),
    "masked_select(out=its mask)": lambda d: (lambda m: torch.masked_select(m, m, out=m))(
        torch.ones(4, dtype=torch.bool, device=d)
    ),
    "masked_select(out=long)": lambda d: torch.masked_select(
        _ones(4)(d), torch.ones(4, dtype=torch.bool, device=d), out=torch.empty(0, dtype=torch.long, device=d)
    ),
    "nonzero(out=float)": lambda d: torch.nonzero(_ones(4)(d), out=torch.empty(0, device=d)),
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_an_argument_cpu_refuses_raises_cpus_error_at_the_call(name):
    refused_as_on_cpu(_REFUSED[name], at_call=True)


def test_out_of_data_dependent_ops_still_runs():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0])
    out = torch.empty(0, device="xla")
    got = torch.masked_select(x.to("xla"), x.to("xla") > 0, out=out)
    assert got is out and torch.equal(out.cpu(), torch.masked_select(x, x > 0))
    idx = torch.empty(7, dtype=torch.long, device="xla")  # resized, as on CPU
    torch.nonzero(x.to("xla") > 0, out=idx)
    assert torch.equal(idx.cpu(), torch.nonzero(x > 0))


_RESIZED_OUTS = {
    "add": lambda d, o: torch.add(_ones(3)(d), 1, out=o),
    "sum": lambda d, o: torch.sum(_ones(3)(d), 0, keepdim=True, out=o),
    "mm": lambda d, o: torch.mm(_ones(1, 3)(d), _ones(3, 1)(d), out=o),
    "linspace": lambda d, o: torch.linspace(0, 1, 3, out=o),  # CPU does not warn
    "masked_select": lambda d, o: torch.masked_select(_ones(3)(d), _ones(3)(d) > 0, out=o),
    "nonzero": lambda d, o: torch.nonzero(_ones(3)(d), out=o.long()),
}


@pytest.mark.parametrize("name", sorted(_RESIZED_OUTS))
@pytest.mark.parametrize("elements", [7, 0])
def test_a_resized_out_warns_as_on_cpu(name, elements):
    # CPU: "An output with one or more elements was resized since it had shape [7] ...", at
    # each call; nothing for an empty out= (the device said nothing at all)
    said = {}
    for d in ("cpu", "xla"):
        for _ in range(2):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = _RESIZED_OUTS[name](d, torch.empty(elements, device=d))
            said.setdefault(d, []).append([str(w.message) for w in seen])
        assert out.shape == _RESIZED_OUTS[name]("cpu", torch.empty(0)).shape
    assert said["xla"] == said["cpu"]


@pytest.mark.parametrize("elements", [7, 0])
def test_an_out_the_cpu_fallback_resizes_is_resized_on_the_device(elements):
    # linspace / arange with out= run on CPU (not lowered): the device's out kept its shape
    # and held the result's values under it (shape [7], three values)
    for make in (lambda o: torch.linspace(0, 1, 3, out=o), lambda o: torch.arange(0, 3, out=o)):
        want = make(torch.empty(elements))
        out = torch.empty(elements, device="xla")
        got = make(out)
        assert got is out and out.shape == want.shape
        torch.testing.assert_close(out.cpu(), want, atol=0, rtol=0)


def test_asking_cpu_for_its_error_leaves_its_generator_as_it_was():
    # multinomial's meta refuses 0-d input; CPU's kernel, asked for its error, draws nothing
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="prob_dist must be 1 or 2 dim"):
        torch.multinomial(torch.ones((), device="xla"), 1)
    with pytest.raises(IndexError, match=r"amax\(\): Expected reduction dim 1 to have non-zero size"):
        torch.amax(torch.ones(2, 0, device="xla"), 1)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_tensor_of_more_than_64_dims_is_refused_at_its_upload():
    # numpy's arrays hold at most 64: its ValueError "number of dimensions must be within [0, 64]"
    x = torch.ones([1] * 65)
    with pytest.raises(RuntimeError, match="only tensors with up to 64 dims are supported on the xla device"):
        x.to(xm.xla_device())
    assert torch.ones([1] * 64).to("xla").cpu().dim() == 64
