"""The GPT-style model the bench's programming-model comparisons train (hand-written: no
dependency): token and position embeddings, ``depth`` pre-norm blocks (causal attention,
GELU MLP), a head. ``blocks(x)`` is how the blocks are run: a Python loop by default."""

from __future__ import annotations

import torch
import torch.nn.functional as F

N_EMBD, N_HEAD, SEQ, BATCH, VOCAB = 256, 4, 128, 4, 512


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(N_EMBD), torch.nn.LayerNorm(N_EMBD)
        self.qkv, self.proj = torch.nn.Linear(N_EMBD, 3 * N_EMBD), torch.nn.Linear(N_EMBD, N_EMBD)
        self.fc, self.out = torch.nn.Linear(N_EMBD, 4 * N_EMBD), torch.nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, N_HEAD, c // N_HEAD).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, N_EMBD), torch.nn.Embedding(SEQ, N_EMBD)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
        self.ln, self.head = torch.nn.LayerNorm(N_EMBD), torch.nn.Linear(N_EMBD, VOCAB)
        self.run_blocks = None  # (blocks, x) -> x; None: a Python loop

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        if self.run_blocks is not None:
            x = self.run_blocks(list(self.blocks), x)
        else:
            for blk in self.blocks:
                x = blk(x)
        return self.head(self.ln(x))


def batch(device):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx.to(device), tgt.to(device)


def loss_of(model, idx, tgt):
    return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
