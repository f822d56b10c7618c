"""A model with three things a lazy device does not like, for ``python -m xlatorch.check``:
a host read, an op with no lowering, and a Python number that changes every step."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        logits = self.body(x)
        if logits.abs().max().item() > 1e4:  # guard against blow-ups
            logits = logits.clamp(-1e4, 1e4)
        classes = torch.unique(y)  # which classes this batch has
        keep = logits[:, classes]
        warm = min(self.calls, 8)  # a warm-up over the first steps
        return F.cross_entropy(keep[: 4 * warm], torch.searchsorted(classes, y)[: 4 * warm])


def make():
    torch.manual_seed(0)
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    return Classifier(), (x, y), lambda loss: loss
