"""How the inline size changes dense allreduces of 4 KiB to 128 KiB, over MPI.

Two communicators in one job, one inlining up to 4 KiB (the classic default: larger calls run
the header exchange, then MPI's allreduce) and one up to 64 KiB (the default where every rank
shares a node and at most 4 ranks run), timed call by call against ``MPI_Allreduce`` in the
same iterations, each call after a barrier, the slowest rank's time. Prints each size's median
ratio to MPI's time for both (below 1: faster than MPI)::

    mpiexec -n 2 python bench/inline_sweep.py --sizes 4096,8192,16384,65536 --iters 1500
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ringcomm

WARMUP = 50


def _timed(world: MPI.Comm, call: Callable[[], object]) -> float:
    world.Barrier()
    start = time.perf_counter()
    call()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,8192,16384,32768,65536,131072",
                        help="comma list of sizes in bytes (float32 arrays)")
    parser.add_argument("--iters", type=int, default=1500)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    classic = ringcomm.init("mpi", inline_bytes=4096)
    wide = ringcomm.init("mpi", inline_bytes=65536)
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.ones(nbytes // 4, np.float32)
        buf = np.empty_like(x)
        ratios: tuple[list[float], list[float]] = ([], [])
        for i in range(args.iters + WARMUP):
            mpi = _timed(world, lambda x=x, buf=buf: world.Allreduce(x, buf))
            times = [_timed(world, lambda c=c, x=x: c.allreduce(x)) for c in (classic, wide)]
            if i >= WARMUP:
                for kept, t in zip(ratios, times, strict=True):
                    kept.append(t / mpi)
        if world.rank == 0:
            print(f"{nbytes:7d} B  inline 4 KiB {np.median(ratios[0]):.2f}  "
                  f"inline 64 KiB {np.median(ratios[1]):.2f}  (time over MPI's)", flush=True)
    classic.close()
    wide.close()


if __name__ == "__main__":
    main()
