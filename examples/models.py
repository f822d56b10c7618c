"""The three training programs that tests and benchmarks share: the guides' MNIST CNN
(SGD momentum, NLLLoss), a 3-layer MLP (Adam) and a small GPT-style decoder (AdamW)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


class MNISTNet(nn.Module):
    """The migration guide's CNN."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1)
        self.fc1 = nn.Linear(7 * 7 * 64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 7 * 7 * 64)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


class MLP(nn.Module):
    def __init__(self, d_in=784, hidden=1024, d_out=10):
        super().__init__()
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        att = att.masked_fill(mask[:t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=1000, d=256, heads=4, layers=2, seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)))
        self.register_buffer("positions", torch.arange(seq))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:t])
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.ln(x))


class Program:
    """A model, its optimizer, its loss and a batch generator: one training step."""

    def __init__(self, name, make_model, make_opt, loss_fn, make_batch):
        self.name = name
        self.make_model = make_model
        self.make_opt = make_opt
        self.loss_fn = loss_fn
        self.make_batch = make_batch


def _lm_loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def programs(small: bool = False) -> dict[str, Program]:
    """The three programs (``small`` shrinks them for fast tests)."""
    bs_cnn, bs_mlp, hidden = (8, 16, 128) if small else (64, 128, 1024)
    gpt_kw = dict(vocab=100, d=64, heads=4, layers=2, seq=16) if small else dict()
    gpt_bs = 2 if small else 8
    seq = gpt_kw.get("seq", 128)
    vocab = gpt_kw.get("vocab", 1000)
    return {
        "mnist": Program(
            "mnist", MNISTNet,
            lambda p: optim.SGD(p, lr=0.01, momentum=0.5),
            nn.NLLLoss(),
            lambda g: (torch.randn(bs_cnn, 1, 28, 28, generator=g), torch.randint(0, 10, (bs_cnn,), generator=g)),
        ),
        "mlp": Program(
            "mlp", lambda: MLP(784, hidden, 10),
            lambda p: optim.Adam(p, lr=1e-3),
            nn.CrossEntropyLoss(),
            lambda g: (torch.randn(bs_mlp, 784, generator=g), torch.randint(0, 10, (bs_mlp,), generator=g)),
        ),
        "gpt": Program(
            "gpt", lambda: GPT(**gpt_kw),
            lambda p: optim.AdamW(p, lr=1e-3, weight_decay=0.01),
            _lm_loss,
            lambda g: (torch.randint(0, vocab, (gpt_bs, seq), generator=g),
                       torch.randint(0, vocab, (gpt_bs, seq), generator=g)),
        ),
    }  # fmt: skip
