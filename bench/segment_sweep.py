"""Measure the ring's segment size: time the dense allreduce at each segment size, interleaved.

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/segment_sweep.py --sizes 1M,16M,64M,256M

For every message size, each iteration times one allreduce per candidate segment size in turn
(so that machine noise hits all alike); the table holds the median time of the slowest rank,
and each candidate's time relative to the best one of that row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import ringcomm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ringcomm.perf.options import parse_size
from ringcomm.perf.report import machine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="message sizes per rank")
    p.add_argument("--segments", default="64K,256K,512K,1M,2M,4M,8M")
    p.add_argument("-n", "--iters", type=int, default=15)
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from mpi4py import MPI

    comm = ringcomm.init("mpi")
    world = MPI.COMM_WORLD
    segments = [parse_size(s) for s in args.segments.split(",")]
    rows = []
    if comm.rank == 0:
        print(f"# segment sweep, {comm.size} ranks, float32 sum; median time (ms), ratio to best")
        print("#" + f"{'size':>11} " + " ".join(f"{s >> 10:>9}K" for s in segments))
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        times = np.zeros((len(segments), args.iters))
        for it in range(-args.warmup, args.iters):
            for k, seg in enumerate(segments):
                comm.segment_bytes = seg
                world.Barrier()
                t0 = time.perf_counter()
                comm.allreduce(x, out=out)
                if it >= 0:
                    times[k, it] = time.perf_counter() - t0
        world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        med = np.median(times, axis=1)
        best = med.min()
        rows.append({"size": nbytes, "segments": segments, "median_s": med.tolist()})
        if comm.rank == 0:
            cells = " ".join(f"{m * 1e3:6.2f}/{m / best:4.2f}" for m in med)
            print(f"{nbytes:12d} {cells}", flush=True)
    if comm.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(
            {"meta": {"nranks": comm.size, "machine": machine()}, "rows": rows}, indent=1))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
