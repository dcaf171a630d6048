"""The agreement's per-call exchange over MPI: each rank sends its own length.

Every collective starts with an exchange of headers (:mod:`ringcomm.comm.agree`), and small
allreduces ride in it. As an MPI collective (an allgather) every rank would have to send the
same length, known before the exchange that checks it, so every call would move the largest
inline array; a rank whose length differed would join a collective that does not match. Here
the exchange is point-to-point instead: each rank's receive from each peer is posted once,
persistent, for the largest message (``row_bytes``), and MPI lets a message be shorter than
its receive, so a rank sends only its header and its own array: 96 bytes for a barrier or an
8-byte allreduce, a 32 KiB array's bytes for a 32 KiB one. A rank that passed another length
than the others still completes the exchange, and the headers' comparison then raises the
same error on every rank. The cost: one message to each peer (``size - 1`` of them, posted
at once), where an allgather takes ``log2(size)`` rounds; its bytes are what an allgather of
the same rows would move.

Measured with MPICH 5 at 2 ranks on 2 cores, each alone in one run: a 96-byte exchange
2.1 us, the persistent allgather of a 4 KiB slot it replaces 3.0 us, a 4 KiB + 96-byte
exchange 2.3 us; past MPICH's shared-memory eager limit (8100 to 8192 bytes here) a message
costs about twice as much (bench/results/sized_exchange.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.backends.mpi_process import import_mpi

__all__ = ["SizedExchange"]

_TAG = 13
_SIZES_KEPT = 64  # message lengths with persistent sends; more drop the oldest


class SizedExchange:
    """The Exchange (``sized``) of one MPI communicator kept for it alone.

    ``send`` is this rank's row of ``recv``: nothing is received into it and nothing copied
    out of it. Persistent sends are kept for each length used (a training step repeats a
    few), so a repeat starts and completes prepared requests only.

    Args:
        comm: an MPI communicator that carries nothing else (messages match by order).
        row_bytes: the largest message.
        wait_all: completes a list of requests within the timeout
            (``MPITransport.wait_all``), raising or aborting the job when it passes.
        polls: how many times to test the requests before ``wait_all``.
    """

    sized = True

    def __init__(self, comm: Any, row_bytes: int,
                 wait_all: Callable[[list[Any], int | None, str], None], polls: int) -> None:
        MPI = import_mpi()
        rank, size = comm.Get_rank(), comm.Get_size()
        self.recv = np.zeros((size, row_bytes), np.uint8)
        self.send = self.recv[rank]
        self._comm, self._wait_all = comm, wait_all
        self._startall, self._testall = MPI.Prequest.Startall, MPI.Request.Testall
        self._peers = [p for p in range(size) if p != rank]
        self._recvs = [comm.Recv_init(self.recv[p], p, _TAG) for p in self._peers]
        self._requests: dict[int, list[Any]] = {}
        self._volume = size - 1
        self._polls = range(polls)

    def __call__(self, nbytes: int) -> None:
        self.finish(self.start(nbytes))

    def start(self, nbytes: int) -> list[Any]:
        """Start the exchange of ``nbytes``: its persistent requests, which ``finish``
        completes (what the caller does between the two runs while the messages travel)."""
        reqs = self._requests.get(nbytes)
        if reqs is None:
            reqs = self._prepare(nbytes)
        self._startall(reqs)
        return reqs

    def finish(self, reqs: list[Any]) -> None:
        """Complete the requests ``start`` started, within the timeout."""
        testall = self._testall
        if not testall(reqs):
            for _ in self._polls:
                if testall(reqs):
                    return
            self._wait_all(reqs, None, "agreement exchange")

    def moved(self, nbytes: int) -> int:
        """``nbytes`` to each other rank."""
        return nbytes * self._volume

    def _prepare(self, nbytes: int) -> list[Any]:
        if not 0 < nbytes <= self.send.nbytes:
            raise ValueError(f"an exchange sends 1 to {self.send.nbytes} bytes, got {nbytes}")
        if len(self._requests) >= _SIZES_KEPT:
            oldest = next(iter(self._requests))
            for req in self._requests.pop(oldest)[len(self._recvs):]:
                req.Free()
        message = self.send[:nbytes]
        reqs = self._recvs + [self._comm.Send_init(message, p, _TAG) for p in self._peers]
        self._requests[nbytes] = reqs
        return reqs

    def free(self) -> None:
        """Free the persistent requests (inactive ones; one left active by a timeout stays
        allocated with its buffer)."""
        sends = [req for reqs in self._requests.values() for req in reqs[len(self._recvs):]]
        for req in self._recvs + sends:
            if req.Test():
                req.Free()
        self._requests.clear()
        self._recvs = []
