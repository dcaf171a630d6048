"""Small allgathers: ringcomm's ``comm.allgather`` against the launcher's own allgather in the
same job (MPI_Allgather under mpiexec, gloo's all_gather_into_tensor under torchrun).

    mpiexec -n 2 python bench/allgather_small.py --json run.json
    torchrun --nproc-per-node 2 bench/allgather_small.py --json run.json

Each sample is ``--calls`` calls back to back after a barrier; the two alternate sample by
sample; a sample's time is the slowest rank's, per call. Medians and quartiles over
``--iters`` samples. To compare two versions of ringcomm, run this alternately with each on
``PYTHONPATH`` and put the JSON files side by side (the baseline's time, measured in the same
runs, tells the machine's drift apart from the versions' difference).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import ringcomm
from ringcomm.core import launch
from ringcomm.perf.options import parse_size


def _baseline(comm: Any) -> tuple[str, Callable[[np.ndarray], Any], Callable[[], Any]]:
    """The launcher's own allgather and barrier, over the same processes."""
    if launch.mpi_launched():
        from mpi4py import MPI

        world = MPI.COMM_WORLD

        def mpi_allgather(x: np.ndarray) -> np.ndarray:
            out = np.empty((world.Get_size() * x.shape[0], *x.shape[1:]), x.dtype)
            world.Allgather(x, out)
            return out
        return "MPI_Allgather", mpi_allgather, world.Barrier
    import torch
    import torch.distributed as dist

    def gloo_allgather(x: np.ndarray) -> Any:
        t = torch.from_numpy(x)
        out = torch.empty(dist.get_world_size() * t.numel(), dtype=t.dtype)
        dist.all_gather_into_tensor(out, t)
        return out
    return "gloo all_gather_into_tensor", gloo_allgather, dist.barrier


def _slowest(comm: Any, seconds: float) -> float:
    return float(comm.allreduce(np.array([seconds]), op="max")[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,256,4K,16K,64K",
                   help="bytes per rank, comma-separated (default: 8,256,4K,16K,64K)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    comm = ringcomm.init(abort_on_exception=False)
    name, theirs, barrier = _baseline(comm)
    rows = []
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.arange(max(1, nbytes // 4), dtype=np.float32) + comm.rank
        expected = np.concatenate([np.arange(x.size, dtype=np.float32) + r
                                   for r in range(comm.size)])
        assert np.array_equal(comm.allgather(x), expected)
        runs: dict[str, list[float]] = {"ringcomm": [], name: []}
        calls = {"ringcomm": comm.allgather, name: theirs}
        for i in range(args.iters + 3):
            for who in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    calls[who](x)
                seconds = _slowest(comm, (time.perf_counter() - t0) / args.calls)
                if i >= 3:
                    runs[who].append(seconds)
        row: dict[str, Any] = {"size": x.nbytes}
        for who, samples in runs.items():
            q = statistics.quantiles(samples, n=4)
            row[who] = {"median_us": statistics.median(samples) * 1e6,
                        "quartiles_us": [q[0] * 1e6, q[2] * 1e6]}
        row["ratio"] = row["ringcomm"]["median_us"] / row[name]["median_us"]
        rows.append(row)
    if comm.rank == 0:
        result = {"ranks": comm.size, "transport": comm.backend, "baseline": name,
                  "inline_bytes": comm.inline_bytes, "calls": args.calls, "iters": args.iters,
                  "machine": f"{platform.processor() or platform.machine()}, "
                             f"{platform.platform()}",
                  "load": os.getloadavg(), "ringcomm": ringcomm.__file__, "rows": rows}
        for row in rows:
            print(f"{row['size']:>7} B  ringcomm {row['ringcomm']['median_us']:8.1f} us  "
                  f"{name} {row[name]['median_us']:8.1f} us  ratio {row['ratio']:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    comm.close()


if __name__ == "__main__":
    main()
