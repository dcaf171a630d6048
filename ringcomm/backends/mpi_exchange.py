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

A message past that limit (an inlined array of 8 to 48 KiB) goes as chunks of at most
``EAGER_BYTES`` each, which MPI sends at once, where that makes at most ``MAX_CHUNKS``
messages in all (2 ranks: up to 6 chunks; 3 ranks: 3; 4 ranks: 2; 5 and more: none): 2.2 us
at 2 ranks for 8288 bytes as 2 chunks against 4.2 us as one message, 4.4 against 5.8 us
for 32 KiB (bench/results/inline_shared.md); other messages go whole. The first chunk carries the
header and lands in the persistent receive; the others are received only once every rank's
header has been found equal to this rank's (the agreement compares them, then calls
``rest``), so that a rank whose message was shorter (another call) is never waited for. Where
the headers differ, every rank learns every rank's length with the descriptions it exchanges
anyway, and ``drain`` receives the chunks the longer messages still had on the way, so that
none is left to match a later exchange.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.backends.mpi_process import import_mpi

__all__ = ["SizedExchange"]

_TAG = 13  # the first chunk; chunk i has _TAG + i
_SIZES_KEPT = 64  # message lengths with persistent sends; more drop the oldest
#: The largest chunk: MPICH 5's shared-memory eager limit is between 8100 and 8120 bytes here
#: (a message of 8100 bytes took 1.6 us, of 8120 2.5 us, of 8192 4.2 us).
EAGER_BYTES = 8096
#: Chunks one exchange sends in all, at most (to all its peers): a message that would need
#: more goes whole. At 2 ranks 5 chunks of 32 KiB took 4.4 us and 9 chunks of 64 KiB 8.9 us
#: against 5.8 and 7.8 us whole; at 4 ranks on 2 cores, 8-12 KiB allreduces as 2 chunks to
#: each of 3 peers took 1.57x MPI's time against 1.85x whole, 16-24 KiB as 3-4 chunks
#: 1.38-1.73x against 1.25x whole (bench/results/inline_shared.md).
MAX_CHUNKS = 6


def chunks(nbytes: int, peers: int = 1) -> tuple[int, int]:
    """How a message of ``nbytes`` to each of ``peers`` ranks travels: (number of chunks,
    bytes per chunk but the last)."""
    if nbytes <= EAGER_BYTES:
        return 1, nbytes
    count = -(-nbytes // EAGER_BYTES)
    if count * peers > MAX_CHUNKS:
        return 1, nbytes
    return count, -(-nbytes // count)


def _spans(nbytes: int, peers: int) -> list[tuple[int, int]]:
    """The byte ranges of the chunks a message of ``nbytes`` to each of ``peers`` ranks
    travels as (see ``chunks``), in order."""
    count, size = chunks(nbytes, peers)
    return [(i * size, min((i + 1) * size, nbytes)) for i in range(count)]


class _Prepared:
    """The persistent requests of one message length: the first chunk's (the receives of every
    peer's first chunk, shared by every length, then this rank's sends of it), and the other
    chunks' receives and sends (empty for a message of one chunk)."""

    __slots__ = ("first", "fused", "owned", "recvs", "rest", "sends")

    def __init__(self, shared: list[Any], first_sends: list[Any], recvs: list[Any],
                 sends: list[Any]) -> None:
        self.first = shared + first_sends
        self.recvs, self.sends = recvs, sends
        self.rest = recvs + sends
        self.owned = first_sends + self.rest  # what this length alone holds, to free
        # The compiled calls holding these requests' handles; weakly, as a plan dropped (the
        # communicator's settings changed) and compiled again adds another.
        self.fused: weakref.WeakSet[Any] = weakref.WeakSet()

    def free(self) -> None:
        """Free what this length alone holds; its compiled calls refuse to run from now on."""
        for fused in self.fused:
            fused.forget()
        for req in self.owned:
            req.Free()


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
        fused: whether repeated small allreduces may run as one compiled call
            (``fused_allreduce``; ``RINGCOMM_MPI_FUSED_CALLS``).
    """

    sized = True
    whole_bytes = EAGER_BYTES

    def __init__(self, comm: Any, row_bytes: int,
                 wait_all: Callable[[list[Any], int | None, str], None], polls: int,
                 fused: bool = True) -> None:
        MPI = import_mpi()
        rank, size = comm.Get_rank(), comm.Get_size()
        self.recv = np.zeros((size, row_bytes), np.uint8)
        self.send = self.recv[rank]
        self._comm, self._wait_all = comm, wait_all
        self._startall, self._testall = MPI.Prequest.Startall, MPI.Request.Testall
        self._rank = rank
        self._peers = [p for p in range(size) if p != rank]
        self._recvs = [comm.Recv_init(self.recv[p], p, _TAG) for p in self._peers]
        self._requests: dict[int, _Prepared] = {}
        self._volume = size - 1
        self._polls = range(polls)
        self._fused = fused

    def __call__(self, nbytes: int) -> None:
        self.finish(self.start(nbytes))

    def start(self, nbytes: int) -> list[Any]:
        """Start the exchange of ``nbytes``: its persistent requests, which ``finish``
        completes (what the caller does between the two runs while the messages travel)."""
        prepared = self._requests.get(nbytes)
        if prepared is None:
            prepared = self._prepare(nbytes)
        reqs = prepared.first
        self._startall(reqs)
        if prepared.sends:
            self._startall(prepared.sends)  # the other chunks, sent at once
        return reqs

    def finish(self, reqs: list[Any]) -> None:
        """Complete every rank's first chunk (with the header) and this rank's, within the
        timeout; ``rest`` receives the other chunks once the headers are found equal."""
        testall = self._testall
        if not testall(reqs):
            for _ in self._polls:
                if testall(reqs):
                    return
            self._wait_all(reqs, None, "agreement exchange")

    def rest(self, nbytes: int) -> None:
        """Receive the chunks after the first of every rank's message of ``nbytes`` (this
        rank's length, and every rank's, as their headers equal to this rank's say), and
        complete this rank's sends of them; nothing for a message of one chunk."""
        prepared = self._requests[nbytes]
        if prepared.recvs:
            self._startall(prepared.recvs)
            self._wait_all(prepared.rest, None, "agreement exchange")

    def drain(self, lengths: list[int]) -> None:
        """After headers that differ: receive what each rank's message of ``lengths[rank]``
        bytes still had on the way past its first chunk, and complete this rank's sends of
        its own chunks, so that nothing is left to match a later exchange."""
        mine = self._requests.get(lengths[self._rank])
        reqs = [] if mine is None else list(mine.sends)
        for peer in self._peers:
            later = list(enumerate(_spans(lengths[peer], len(self._peers))))[1:]
            reqs += [self._comm.Irecv(self.recv[peer][lo:hi], peer, _TAG + i)
                     for i, (lo, hi) in later]
        if reqs:
            self._wait_all(reqs, None, "agreement exchange")

    def fused_allreduce(self, nbytes: int, header: bytes, dtype: np.dtype,
                        op: str) -> Any:
        """The exchange of ``nbytes`` (the header, then an array of ``dtype``) with the
        reduction of the arrays by ``op``, as one compiled call
        (:class:`~ringcomm.backends.mpi_fused.FusedAllreduce`), or None where that call
        would not give the Python path's bits."""
        if not (self._fused and self._peers):
            return None
        from ringcomm.backends import mpi_fused  # Numba, only for a repeated small call
        if (nbytes <= len(header) or self.recv.shape[1] % 8
                or not mpi_fused.supports(dtype, op)):
            return None
        prepared = self._requests.get(nbytes) or self._prepare(nbytes)
        fused = mpi_fused.FusedAllreduce(
            prepared.first, prepared.recvs, prepared.sends, functools.partial(self.rest, nbytes),
            self.recv, self._rank, header, dtype, op, len(self._polls), self._wait_all)
        prepared.fused.add(fused)
        return fused

    def moved(self, nbytes: int) -> int:
        """``nbytes`` to each other rank."""
        return nbytes * self._volume

    def _prepare(self, nbytes: int) -> _Prepared:
        if not 0 < nbytes <= self.send.nbytes:
            raise ValueError(f"an exchange sends 1 to {self.send.nbytes} bytes, got {nbytes}")
        if len(self._requests) >= _SIZES_KEPT:
            self._requests.pop(next(iter(self._requests))).free()
        parts = _spans(nbytes, len(self._peers))
        comm, peers = self._comm, self._peers
        first_sends = [comm.Send_init(self.send[:parts[0][1]], p, _TAG) for p in peers]
        later = list(enumerate(parts))[1:]
        recvs = [comm.Recv_init(self.recv[p][lo:hi], p, _TAG + i)
                 for i, (lo, hi) in later for p in peers]
        sends = [comm.Send_init(self.send[lo:hi], p, _TAG + i)
                 for i, (lo, hi) in later for p in peers]
        prepared = self._requests[nbytes] = _Prepared(self._recvs, first_sends, recvs, sends)
        return prepared

    def free(self) -> None:
        """Free the persistent requests (inactive ones; one left active by a timeout stays
        allocated with its buffer)."""
        owned = [req for prepared in self._requests.values() for req in prepared.owned]
        for fused in (f for prepared in self._requests.values() for f in prepared.fused):
            fused.forget()
        for req in self._recvs + owned:
            if req.Test():
                req.Free()
        self._requests.clear()
        self._recvs = []
