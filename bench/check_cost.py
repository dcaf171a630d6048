"""What the cross-rank consistency check costs: allreduce with it on and off, in the same run.

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/check_cost.py --sizes 4K,64M

Two communicators over the same ranks, one with ``consistency_check=True`` (the default) and one
with it off; every iteration times one allreduce on each, in alternating order, and the table
holds the median of the slowest rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import ringcomm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ringcomm.perf.options import parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K,64M")
    p.add_argument("-n", "--iters", type=int, default=200)
    args = p.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    on = ringcomm.init("mpi", consistency_check=True)
    off = ringcomm.init("mpi", consistency_check=False)
    if on.rank == 0:
        print(f"# consistency check cost, {on.size} ranks, float32 sum, medians of {args.iters}")
        print("| size | check on | check off | on / off |\n| ---: | ---: | ---: | ---: |")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.random.default_rng(on.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        iters = args.iters if nbytes < (1 << 20) else max(10, args.iters // 20)
        times = np.zeros((2, iters))
        for i in range(-3, iters):
            for k in ((0, 1) if i % 2 else (1, 0)):
                comm = (on, off)[k]
                world.Barrier()
                t0 = time.perf_counter()
                comm.allreduce(x, out=out)
                if i >= 0:
                    times[k, i] = time.perf_counter() - t0
        world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        t_on, t_off = np.median(times, axis=1)
        if on.rank == 0:
            unit, scale = ("us", 1e6) if t_on < 1e-3 else ("ms", 1e3)
            print(f"| {nbytes >> 10} KiB | {t_on * scale:.1f} {unit} | {t_off * scale:.1f} {unit} "
                  f"| {t_on / t_off:.3f} |", flush=True)
    on.close()
    off.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
