"""Collectives with autograd, and ``SyncBatchNorm`` (``torch_xla.core.functions``).

The ``xm`` collectives are not differentiable; these are. Their backward passes are the
collectives torch_xla uses: ``all_reduce`` -> ``all_reduce`` of the gradient (scaled),
``all_gather`` -> this replica's slice of the gradient, ``reduce_scatter`` -> ``all_gather``
of the gradient (scaled). Each is an IR node in the step's one program, like ``xm``'s.
"""

from __future__ import annotations

import torch

from xlatorch.runtime.base.topology import global_ordinal, world_size
from xlatorch.runtime.trace import collectives as cc

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "SyncBatchNorm"]


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, reduce_type, scale, groups):
        ctx.scale, ctx.groups = scale, groups
        return cc.all_reduce(reduce_type, x, scale=scale, groups=groups)

    @staticmethod
    def backward(ctx, g):
        return cc.all_reduce("sum", g.contiguous(), scale=ctx.scale, groups=ctx.groups), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, groups):
        ctx.dim, ctx.size = dim, x.shape[dim]
        gs, r = cc._groups(groups), global_ordinal()
        ctx.index = r if gs is None else next(g.index(r) for g in gs if r in g)
        return cc.all_gather(x, dim=dim, groups=groups)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(ctx.dim, ctx.index * ctx.size, ctx.size).clone(), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, reduce_type, scale, scatter_dim, shard_count, groups):
        ctx.scale, ctx.dim, ctx.groups = scale, scatter_dim, groups
        return cc.reduce_scatter(reduce_type, x, scale, scatter_dim, shard_count, groups=groups)

    @staticmethod
    def backward(ctx, g):
        grad = cc.all_gather(g.contiguous(), dim=ctx.dim, groups=ctx.groups)
        return (grad * ctx.scale if ctx.scale != 1.0 else grad), None, None, None, None, None


def all_reduce(reduce_type: str, value: torch.Tensor, scale: float = 1.0, groups=None) -> torch.Tensor:
    """``xm.all_reduce`` of one tensor, differentiable (sum reductions are what gradients need)."""
    return _AllReduce.apply(value, reduce_type, scale, groups)


def all_gather(value: torch.Tensor, dim: int = 0, groups=None) -> torch.Tensor:
    """``xm.all_gather``, differentiable: the gradient is this replica's slice of the output's."""
    return _AllGather.apply(value, dim, groups)


def reduce_scatter(reduce_type: str, input: torch.Tensor, scale: float, scatter_dim: int, shard_count: int,
                   groups=None) -> torch.Tensor:  # fmt: skip
    """``xm.reduce_scatter`` of one tensor, differentiable: the gradient is the ``all_gather``
    of the output's, scaled."""
    return _ReduceScatter.apply(input, reduce_type, scale, scatter_dim, shard_count, groups)


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation whose batch statistics span every replica's batch.

    In training, each replica's per-channel sum and sum of squares are all-reduced (one
    collective in the step's program), so with equal batches on every replica the result,
    the gradients and the running statistics equal ``BatchNorm`` on the whole batch in one
    process. In evaluation (or without batch statistics) it is ``BatchNorm``. Inputs are
    ``(N, C, ...)``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not (self.training or not self.track_running_stats) or world_size() == 1:
            return super().forward(x)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        dims = [0] + list(range(2, x.dim()))
        count = x.numel() // x.shape[1]
        n = world_size()
        stats = torch.cat([x.sum(dims), (x * x).sum(dims)])
        stats = all_reduce("sum", stats)
        total = count * n
        mean, sq = stats[: x.shape[1]] / total, stats[x.shape[1] :] / total
        var = sq - mean * mean
        if self.training and self.track_running_stats:
            momentum = self.momentum
            if momentum is None:  # a cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                unbiased = var.detach() * (total / max(total - 1, 1))
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y
