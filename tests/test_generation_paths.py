"""Text generation's two paths on the device (docs/text-generation.md): Hugging Face's
``generate()`` with a static KV cache and the forward under ``torch.compile(backend="openxla")``,
and the lazy path, whose staged steps donate the KV cache they update in place. Counts, never
timings."""

import os
import sys

import pytest
import torch

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from tests import warm

tf = pytest.importorskip("transformers")
V = 128
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=64, vocab_size=V,
                                              max_position_embeddings=64)).eval()  # fmt: skip


def _count(name) -> int:
    return met.counter_value(name) or 0


KW = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_forward_with_a_static_cache_gives_cpus_tokens_and_compiles_once():
    """Hugging Face's fast path. The first call compiles the prefill and the decode step (at
    most 6 programs); the second traces the prefill once more (Hugging Face's static cache
    initializes itself lazily: the first prefill was traced creating it, and Dynamo guards
    on that), and from then on a call compiles nothing. Each token is a staged step whose
    compiled forward's checks (the embedding's ids, the cache's positions) are decided on the
    host, so it donates the static KV cache it updates in place."""
    cpu = _llama()
    dev = _llama().to(xm.xla_device())
    dev.forward = torch.compile(dev.forward, backend="openxla")
    compiles = []
    for seed in range(4):
        if seed == 2:
            start = {k: _count(k) for k in ("StagedSync", "StagedDonation")}
        ids = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **KW)
            before = _count("UncachedCompile")
            x = ids.to("xla")
            got = dev.generate(x, attention_mask=torch.ones_like(x), **KW).cpu()
        compiles.append(_count("UncachedCompile") - before)
        assert torch.equal(got, want), seed
    assert _count("CompiledGraphOpByOp") == 0
    assert compiles[0] <= 6
    assert compiles[1] <= 1  # the prefill over the initialized cache
    assert compiles[2:] == [0, 0]
    staged, donated = (_count(k) - v for k, v in start.items())
    assert staged > 0 and donated == staged, (staged, donated)


_LAZY = """
import torch, transformers as tf
import xlatorch.debug.metrics as met
from tests.test_generation_paths import KW, V, _llama
cpu, dev = _llama(), _llama().to("xla")
for seed in range(3):
    ids = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **KW)
        x = ids.to("xla")
        assert torch.equal(dev.generate(x, attention_mask=torch.ones_like(x), **KW).cpu(), want), seed
print(met.counter_value("StagedSync") or 0, met.counter_value("StagedDonation") or 0)
"""


@pytest.mark.parametrize("checks", ["1", "0"])
def test_lazy_static_cache_generate_runs_in_stages_donates_its_cache_and_gives_cpus_tokens(checks):
    """The lazy path, with on-device checks (the default) and without: each token is a staged
    step (``input_ids`` grows) and the tokens are CPU's. The forward's stage is the last that
    compiles (the stop check's bookkeeping after it runs on the host), and its checks (the
    embedding's token ids, the cache's positions) are decided on the host from what the host
    stages made, so it donates the static KV cache it updates in place at every token."""
    env = dict(os.environ, XLATORCH_CHECKS=checks, XLATORCH_CACHE_DIR="", PYTHONPATH=ROOT)
    out = warm.run([sys.executable, "-c", _LAZY], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    staged, donated = map(int, out.stdout.split()[-2:])
    assert staged > 0 and donated == staged


def _grow(steps, cache):
    """A growing loop (a generation loop's shape): ``ids`` gains a column per step, ``cache``
    (a static buffer) is updated in place by ops that need no check."""
    ids = torch.zeros(1, 1, dtype=torch.long, device="xla")
    w = torch.ones(64, 64, device="xla")
    arrays = []
    for t in range(steps):
        h = cache @ w  # enough unchanged nodes for the step to run in stages
        for _ in range(40):
            h = torch.tanh(h) * 0.5
        cache.mul_(0.5).add_(h.mean())
        ids = torch.cat([ids, ids[:, -1:] + 1], dim=1)
        # The host reads a value of the step, as a stop check reads the new token: one sync per step
        # (a read of ``ids`` alone would run on the host, leaving the step pending)
        assert not bool(h[0, 0] > 1e30) and int(ids[0, -1]) == t + 1
        arrays.append(cache._st.value.array if hasattr(cache, "_st") else None)
    return ids, arrays


def test_a_staged_step_donates_the_buffer_it_updates_in_place():
    """The old buffer of a tensor updated in place goes to the stage computing its new value;
    the result equals the step run undivided on the CPU."""
    cpu = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) / 4096
    want = cpu.clone()
    w = torch.ones(64, 64)
    for _ in range(12):
        h = want @ w
        for _ in range(40):
            h = torch.tanh(h) * 0.5
        want.mul_(0.5).add_(h.mean())
    cache = cpu.to("xla")
    xm.mark_step()
    before = _count("StagedDonation"), _count("StagedSync")
    _, arrays = _grow(12, cache)
    staged, donated = _count("StagedSync") - before[1], _count("StagedDonation") - before[0]
    torch.testing.assert_close(cache.cpu(), want)
    from xlatorch.runtime.base import config

    if config.CHECKS and donated == 0:
        pytest.skip("this loop's graph holds a checked node here")
    assert staged > 0 and donated > 0
    assert any(a is not None and a.is_deleted() for a in arrays[:-1])  # an old buffer was reused
