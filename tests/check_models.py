"""Factories for tests/test_check.py: ``(model, inputs, loss_fn[, make_optimizer])`` on CPU.

Each lives in this file so the findings' source lines are this file's (user code)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def _loss(out):
    return out.float().square().mean()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))  # LINE: relu


def mlp():
    torch.manual_seed(0)
    return Mlp(), (torch.randn(8, 16),), _loss


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x, target):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), target)


def cnn():
    torch.manual_seed(0)
    return Cnn(), (torch.randn(4, 1, 14, 14), torch.randint(0, 10, (4,))), lambda loss: loss


class WithRead(Mlp):
    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.sum().item() > 0:  # LINE: host read
            h = h * 0.5
        return self.b(h)


def with_read():
    torch.manual_seed(0)
    return WithRead(), (torch.randn(8, 16),), _loss, lambda p: torch.optim.SGD(p, lr=0.1)


class WithBranch(Mlp):
    """The branch a host read takes depends on the data: the dry run must take the real one."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        if (x[0, 0] > 100).item():  # False for these inputs: a dry run reading zeros would agree anyway
            h = h * 2
        if (x.abs().sum() > 1).item():  # True for these inputs: zeros would say False
            h = torch.unique(h.argmax(1)).float().sum() + h  # LINE: fallback behind a branch
        return self.b(h)


def with_branch():
    torch.manual_seed(0)
    return WithBranch(), (torch.randn(8, 16),), _loss


class WithFallback(Mlp):
    def forward(self, x):
        h = torch.relu(self.a(x))
        k = torch.unique(x.argmax(1))  # LINE: fallback
        return self.b(h) + k.numel()


def with_fallback():
    torch.manual_seed(0)
    return WithFallback(), (torch.randn(8, 16),), _loss


class WithMask(Mlp):
    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h[h.sum(1) > 0])  # LINE: data-dependent


def with_mask():
    torch.manual_seed(0)
    return WithMask(), (torch.randn(8, 16),), _loss


class Growing(Mlp):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(torch.relu(self.a(x))[: 4 + self.calls % 4])  # LINE: baked-in number


def growing():
    torch.manual_seed(0)
    return Growing(), (torch.randn(8, 16),), _loss


class WrongDevice(Mlp):
    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + torch.ones(32))  # LINE: CPU tensor


def wrong_device():
    torch.manual_seed(0)
    return WrongDevice(), (torch.randn(8, 16),), _loss


class Half(Mlp):
    def forward(self, x):
        h = torch.relu(self.a(x)).to(torch.complex32)  # LINE: unsupported dtype
        return self.b(h.real.float())


def unsupported_dtype():
    torch.manual_seed(0)
    return Half(), (torch.randn(8, 16),), _loss


def mlp_adafactor():
    """Adafactor reads each parameter's norm on the host (``.item()``) in its step."""
    torch.manual_seed(0)
    return Mlp(), (torch.randn(8, 16),), _loss, lambda p: torch.optim.Adafactor(p, lr=0.01)


def bert():
    tf = __import__("transformers")
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
    )
    ids = torch.randint(0, 100, (2, 16))
    return tf.BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}, lambda out: out.loss


def line(tag: str) -> str:
    """``tests/check_models.py:N`` of the line marked ``# LINE: tag``, as findings name it."""
    import os

    path = os.path.abspath(__file__)
    with open(path) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# LINE: {tag}"):
                return f"{os.path.relpath(path)}:{i}"
    raise KeyError(tag)
