"""A Horovod training script on scikit-learn's digits, run by ringcomm: only the import changed.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_hvd.py --compression int8

``import ringcomm.torch as hvd`` in place of ``import horovod.torch as hvd``: init, rank and
size, DistributedOptimizer (gradients averaged while backward runs, optionally compressed with
error feedback per parameter), broadcast_parameters / broadcast_optimizer_state from rank 0, and
metrics averaged with hvd.allreduce. Per epoch, rank 0 prints the training loss, the test
accuracy, the bytes this rank put on the wire per step and the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from digits_torch import add_arguments, load, mlp, test_accuracy, train_epoch

import ringcomm.torch as hvd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    hvd.init()
    if args.batch_size % hvd.size():
        print(f"--batch-size {args.batch_size} must divide by the {hvd.size()} ranks",
              file=sys.stderr)
        return 2
    x, y, x_test, y_test = load(args.seed)
    model = mlp(args.hidden, args.seed + hvd.rank())  # deliberately different: broadcast below
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                   "int8": hvd.Compression.int8,
                   "topk": hvd.Compression.topk(args.ratio)}[args.compression]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if hvd.rank() == 0:
        print(f"digits MLP, hvd.DistributedOptimizer over {hvd.size()} ranks, "
              f"compression {args.compression}, {args.epochs} epochs")
    stats = hvd.communicator().stats  # ringcomm's wire accounting (not a Horovod call)
    steps = len(y) // args.batch_size
    for epoch in range(args.epochs):
        stats.reset()
        losses, times = train_epoch(model, opt, x, y, args, epoch, hvd.rank(), hvd.size())
        mean_loss = hvd.allreduce(torch.tensor(statistics.fmean(losses)), name="loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  "
                  f"test acc {test_accuracy(model, x_test, y_test):.4f}  "
                  f"wire {stats.bytes_sent / steps / 1024:8.1f} KiB/step  "
                  f"step {1e3 * statistics.median(times):.2f} ms", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
