"""Dense allreduce over the gloo transport (torchrun jobs): ringcomm's ring, gloo's own allreduce
as the transport now runs it (``native_allreduce``), and torch.distributed's all_reduce alone.

    torchrun --nproc-per-node 2 bench/gloo_transport_perf.py [--sizes 16K,1M,64M] [--iters 20]
        [--markdown F]

Each size runs the three in turn, call after call (a barrier before each), so that the machine's
load falls on all of them alike; the time of a call is the slowest rank's. Medians with
quartiles. The ring is a communicator made with RINGCOMM_GLOO_ALLREDUCE_BYTES=0 (every rank
alike), the native one with the default (no limit); both sum in place, as the DDP hook does.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.distributed as dist

from ringcomm.backends import gloo
from ringcomm.core.env import env_bytes

VARIANTS = ("ring", "native", "torch all_reduce")


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        os.environ["_SIZE"] = part
        out.append(int(env_bytes("_SIZE") or 0))
    return out


def _timed(group: object, fn: object) -> float:
    dist.barrier(group)
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16K,256K,1M,4M,16M,64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    os.environ[gloo.NATIVE_BYTES_ENV] = "0"
    ring = gloo.TorchDistCommunicator()
    del os.environ[gloo.NATIVE_BYTES_ENV]
    native = gloo.TorchDistCommunicator()
    group = dist.new_group(backend="gloo")
    rows = []
    for nbytes in _sizes(args.sizes):
        x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        t = torch.from_numpy(x)
        calls = {"ring": functools.partial(ring.allreduce, x, out=x),
                 "native": functools.partial(native.allreduce, x, out=x),
                 "torch all_reduce": functools.partial(dist.all_reduce, t, group=group)}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for i in range(args.iters + 2):
            for v in VARIANTS:
                x[:] = 1.0  # the same finite values every call
                took = _timed(group, calls[v])
                if i >= 2:
                    times[v].append(took)
        rows.append((nbytes, {v: (statistics.median(ts), *statistics.quantiles(ts, n=4)[::2])
                              for v, ts in times.items()}))
        if rank == 0:
            print(nbytes, {v: round(m[0] * 1e3, 3) for v, m in rows[-1][1].items()}, flush=True)
    if rank == 0:
        text = _table(rows, size, args.iters)
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
    ring.close()
    native.close()
    dist.destroy_process_group()
    return 0


def _table(rows: list[tuple[int, dict[str, tuple[float, float, float]]]], size: int,
           iters: int) -> str:
    load = os.getloadavg()
    lines = [f"# Dense allreduce over the gloo transport, {size} ranks", "",
             f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
             f"torch {torch.__version__}; load average before the table "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
             f"- float32 sum in place, median of {iters} calls (slowest rank), the three "
             "variants in turn; quartiles in brackets", "",
             "| size | ring | native (gloo's allreduce) | torch all_reduce | ring / native |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for nbytes, m in rows:
        cells = [f"{m[v][0] * 1e3:.2f} ms [{m[v][1] * 1e3:.2f}-{m[v][2] * 1e3:.2f}]"
                 for v in VARIANTS]
        lines.append(f"| {_human(nbytes)} | {' | '.join(cells)} | "
                     f"{m['ring'][0] / m['native'][0]:.2f}x |")
    return "\n".join(lines) + "\n"


def _human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
