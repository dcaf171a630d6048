"""What name-matched negotiation costs ringcomm.torch, against the communicator it runs on.

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/negotiation_cost.py

Three measurements, each against a baseline in the same run, medians over iterations (the
slowest rank's time per iteration):

1. one synchronous ``hvd.allreduce`` of a tensor against ``comm.allreduce`` of the same array
   (the negotiation's fixed cost: one cycle, a fixed-size control allgather that carries the
   operation as a response-cache slot, run by the calling thread);
2. ``count`` small named ``hvd.allreduce_async`` calls then ``synchronize`` (fused by the
   coordinator) against ``count`` ``comm.allreduce`` calls one after another;
3. the same ``count`` operations submitted in a different order on every rank.

Other jobs on the machine change these figures: the table ends with the 1-minute load
average when the run started (as ``uptime`` shows it; a quiet 2-core machine that just ran
this benchmark shows about 1).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import ringcomm.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ringcomm.perf.options import parse_size
from ringcomm.perf.report import machine


def timed(fn: Callable[[], object], iters: int, world) -> float:
    """Median over ``iters`` of the slowest rank's seconds for ``fn()``."""
    times = []
    for _ in range(iters):
        world.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    slowest = np.max(np.array(world.allgather(times)), axis=0)
    return float(statistics.median(slowest))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K,1M")
    p.add_argument("--count", type=int, default=64, help="operations in the batched rows")
    p.add_argument("--small", default="4K", help="size of each batched operation")
    p.add_argument("-n", "--iters", type=int, default=100)
    p.add_argument("--out", help="also write the table here (rank 0)")
    args = p.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    load_at_start = os.getloadavg()[0]
    hvd.init()
    comm = hvd.communicator()
    rows = []
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        t = torch.ones(nbytes // 4)
        a = t.numpy()
        raw = timed(lambda a=a: comm.allreduce(a), args.iters, world)
        neg = timed(lambda t=t: hvd.allreduce(t, name="one", op=hvd.Sum), args.iters, world)
        rows.append((f"1 x {nbytes} B, synchronous", neg, raw))
    small = [torch.ones(parse_size(args.small) // 4) for _ in range(args.count)]
    names = [f"t{i}" for i in range(args.count)]

    def batch(order: list[int]) -> None:
        handles = [hvd.allreduce_async(small[i], name=names[i], op=hvd.Sum) for i in order]
        for h in handles:
            hvd.synchronize(h)

    def one_by_one() -> None:
        for x in small:
            comm.allreduce(x.numpy())

    raw = timed(one_by_one, args.iters, world)
    same = list(range(args.count))
    shuffled = same[:]
    random.Random(comm.rank).shuffle(shuffled)
    label = f"{args.count} x {parse_size(args.small)} B"
    rows.append((f"{label}, async, same order", timed(lambda: batch(same), args.iters, world),
                 raw))
    rows.append((f"{label}, async, order differs per rank",
                 timed(lambda: batch(shuffled), args.iters, world), raw))
    if comm.rank == 0:
        lines = [f"# negotiation cost, {comm.size} ranks, float32 sum, medians of {args.iters}",
                 "", "| what | ringcomm.torch | comm.allreduce | ratio |",
                 "| --- | ---: | ---: | ---: |"]
        lines += [f"| {w} | {a * 1e6:.0f} us | {b * 1e6:.0f} us | {a / b:.2f} |"
                  for w, a, b in rows]
        info = machine()
        lines += ["", f"Machine: {info['cpu']}; {info.get('mpi', 'no MPI')}; Python "
                      f"{info['python']}, torch {torch.__version__}; load average "
                      f"{load_at_start:.2f} at the start. Command: "
                      f"`mpiexec -n {comm.size} python bench/negotiation_cost.py "
                      f"{' '.join(argv if argv is not None else sys.argv[1:])}`"]
        text = "\n".join(lines)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
