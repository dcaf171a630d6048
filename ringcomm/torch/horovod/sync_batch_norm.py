"""Batch normalization whose batch statistics span every rank (horovod.torch.SyncBatchNorm).

In training each rank sends one row per layer (its element count, per-channel mean and sum of
squared deviations); every rank merges the rows into the statistics of the global batch, so
ranks may hold batches of different sizes, an empty one included. The backward pass sums the
two per-channel gradient reductions over the ranks before it forms the input gradient. The
weight and bias gradients stay local, as in Horovod: the distributed optimizer averages them
like any other gradient.

Everything is computed with plain tensor operations, so the layer runs on CPU and CUDA tensors
alike. The collectives are unnamed: every rank must run its SyncBatchNorm layers in the same
order, forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ringcomm.torch.horovod._basics import Sum, size
from ringcomm.torch.horovod.functions import allgather_async, allreduce_async, synchronize

__all__ = ["SyncBatchNorm"]


# ----------------------------------------------------------------------------- helpers
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension of ``x`` except the channel dimension (1)."""
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``v`` (one value per channel) shaped to broadcast against ``x`` (N, C, ...)."""
    return v.reshape(1, -1, *([1] * (x.dim() - 2)))


def _local_moments(x: torch.Tensor) -> torch.Tensor:
    """This rank's statistics as one float64 row: [count, mean (C), sum of squares of the
    deviations from that mean (C)]; zeros for an empty batch."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count == 0:
        moments = torch.zeros(2 * channels, dtype=torch.float64, device=x.device)
    else:
        # var_mean is stable where sum(x**2) - n * mean**2 would cancel.
        var, mean = torch.var_mean(x.to(_acc_dtype(x.dtype)), dim=_reduce_dims(x), correction=0)
        moments = torch.cat([mean, var * count]).to(torch.float64)
    head = torch.tensor([float(count)], dtype=torch.float64, device=x.device)
    return torch.cat([head, moments]).unsqueeze(0)


def _merge_moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Merge per-rank rows of :func:`_local_moments` (Chan et al.'s pairwise formula).

    Returns:
        The global mean and biased variance per channel (float64), and the global count.
    """
    channels = (rows.shape[1] - 1) // 2
    counts = rows[:, :1]
    means, m2s = rows[:, 1:channels + 1], rows[:, channels + 1:]
    total = float(counts.sum())
    if total <= 1:
        raise ValueError(
            f"expected more than 1 value per channel when training, got {total:.0f} "
            "over all ranks")
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


def _global_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The mean, biased variance (float64) and element count per channel of every rank's
    batch together (one allgather)."""
    rows = synchronize(allgather_async(_local_moments(x.detach())))
    return _merge_moments(rows)


# ----------------------------------------------------------------------------- autograd
class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with given global statistics; the backward pass reduces over the ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor,
                total: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        scale = invstd if weight is None else invstd * weight
        out = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(scale, x)
        if bias is not None:
            out = out + _per_channel(bias, x)
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        dims = _reduce_dims(x)
        dy = grad_output.to(mean.dtype)
        xmu = x.to(mean.dtype) - _per_channel(mean, x)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if need_bias else None
        grad_input = None
        if need_input:
            grad_input = _input_grad(dy, xmu, weight, invstd, sum_dy, sum_dy_xmu, ctx.total)
            grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


def _input_grad(dy: torch.Tensor, xmu: torch.Tensor, weight: torch.Tensor | None,
                invstd: torch.Tensor, sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor,
                total: float) -> torch.Tensor:
    """The input gradient of batch normalization, from the sums of every rank (one
    allreduce)."""
    channels = sum_dy.numel()
    sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum))
    mean_dy, mean_dy_xmu = sums[:channels] / total, sums[channels:] / total
    scale = invstd if weight is None else invstd * weight
    return (dy - _per_channel(mean_dy, dy)
            - xmu * _per_channel(invstd * invstd * mean_dy_xmu, dy)) * _per_channel(scale, dy)


# ----------------------------------------------------------------------------- the module
class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the union of every rank's batch (Horovod's SyncBatchNorm).

    For inputs of shape (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W). When the layer uses
    batch statistics (training, or ``track_running_stats=False``) and there is more than one
    rank, the mean and variance are those of every rank's batch together, and the gradients
    flow back through them to every rank; otherwise it is ``torch.nn.BatchNorm*d``. Running
    statistics update as torch's do (unbiased variance, ``momentum=None`` for a cumulative
    average), with the same values on every rank.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; ``None`` for a
            cumulative average.
        affine: whether the layer has a learnable per-channel weight and bias.
        track_running_stats: whether the layer keeps running statistics for evaluation;
            without them it normalizes with the global batch's statistics in evaluation too.
        device: where the parameters and buffers live.
        dtype: dtype of the parameters and buffers.

    Raises:
        ValueError: (on call) an input with fewer than 2 dimensions or the wrong number of
            channels, or a single value per channel over all ranks in training.

    Example::

        import ringcomm.torch as hvd
        hvd.init()
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3),
                                    hvd.SyncBatchNorm(16), torch.nn.ReLU())
        out = model(images)     # normalized with the statistics of every rank's images
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """Refuse inputs without a channel dimension.

        Raises:
            ValueError: ``input`` has fewer than 2 dimensions.
        """
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_channels(self, input: torch.Tensor) -> None:
        """Refuse an input whose channels differ from ``num_features`` before any collective."""
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"expected {self.num_features} channels, got {input.shape[1]}")

    def _uses_batch_stats(self) -> bool:
        """Whether this call normalizes with batch statistics (torch's rule)."""
        return self.training or self.running_mean is None

    def _average_factor(self) -> float:
        """Count this batch and return its weight in the running statistics (as torch does)."""
        if not (self.training and self.track_running_stats):
            return 0.0
        tracked = self.num_batches_tracked
        if tracked is None:
            raise RuntimeError("track_running_stats is set but num_batches_tracked is None")
        tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(tracked)
        return self.momentum

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: float,
                              factor: float) -> None:
        unbiased = var * (total / (total - 1))
        for buf, new in ((self.running_mean, mean), (self.running_var, unbiased)):
            if buf is None:
                raise RuntimeError("no running statistics to update: running_mean or running_var "
                                   "is None")
            buf.copy_(buf.to(torch.float64) * (1 - factor) + new * factor)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` (N, C, ...); see the class for when statistics are global.

        Args:
            input: a tensor of at least 2 dimensions with ``num_features`` channels.

        Returns:
            The normalized tensor, of ``input``'s shape and dtype.

        Raises:
            ValueError: fewer than 2 dimensions, the wrong number of channels, or a single
                value per channel over all ranks in training.
        """
        self._check_input_dim(input)
        self._check_channels(input)
        if not self._uses_batch_stats() or size() == 1:
            return super().forward(input)
        factor = self._average_factor()
        mean, var, total = _global_moments(input)
        if self.training and self.running_mean is not None:
            self._update_running_stats(mean, var, total, factor)
        acc = _acc_dtype(input.dtype)
        invstd = torch.rsqrt(var + self.eps).to(acc)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean.to(acc),
                                            invstd, total)
