"""Where the shared segment of medium allreduces pays, over MPI, every rank on one node.

Communicators in one job, each with a 4 KiB inline size (so that calls from 4 KiB up take
the path under test), one per path of ``--paths``: ``segment`` (the native allreduce through
the shared segment, the default where every rank shares a node), ``mpi`` (the segment off:
MPI's own allreduce, as before the segment) and ``ring`` (no native allreduce: ringcomm's
ring), each timed call by call against ``MPI_Allreduce`` in the same iterations, in turn,
each call after a barrier, the slowest rank's time. Prints each size's median ratio to MPI's
time, with quartiles (below 1: faster than MPI). Two paths a run: with the ring's
communicator in the same job every other call measured 5-15% slower here::

    mpiexec -n 2 python bench/shared_sweep.py --paths segment,mpi --sizes 4K,16K,128K,1M
    mpiexec -n 2 python bench/shared_sweep.py --paths segment,ring --sizes 512K,1M,2M,4M,8M
    mpiexec -n 2 python bench/shared_sweep.py --collective reduce_scatter --paths segment,ring
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ringcomm
from ringcomm.backends import mpi as mpi_backend
from ringcomm.perf.options import parse_size

WARMUP = 20
TOTAL_BYTES = 2e8  # per size, each path: fewer iterations for the larger sizes


def timed(world: MPI.Comm, call: Callable[[], object]) -> float:
    """One call of ``call`` after a barrier: the slowest rank's time, in seconds."""
    world.Barrier()
    start = time.perf_counter()
    call()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def _communicator(path: str, limit: int) -> ringcomm.Communicator:
    """A communicator whose calls above 4 KiB take ``path`` (see the module's text)."""
    c = ringcomm.init("mpi", inline_bytes=4096)
    t = c.transport
    t._shared_pending = t._shared_pending and path == "segment"
    t.native_allreduce_bytes = 0 if path == "ring" else limit
    return c


def _sweep(world: MPI.Comm, comms: dict[str, ringcomm.Communicator], nbytes: int,
           iters: int, collective: str) -> tuple[list[float], dict[str, list[float]]]:
    """MPI's times of ``nbytes`` (MPI_Allreduce, or MPI_Reduce_scatter_block) and each
    path's over them, call by call."""
    x = np.random.default_rng(world.rank).random(nbytes // 4, np.float32)
    ref, y = np.empty_like(x), np.empty_like(x)
    if collective == "allreduce":
        def mpi() -> None:
            world.Allreduce(x, ref)

        def ours(c: ringcomm.Communicator) -> None:
            c.allreduce(x, out=y)
    else:
        part = ref[:x.size // world.size]

        def mpi() -> None:
            world.Reduce_scatter_block(x, part)

        def ours(c: ringcomm.Communicator) -> None:
            c.reduce_scatter(x)
    names = list(comms)
    ratios: dict[str, list[float]] = {k: [] for k in names}
    mpi_times = []
    for i in range(iters + WARMUP):
        mpi_time = timed(world, mpi)
        for k in names[i % len(names):] + names[:i % len(names)]:  # each path first in turn
            t = timed(world, lambda c=comms[k]: ours(c))
            if i >= WARMUP:
                ratios[k].append(t / mpi_time)
        if i >= WARMUP:
            mpi_times.append(mpi_time)
    return mpi_times, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,8K,16K,32K,128K,512K,1M,2M,4M,8M",
                        help="comma list of sizes (float32 arrays; K, M suffixes)")
    parser.add_argument("--iters", type=int, default=400, help="at most, per size")
    parser.add_argument("--paths", default="segment,mpi",
                        help="comma list of segment, mpi (MPI's allreduce), ring")
    parser.add_argument("--collective", choices=("allreduce", "reduce_scatter"),
                        default="allreduce", help="against MPI_Allreduce or "
                        "MPI_Reduce_scatter_block (sizes that divide by the ranks)")
    parser.add_argument("--least", default=None,
                        help="the segment's least size for this run (default: the library's)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.least is not None:
        mpi_backend._SHARED_MIN_BYTES = parse_size(args.least)
    comms = {p: _communicator(p, max(sizes)) for p in args.paths.split(",")}
    if world.rank == 0:
        segment = next(iter(comms.values())).transport
        print(f"# {world.size} ranks; one node: {segment.local_size == segment.size}; "
              f"{args.collective}: MPI's time, then each path's over it: median [q1, q3]",
              flush=True)
    for nbytes in sizes:
        iters = max(40, min(args.iters, int(TOTAL_BYTES / nbytes)))
        mpi_times, ratios = _sweep(world, comms, nbytes, iters, args.collective)
        if world.rank == 0:
            cells = " | ".join(
                f"{k} {np.median(v):.2f} [{np.percentile(v, 25):.2f}, {np.percentile(v, 75):.2f}]"
                for k, v in ratios.items())
            print(f"{nbytes:>9d} B  MPI {np.median(mpi_times) * 1e6:8.1f} us | {cells}",
                  flush=True)
    for c in comms.values():
        c.close()


if __name__ == "__main__":
    main()
