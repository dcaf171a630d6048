"""Data and model shared by the PyTorch examples (train_ddp.py, train_hvd.py).

scikit-learn's digits (8x8 images of handwritten digits, 10 classes) ship with the package, so
nothing is downloaded. Each global batch is cut into one shard per rank.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["COMPRESSIONS", "add_arguments", "batches", "load", "mlp", "test_accuracy",
           "train_epoch"]

COMPRESSIONS = ("none", "fp16", "int8", "topk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options both examples take."""
    p.add_argument("--compression", choices=COMPRESSIONS, default="none")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k ratio")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def load(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x_train, y_train, x_test, y_test: standardized, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order]
    cut = int(0.8 * len(y))
    x = (x - x[:cut].mean(axis=0)) / (x[:cut].std(axis=0) + 1e-3)
    parts = (x[:cut], y[:cut], x[cut:], y[cut:])
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in parts)


def mlp(hidden: int, seed: int) -> torch.nn.Module:
    """64 -> hidden -> 10, the same initial weights on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def batches(n: int, batch_size: int, epoch: int, seed: int, rank: int,
            size: int) -> Iterator[torch.Tensor]:
    """This rank's sample indices of each global batch of one epoch (all ranks agree)."""
    order = torch.from_numpy(np.random.default_rng(seed + 1 + epoch).permutation(n))
    per_rank = batch_size // size
    for step in range(n // batch_size):
        batch = order[step * batch_size: (step + 1) * batch_size]
        yield batch[rank * per_rank: (rank + 1) * per_rank]


def test_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of the test set classified right."""
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, args: argparse.Namespace, epoch: int, rank: int,
                size: int) -> tuple[list[float], list[float]]:
    """One epoch of SGD steps on this rank's shards; returns (losses, step times)."""
    losses, times = [], []
    for mine in batches(len(y), args.batch_size, epoch, args.seed, rank, size):
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times
