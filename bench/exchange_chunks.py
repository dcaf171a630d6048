"""What one point-to-point exchange of a message costs whole and in chunks, under MPI alone.

Each rank sends one message (or the same bytes as several, each its own tag) to the other of
2 ranks and receives the other's, with persistent requests, after a barrier; prints the
median time per exchange. Shows where the shared-memory eager limit lies (a message past it
waits for the receiver) and what splitting past it costs::

    mpiexec -n 2 python bench/exchange_chunks.py
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

ITERS, WARMUP = 20000, 500


def exchange_time(world: MPI.Comm, sizes: list[int]) -> float:
    """Median seconds of one exchange of messages of ``sizes`` bytes each way."""
    peer = 1 - world.rank
    reqs = []
    for i, size in enumerate(sizes):
        reqs.append(world.Recv_init(np.zeros(size, np.uint8), peer, 20 + i))
        reqs.append(world.Send_init(np.zeros(size, np.uint8), peer, 20 + i))
    for _ in range(WARMUP):
        MPI.Prequest.Startall(reqs)
        MPI.Request.Waitall(reqs)
    times = []
    for _ in range(ITERS):
        world.Barrier()
        start = time.perf_counter()
        MPI.Prequest.Startall(reqs)
        while not MPI.Request.Testall(reqs):
            pass
        times.append(time.perf_counter() - start)
    for req in reqs:
        req.Free()
    return float(np.median(times))


def split(total: int, cap: int) -> list[int]:
    """``total`` bytes as the fewest even chunks of at most ``cap``."""
    count = -(-total // cap)
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


def main() -> None:
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit("run with 2 ranks")
    cases = [[s] for s in (104, 4192, 8100, 8120, 8192)]
    for total in (8288, 12384, 16480, 32864, 65632):
        cases += [[total], split(total, 8096)]
    for sizes in cases:
        t = exchange_time(world, sizes)
        if world.rank == 0:
            print(f"{sum(sizes):6d} B as {len(sizes)} message(s): {t * 1e6:.2f} us", flush=True)


if __name__ == "__main__":
    main()
