"""DDP training on scikit-learn's digits, gradients averaged by ringcomm's DDP comm hook.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_ddp.py --compression int8
    .venv/bin/torchrun --nproc-per-node 4 examples/train_ddp.py --compression int8

A standard DistributedDataParallel script; one line registers ``ringcomm_hook``, which averages
DDP's gradient buckets with ringcomm's ring (in place, zero-copy), optionally compressed (fp16,
int8, top-k) with error feedback per bucket. Top-k starts after a dense warm-up. Under mpiexec
the process group DDP needs is set up from MPI (``init_process_group``); under torchrun from
torchrun's environment. Per epoch, rank 0 prints the training loss, the test accuracy, the bytes
this rank put on the wire per step and the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
from digits_torch import COMPRESSIONS, add_arguments, load, mlp, test_accuracy, train_epoch

import ringcomm
import ringcomm.torch as hvd
from ringcomm.torch import RingcommState, ringcomm_hook
from ringcomm.torch.process_group import init_process_group


def compressor(name: str, ratio: float) -> ringcomm.Compressor | None:
    return {"none": None, "fp16": ringcomm.FP16(), "int8": ringcomm.Int8(),
            "topk": ringcomm.TopK(ratio)}[name]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--warmup-epochs", type=int, default=2, help="dense epochs before top-k")
    args = p.parse_args(argv)
    assert args.compression in COMPRESSIONS
    torch.set_num_threads(args.threads)
    init_process_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % size:
        print(f"--batch-size {args.batch_size} must divide by the {size} ranks", file=sys.stderr)
        return 2
    x, y, x_test, y_test = load(args.seed)
    model = torch.nn.parallel.DistributedDataParallel(mlp(args.hidden, args.seed))
    steps = len(y) // args.batch_size
    warmup = args.warmup_epochs * steps if args.compression == "topk" else 0
    # The MLP's gradients make one small bucket: compress it however small it is.
    state = RingcommState(compression=compressor(args.compression, args.ratio),
                          start_iter=warmup, min_compress_bytes=0)
    model.register_comm_hook(state, ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    if rank == 0:
        print(f"digits MLP, DDP + ringcomm_hook over {size} ranks ({state.comm.backend}), "
              f"compression {args.compression}, {args.epochs} epochs")
    for epoch in range(args.epochs):
        state.stats.reset()
        losses, times = train_epoch(model, opt, x, y, args, epoch, rank, size)
        mean_loss = hvd.allreduce(torch.tensor(statistics.fmean(losses))).item()
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  "
                  f"test acc {test_accuracy(model, x_test, y_test):.4f}  "
                  f"wire {state.stats.bytes_sent / steps / 1024:8.1f} KiB/step  "
                  f"step {1e3 * statistics.median(times):.2f} ms", flush=True)
    hvd.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
