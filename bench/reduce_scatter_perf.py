"""ringcomm's reduce_scatter against MPI_Reduce_scatter_block, call by call in one job.

One communicator as ``ringcomm.init("mpi")`` makes it (the defaults a user gets); each
iteration times MPI's reduce-scatter and ringcomm's (``comm.reduce_scatter(x)``, or into a
given ``out`` with ``--out``, as FSDP calls it), which first in turn, each call after a
barrier, the slowest rank's time. Prints each size's medians and the median ratio of
ringcomm's time to MPI's, with quartiles (below 1: faster than MPI)::

    mpiexec -n 2 python bench/reduce_scatter_perf.py --sizes 8,512,8K,64K,1M,8M
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI
from shared_sweep import TOTAL_BYTES, WARMUP, timed

import ringcomm
from ringcomm.perf.options import parse_size


def _size(world: MPI.Comm, comm: ringcomm.Communicator, nbytes: int, iters: int,
          into_out: bool) -> tuple[list[float], list[float]]:
    """MPI's and ringcomm's times of a float32 reduce-scatter of ``nbytes`` per rank (a
    multiple of the ranks' count of elements)."""
    n = world.size
    count = max(n, nbytes // 4 // n * n)
    x = np.random.default_rng(world.rank).random(count, np.float32)
    part = np.empty(count // n, np.float32)
    out = np.empty(count // n, np.float32)
    mine = comm.reduce_scatter(x)
    world.Reduce_scatter_block(x, part)
    np.testing.assert_allclose(mine, part, rtol=1e-5)

    def mpi() -> None:
        world.Reduce_scatter_block(x, part)

    def ours() -> None:
        if into_out:
            comm.reduce_scatter(x, out=out)
        else:
            comm.reduce_scatter(x)
    mpi_times, our_times = [], []
    for i in range(iters + WARMUP):
        if i % 2:
            a, b = timed(world, ours), timed(world, mpi)
        else:
            b, a = timed(world, mpi), timed(world, ours)
        if i >= WARMUP:
            our_times.append(a)
            mpi_times.append(b)
    return mpi_times, our_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,128,2K,8K,32K,128K,512K,2M,8M",
                        help="comma list of sizes per rank (float32; K, M suffixes)")
    parser.add_argument("--iters", type=int, default=300, help="at most, per size")
    parser.add_argument("--out", action="store_true", help="reduce into a given out")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = ringcomm.init("mpi")
    for _ in range(500):  # a job's first calls run slower
        comm.allreduce(np.ones(2, np.float32))
        world.Allreduce(MPI.IN_PLACE, np.ones(2, np.float32))
    if world.rank == 0:
        print(f"# {world.size} ranks; reduce_scatter{' into out' if args.out else ''}: "
              "MPI_Reduce_scatter_block's median time, ringcomm's, and ringcomm's over MPI's "
              "call by call: median [q1, q3]", flush=True)
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        iters = max(40, min(args.iters, int(TOTAL_BYTES / max(nbytes, 1))))
        mpi_times, our_times = _size(world, comm, nbytes, iters, args.out)
        if world.rank == 0:
            ratio = np.array(our_times) / np.array(mpi_times)
            print(f"{nbytes:>9d} B  MPI {np.median(mpi_times) * 1e6:8.1f} us  ringcomm "
                  f"{np.median(our_times) * 1e6:8.1f} us  ratio {np.median(ratio):.2f} "
                  f"[{np.percentile(ratio, 25):.2f}, {np.percentile(ratio, 75):.2f}]",
                  flush=True)
    comm.close()


if __name__ == "__main__":
    main()
