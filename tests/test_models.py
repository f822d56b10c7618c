"""What users bring: models with shared (tied) parameters train exactly as on CPU."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xlatorch.core.xla_model as xm


def _tied():
    m = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    return m


def test_a_tie_survives_moving_to_the_device_and_back():
    m = _tied().to(xm.xla_device())
    assert m[1].weight is m[0].weight
    assert len(list(m.parameters())) == 1
    m.to(torch.float64)
    assert m[1].weight is m[0].weight and m[0].weight.dtype == torch.float64
    m.half()
    assert m[1].weight is m[0].weight and m[0].weight.dtype == torch.float16
    m.float().cpu()
    assert m[1].weight is m[0].weight and m[0].weight.device.type == "cpu"


class _Siblings(nn.Module):
    """A parameter shared by sibling submodules, a tie made after construction, a shared buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight  # siblings
        self.register_buffer("scale", torch.tensor(2.0))
        self.c.register_buffer("scale", self.scale)  # a buffer held by two modules

    def forward(self, x):
        return self.c(self.b(self.a(x)) * self.c.scale) * self.scale


def test_ties_across_siblings_and_buffers():
    m = _Siblings()
    m.tie_later = nn.Linear(4, 4)
    m.tie_later.bias = m.c.bias  # a tie through an attribute set after construction
    m.to("xla")
    assert m.b.weight is m.a.weight and m.tie_later.bias is m.c.bias and m.c.scale is m.scale
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert sum(len(g["params"]) for g in opt.param_groups) == len({id(p) for p in m.parameters()}) == 6


def test_the_gradient_of_a_tied_parameter_is_the_sum_over_its_uses():
    torch.manual_seed(0)
    cpu = _tied()
    dev = _tied()
    dev.load_state_dict(cpu.state_dict())
    dev.to("xla")
    tokens = torch.tensor([[1, 2, 3]])
    for m, d in ((cpu, "cpu"), (dev, "xla")):
        m(tokens.to(d)).square().sum().backward()
    torch.testing.assert_close(dev[0].weight.grad.cpu(), cpu[0].weight.grad)


class _TinyLM(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied input and output embeddings

    def forward(self, x):
        return self.head(self.norm(self.block(self.emb(x))))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_tied_embedding_language_model_trains_as_on_cpu(optimizer):
    torch.manual_seed(0)
    ref = _TinyLM()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 50, (8, 4, 12), generator=g)

    def train(device):
        m = _TinyLM()
        m.load_state_dict(ref.state_dict())
        m.emb.weight = m.head.weight  # load_state_dict keeps the tie; make sure of it
        m.to(device)
        opt = (torch.optim.SGD(m.parameters(), lr=0.1) if optimizer == "sgd"
               else torch.optim.AdamW(m.parameters(), lr=1e-2))  # fmt: skip
        losses = []
        for batch in data:
            batch = batch.to(device)
            opt.zero_grad()
            logits = m(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 50), batch[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            if device != "cpu":
                xm.mark_step()
            losses.append(loss.item())
        return losses, m

    cpu_losses, cpu_m = train("cpu")
    xla_losses, xla_m = train("xla")
    assert xla_m.head.weight is xla_m.emb.weight
    torch.testing.assert_close(xla_losses, cpu_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xla_m.emb.weight.detach().cpu(), cpu_m.emb.weight.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: torch.zeros(2, device="xla:3"), lambda: torch.ones(2).to("xla:2"),
                                  lambda: torch.ones(2, device="xla").to("xla:1")])  # fmt: skip
def test_a_device_this_process_does_not_have_is_an_error(make):
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        make()


def test_a_backward_before_import_xlatorch_does_not_stop_device_backward_passes():
    # A backward pass that ran on CPU before ``import xlatorch`` sized autograd's device queues
    # without the xla device. Device passes run in the calling thread instead, those started
    # from a device tensor and those started from a loss computed on the host through device
    # ops alike, so both work; a pass that would still need autograd's device queue gets an
    # error that says what to do (below).
    import os
    import sys

    from tests import warm

    code = (
        "import torch\n"
        "torch.ones(2, requires_grad=True).sum().backward()  # a backward on CPU first\n"
        "import xlatorch\n"
        "x = torch.ones(2, device='xla', requires_grad=True)\n"
        "(x * 2).sum().backward()  # from a device tensor\n"
        "print('GRAD', x.grad.cpu().tolist())\n"
        "(x * 3).cpu().sum().backward()  # from a CPU tensor, through device ops\n"
        "print('GRAD', x.grad.cpu().tolist())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                 env=dict(os.environ, PYTHONPATH=root))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["GRAD", "[2.0,", "2.0]", "GRAD", "[5.0,", "5.0]"], r.stdout


def test_the_engine_s_device_queue_assert_becomes_an_error_that_says_what_to_do():
    from xlatorch.runtime.trace.modules import _IMPORT_ORDER, _checked_backward

    def run(*args, **kwargs):  # what the engine raises when its device queues lack the xla device
        raise RuntimeError("ordinal >= 0 && ordinal < static_cast<int>(device_ready_queues_.size()) INTERNAL ASSERT")

    with pytest.raises(RuntimeError, match="the autograd engine started before `import xlatorch`") as e:
        _checked_backward(run)((torch.ones(2),), None)
    assert str(e.value) == _IMPORT_ORDER
