"""torch.compile(backend="openxla") on real models: Hugging Face GPT-2, BERT, T5 and Llama from
tiny configs and a small CNN train, infer and generate as CPU eager does (issue 28 §5)."""

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from tolerances import NOISE

import xlatorch.core.xla_model as xm
import xlatorch.debug.metrics as met
from xlatorch.debug import explain

tf = pytest.importorskip("transformers")
V = 128  # vocabulary


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def gpt2():
    m = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    m.loss_type = "ForCausalLM"  # unnamed, transformers logs a warning in the forward: a graph break
    return m


def bert():
    return tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                            intermediate_size=64, vocab_size=V, max_position_embeddings=32,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))  # fmt: skip


def t5():
    return tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8,
                                                     d_ff=64, num_heads=4, vocab_size=V, dropout_rate=0.0,
                                                     decoder_start_token_id=0, pad_token_id=0))  # fmt: skip


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=64, vocab_size=V,
                                              max_position_embeddings=32))  # fmt: skip


class CNN(nn.Module):
    """torchvision's building blocks: convolutions, batch norm (running statistics are
    buffers the compiled step updates), pooling, a classifier."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))  # fmt: skip

    def forward(self, x, labels=None):
        logits = self.f(x)
        return logits if labels is None else nn.functional.cross_entropy(logits, labels)


MODELS = {"gpt2": gpt2, "bert": bert, "t5": t5, "llama": llama, "cnn": CNN}


def _batch(name, g) -> dict:
    if name == "cnn":
        return {"x": torch.randn(4, 1, 12, 12, generator=g), "labels": torch.randint(0, 10, (4,), generator=g)}
    ids = torch.randint(1, V, (2, 12), generator=g)
    labels = torch.randint(1, V, (2, 6), generator=g) if name == "t5" else ids
    return {"input_ids": ids, "labels": labels}


def _pair(name):
    torch.manual_seed(0)
    cpu = MODELS[name]()
    dev = MODELS[name]()
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to(xm.xla_device())


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


# Plain SGD passes each step's gradient rounding (NOISE times the largest element, see
# tests/tolerances.py) into the parameters unamplified; a loss after k steps differs by the
# forward's own rounding plus k such steps' worth: (1 + STEPS) * NOISE relative.
STEPS = 3


@pytest.mark.parametrize("name", MODELS)
def test_training_under_compile_equals_cpu_eager_and_compiles_once(name):
    cpu, dev = _pair(name)
    step = torch.compile(dev, backend="openxla")
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    met.clear_counters()
    want, got, compiles = [], [], []
    for i in range(STEPS):
        b = _batch(name, g)
        loss = _loss(cpu(**b))
        loss.backward()
        opt_c.step()
        opt_c.zero_grad()
        want.append(loss.item())
        loss = _loss(step(**{k: v.to("xla") for k, v in b.items()}))
        loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        xm.mark_step()
        got.append(loss.item())
        compiles.append(met.counter_value("UncachedCompile"))
        if i == 0:
            first = {id(r) for r in explain.compile_reasons()}
    torch.testing.assert_close(got, want, rtol=(1 + STEPS) * NOISE, atol=0)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert met.counter_value("DynamoCompile") == 2  # one forward and its backward
    assert met.counter_value("CompiledGraphOpByOp") is None  # each graph is one node
    # the first step compiled everything (if not: what the later compile was, for the log)
    why = {k: met.counter_value(k) for k in ("UnsharedScalarRecompile", "CompileCacheEviction", "ChecksOnHost")}
    later = [str(r) for r in explain.compile_reasons() if id(r) not in first]  # the explainer's account
    assert compiles[-1] == compiles[0], (compiles, why, later)


@pytest.mark.parametrize("name", MODELS)
def test_inference_under_compile_equals_cpu_eager(name):
    cpu, dev = _pair(name)
    cpu.eval()
    dev.eval()
    fn = torch.compile(dev, backend="openxla")
    b = _batch(name, torch.Generator().manual_seed(2))
    if name == "t5":
        b["decoder_input_ids"] = b.pop("labels")
    else:
        b.pop("labels")
    with torch.no_grad():
        want = cpu(**b)
        got = fn(**{k: v.to("xla") for k, v in b.items()})
    want, got = (o if isinstance(o, torch.Tensor) else o.logits for o in (want, got))
    # One forward's rounding: NOISE times the largest logit.
    torch.testing.assert_close(got.cpu(), want, rtol=NOISE, atol=NOISE * float(want.abs().max()))
    assert met.counter_value("CompiledGraphOpByOp") is None


@pytest.mark.parametrize(
    "name, cache",
    [("gpt2", "static"), ("gpt2", "dynamic"), ("llama", "static")],
)
def test_generate_with_a_compiled_forward_gives_cpus_greedy_tokens(name, cache):
    """Hugging Face's recipe: ``model.forward = torch.compile(model.forward)``; a static cache
    keeps one shape per phase (prefill, decode), the default dynamic cache grows a token a step
    (a graph per length). The tiny models' logits are far apart next to the rounding noise
    (random init, 128 tokens), so greedy tokens agree exactly."""
    cpu, dev = _pair(name)
    cpu.eval()
    dev.eval()
    ids = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 4 if cache == "static" else 2, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = cpu.generate(ids, **kw)
    dev.forward = torch.compile(dev.forward, backend="openxla")
    met.clear_counters()
    got = dev.generate(ids.to("xla"), **kw)
    assert torch.equal(got.cpu(), want)
    assert met.counter_value("CompiledGraphOpByOp") is None
    if cache == "static":
        assert met.counter_value("DynamoCompile") == 2  # prefill and decode


def test_collectives_inside_a_compiled_function_on_one_replica():
    """torch_xla's test_mp_replication compiles ``xm.all_reduce`` with fullgraph=True; the
    collectives are calls in Dynamo's graph (tests/test_distributed.py runs two replicas)."""
    x = torch.arange(6.0).reshape(2, 3)

    def fn(a, b):
        xm.all_reduce(xm.REDUCE_SUM, [a, b], scale=0.5)  # in place; one replica: unchanged
        return xm.all_reduce(xm.REDUCE_SUM, a) * 2, xm.all_gather(a, dim=1), xm.reduce_scatter("sum", b, 1.0, 0, 1)

    a, b = x.to("xla"), (x + 1).to("xla")
    s, gathered, scattered = torch.compile(fn, backend="openxla", fullgraph=True)(a, b)
    torch.testing.assert_close(s.cpu(), x * 2)
    torch.testing.assert_close(gathered.cpu(), x)
    torch.testing.assert_close(scattered.cpu(), x + 1)
    torch.testing.assert_close(a.cpu(), x)


def test_collectives_inside_compiled_functions_on_two_replicas(tmp_path):
    import mp_workers

    import xlatorch.distributed.xla_multiprocessing as xmp

    n = 2
    xmp.spawn(mp_workers.compiled_collectives, args=(str(tmp_path),), nprocs=n, start_method="forkserver")
    xs = [torch.arange(12.0).reshape(4, 3) + 100 * r for r in range(n)]
    total = sum(xs)
    for r in range(n):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert got.pop("op_by_op") is None  # each compiled graph is one node of the SPMD program
        want = {"reduce": total, "list0": total * 0.5, "list1": total + n, "max": xs[-1],
                "gather": torch.cat(xs, 1), "scatter": (total + n).chunk(n, 0)[r]}  # fmt: skip
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=lambda m, k=k, r=r: f"replica {r}, {k}: {m}")


def test_a_fake_tensor_meeting_a_real_one_says_which_is_which():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(3, device="xla")
    with FakeTensorMode():
        fake = torch.empty(3, device="xla")
    with pytest.raises(RuntimeError, match=r"got a FakeTensor \(a tensor of a trace.*together with real xla"):
        torch.cat([real, fake])


def test_a_tensor_built_from_python_data_in_a_compiled_function_is_a_constant_of_the_graph():
    """``torch.tensor(data, device=...)`` while Dynamo traces is fake like every other tensor
    (Hugging Face's DynamicCache starts from ``torch.tensor([], device=...)``); the graph holds
    the data as a constant and stays one node."""

    def fn(x):
        empty = torch.tensor([], dtype=x.dtype, device=x.device)
        w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16, device=x.device)
        return torch.cat([empty, x]) * w + torch.tensor(2)

    x = torch.arange(3.0)
    met.clear_counters()
    got = torch.compile(fn, backend="openxla", fullgraph=True)(x.to("xla"))
    torch.testing.assert_close(got.cpu(), fn(x))
    assert met.counter_value("CompiledGraphOpByOp") is None
