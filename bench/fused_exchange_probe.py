"""What a medium dense allreduce could gain from carrying its agreement in its data: plain
MPI, one run, the three ways timed side by side (each call after a barrier, the slowest
rank's time, medians).

    .venv/bin/mpiexec -n 4 .venv/bin/python bench/fused_exchange_probe.py

- ``mpi``: ``MPI_Allreduce`` alone (the baseline of bench/results/small_medium.md);
- ``header+mpi``: what ringcomm does from its inline limit to 512 KiB x (n - 1): a 96-byte
  header to every other rank (persistent point-to-point), then ``MPI_Iallreduce``;
- ``fused``: the agreement riding in the data: each rank sends every other rank the header
  and that rank's shard of its array in one message, compares the headers, adds the shards
  it received in rank order, then sends its reduced shard to every other rank (a direct
  reduce-scatter and allgather: two rounds, the bytes of a ring).

Waits are MPI's blocking ``Waitall`` or, with ``--yield``, a ``Testall`` loop that yields the
core each round (ringcomm's wait with more ranks than cores). No ringcomm code runs here.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

HEADER = 96


def _waiter(yielding: bool) -> Callable[[list[Any]], None]:
    if not yielding:
        return MPI.Request.Waitall

    def wait(reqs: list[Any]) -> None:
        while not MPI.Request.Testall(reqs):
            os.sched_yield()
    return wait


def _calls(world: Any, nbytes: int, wait: Callable[[list[Any]], None]
           ) -> dict[str, Callable[[], None]]:
    rank, n = world.Get_rank(), world.Get_size()
    peers = [p for p in range(n) if p != rank]
    heads, data, spread = world.Dup(), world.Dup(), world.Dup()
    x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
    out, out2 = np.empty_like(x), np.empty_like(x)
    own = np.zeros(HEADER, np.uint8)
    got = np.zeros((n, HEADER), np.uint8)
    header_reqs = ([heads.Send_init(own, p, 1) for p in peers]
                   + [heads.Recv_init(got[p], p, 1) for p in peers])

    def header_then_mpi() -> None:
        MPI.Prequest.Startall(header_reqs)
        wait(header_reqs)
        wait([world.Iallreduce(x, out2)])

    bounds = [x.size * i // n for i in range(n + 1)]
    widest = max(bounds[i + 1] - bounds[i] for i in range(n)) * 4
    send = np.zeros((n, HEADER + widest), np.uint8)
    recv = np.zeros((n, HEADER + widest), np.uint8)
    mine = slice(bounds[rank], bounds[rank + 1])
    first: list[Any] = []
    for p in peers:
        first.append(data.Send_init(send[p][:HEADER + (bounds[p + 1] - bounds[p]) * 4], p, 2))
        first.append(data.Recv_init(recv[p], p, 2))
    second: list[Any] = []
    for p in peers:
        second.append(spread.Send_init(out[mine], p, 3))
        second.append(spread.Recv_init(out[bounds[p]:bounds[p + 1]], p, 3))
    count = bounds[rank + 1] - bounds[rank]

    def fused() -> None:
        for p in peers:
            send[p][HEADER:HEADER + (bounds[p + 1] - bounds[p]) * 4] = (
                x[bounds[p]:bounds[p + 1]].view(np.uint8))
        MPI.Prequest.Startall(first)
        wait(first)
        for p in peers:
            if recv[p][:HEADER].tobytes() != send[p][:HEADER].tobytes():
                raise RuntimeError("headers differ")
        acc = out[mine]
        for q in range(n):
            part = x[mine] if q == rank else recv[q][HEADER:HEADER + count * 4].view(np.float32)
            if q == 0:
                acc[...] = part
            else:
                np.add(acc, part, out=acc)
        MPI.Prequest.Startall(second)
        wait(second)

    return {"mpi": lambda: world.Allreduce(x, out2), "header+mpi": header_then_mpi,
            "fused": fused}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="32768,131072,524288,1048576")
    p.add_argument("-n", "--iters", type=int, default=200)
    p.add_argument("--yield", dest="yielding", action="store_true")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    wait = _waiter(args.yielding)
    if world.Get_rank() == 0:
        print(f"# {world.Get_size()} ranks, {os.cpu_count()} cores, waits: "
              f"{'Testall + sched_yield' if args.yielding else 'MPI_Waitall'}\n")
        print("| size | MPI_Allreduce | header + MPI_Iallreduce | fused | header+mpi / mpi | "
              "fused / mpi |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        calls = _calls(world, nbytes, wait)
        for fn in calls.values():
            for _ in range(20):
                fn()
        times = np.zeros((len(calls), args.iters))
        for i in range(args.iters):
            for k, fn in enumerate(calls.values()):
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                times[k, i] = time.perf_counter() - t0
        world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        med = dict(zip(calls, np.median(times, axis=1) * 1e6, strict=True))
        if world.Get_rank() == 0:
            print(f"| {nbytes} B | {med['mpi']:.0f} us | {med['header+mpi']:.0f} us | "
                  f"{med['fused']:.0f} us | {med['header+mpi'] / med['mpi']:.2f} | "
                  f"{med['fused'] / med['mpi']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
