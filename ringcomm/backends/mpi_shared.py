"""Medium dense allreduces (and reduce-scatters) through memory every rank of one node maps.

MPI's allreduce of a few hundred KiB between processes of one node moves each array through
MPI's shared-memory cells (a copy in and a copy out per hop) and reduces what arrives; here
each rank copies its array once into its own slot of a segment that every rank maps, and after
a barrier reduces its chunk of every slot, in rank order, into the segment's result area; after
a second barrier every rank copies the whole result out. Each element of the result is computed
once, by one rank, so every rank gets the same bits (at 2 ranks, those of MPI's own ``a + b``).
Measured with MPICH 5 on 2 cores, each call after a barrier, against MPI_Allreduce in the
same iterations: 128 KiB to 1 MiB at 2 ranks in 0.87-0.92x its time, where the header
exchange then MPI's own allreduce took 1.03-1.27x (bench/results/shared_allreduce.md).

The segment is a file in ``/dev/shm`` (POSIX shared memory, Linux), made by rank 0 with its
blocks reserved (``posix_fallocate``: a full ``/dev/shm`` refuses it instead of ending the
process with SIGBUS at the first write), mapped by every rank and unlinked once every rank
has answered, so that nothing of it outlives the job's processes. Every rank checks that it
maps rank 0's segment (a token rank 0 wrote), and every rank learns every rank's answer: where
one rank cannot map it (another machine's ``/dev/shm``, a container of its own), no rank uses
it. Freeing it is each process's own (unmapping), never a collective that a rank which left
early would hang. It takes at most a quarter of what ``/dev/shm`` has free when it is made
(rank 0's slot size, which every rank takes): others need that memory too (a container's
``/dev/shm`` is 64 MiB by default, and PyTorch's DataLoader workers hand their batches through
it), and a segment that leaves too little makes them fail, not this.

Why the barriers keep the data apart: a rank writes its slot only after the second barrier of
the previous call, which every rank enters only after reading the slots, and writes the
result area only after the first barrier of its call, which every rank enters only after
copying the previous result out. The barriers are MPI's (``MPI_Barrier_init``, persistent,
on a communicator of their own), polled within the transport's timeout like every wait here;
MPICH's shared-memory barrier orders the memory before it for the ranks after it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.algorithms.ring import chunk_bounds
from ringcomm.backends.mpi_process import removed_at_abort
from ringcomm.core import trace
from ringcomm.core.log import get_logger
from ringcomm.core.types import ReduceOp

__all__ = ["SharedAllreduce", "slot_bytes"]

_LOG = get_logger("mpi")

# A segment holds size + 1 slots (one per rank, and the result); they are at most the MPI
# allreduce's limit and together at most _BUDGET_BYTES of the node's memory.
_BUDGET_BYTES = 32 << 20
# ... and at most this share of what /dev/shm has free; no segment where its slots would be
# smaller than _LEAST_SLOT (calls that small gain little from it).
_FREE_SHARE = 4
_LEAST_SLOT = 64 << 10
_ALIGN = 4096
_DIR = "/dev/shm"
_TOKEN_BYTES = 16
# Result chunks start on cache lines of their own: the ranks write them at once.
_LINE = 64


def slot_bytes(size: int, limit: int) -> int:
    """The largest array a segment of ``size`` ranks takes: ``limit`` (MPI's allreduce's),
    within _BUDGET_BYTES for all its slots, in whole pages."""
    return min(limit, _BUDGET_BYTES // (size + 1)) // _ALIGN * _ALIGN


class SharedAllreduce:
    """The segment of one MPI communicator whose ranks share a node, and its barrier.

    Made by :meth:`create` (collective). ``prepare(dtype, nbytes, op)`` gives the allreduce of
    one kind of call, ``allreduce(x, out)`` with ``x`` and ``out`` C-contiguous (``out`` may be
    ``x``).
    """

    def __init__(self, comm: Any, memory: mmap.mmap, slot: int,
                 wait: Callable[[Callable[[], bool], list[Any], int | None, str], None],
                 polls: int) -> None:
        self._comm = comm
        self.slot = slot
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        whole = np.frombuffer(memory, np.uint8, (self.size + 1) * slot)
        self._slots = [whole[q * slot:(q + 1) * slot] for q in range(self.size)]
        self._result = whole[self.size * slot:]
        try:
            self._barrier = comm.Barrier_init()
            self._persistent = True
        except NotImplementedError:  # MPI older than 4.0
            self._barrier, self._persistent = None, False
        self._wait, self._polls = wait, range(polls)

    @classmethod
    def create(cls, transport: Any, comm: Any, limit: int,
               wait: Callable[[Callable[[], bool], list[Any], int | None, str], None],
               polls: int) -> SharedAllreduce | None:
        """Make the segment of ``comm`` (a communicator of its own, every rank on one node;
        collective: every rank at the same call), or None on every rank where some rank
        cannot map it. ``transport`` asks the questions (its polled ``allgather_object``)."""
        size = comm.Get_size()
        slot, path, token, memory, why = 0, None, None, None, ""
        if transport.rank == 0:
            slot, why = _fitting_slot(size, limit)
            if slot:
                path, token, memory, why = _make((size + 1) * slot)
        # A timeout in the exchanges below ends the job (MPI_Abort) inside the wait: the
        # name goes then too.
        with removed_at_abort(path):
            try:
                slot, path, token = transport.allgather_object((slot, path, token))[0]
                if memory is None and path is not None:
                    memory, why = _attach(path, (size + 1) * slot, token)
                answers = transport.allgather_object(why)
            finally:  # every rank has answered (or the job is failing): the name goes
                if transport.rank == 0 and path is not None:
                    _unlink(path)
        refused = [f"rank {r}: {w}" for r, w in enumerate(answers) if w]
        if refused or memory is None:
            if memory is not None:
                memory.close()
            _LOG.info("medium allreduces take MPI's own allreduce: no shared segment (%s)",
                      "; ".join(refused) or "rank 0 made none")
            return None
        return cls(comm, memory, slot, wait, polls)

    def prepare(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                ) -> Callable[[np.ndarray, np.ndarray], None]:
        """The allreduce of C-contiguous arrays of ``dtype`` and ``nbytes`` (at most
        ``slot``) by ``op``: this rank's chunk reduced in rank order (divided by the size for
        AVG), every chunk copied out."""
        count = nbytes // dtype.itemsize
        lo, hi = chunk_bounds(count, self.size, max(1, _LINE // dtype.itemsize))[
            self.rank:self.rank + 2]
        mine, parts = self._views(dtype, nbytes, lo, hi)
        result = self._result[:nbytes].view(dtype)
        chunk = result[lo:hi]
        reduce = self._reduction(op)
        barrier = self._barrier_call("allreduce")

        def allreduce(x: np.ndarray, out: np.ndarray) -> None:
            with trace.span("SHM_ALLREDUCE"):
                mine[...] = x.reshape(-1)
                barrier()
                reduce(parts, chunk)
                barrier()
                out[...] = result.reshape(out.shape)  # any layout of out: written through
        return allreduce

    def prepare_reduce_scatter(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                               ) -> Callable[[np.ndarray], np.ndarray]:
        """The reduce-scatter of flat C-contiguous arrays of ``dtype`` and ``nbytes`` (at
        most ``slot``) by ``op``: this rank's chunk, ``[r * L // n, (r + 1) * L // n)``,
        reduced in rank order from every rank's slot into a new array (divided by the size
        for AVG)."""
        lo, hi = chunk_bounds(nbytes // dtype.itemsize, self.size)[self.rank:self.rank + 2]
        mine, parts = self._views(dtype, nbytes, lo, hi)
        reduce = self._reduction(op)
        barrier = self._barrier_call("reduce_scatter")

        def reduce_scatter(x: np.ndarray) -> np.ndarray:
            with trace.span("SHM_REDUCE_SCATTER"):
                mine[...] = x
                barrier()
                chunk = np.empty(hi - lo, dtype)
                reduce(parts, chunk)
                barrier()  # every rank has read every slot: the next call may write
                return chunk
        return reduce_scatter

    def _views(self, dtype: np.dtype, nbytes: int, lo: int, hi: int
               ) -> tuple[np.ndarray, list[np.ndarray]]:
        """This rank's slot as ``nbytes`` of ``dtype``, and elements ``[lo, hi)`` of every
        rank's, in rank order."""
        mine = self._slots[self.rank][:nbytes].view(dtype)
        return mine, [s[:nbytes].view(dtype)[lo:hi] for s in self._slots]

    def _reduction(self, op: ReduceOp) -> Callable[[list[np.ndarray], np.ndarray], None]:
        """``reduce(parts, out)``: ``parts`` combined by ``op`` in rank order into ``out``
        (then divided by the size for AVG)."""
        ufunc, size = getattr(np, op.spec.ufunc), self.size
        average = op is ReduceOp.AVG

        def reduce(parts: list[np.ndarray], out: np.ndarray) -> None:
            ufunc(parts[0], parts[1], out=out)
            for part in parts[2:]:
                ufunc(out, part, out=out)
            if average:
                np.divide(out, size, out=out)
        return reduce

    def _barrier_call(self, what: str) -> Callable[[], None]:
        """A barrier of the segment's ranks in a call of ``what``, polled within the
        timeout."""
        wait, polls = self._wait, self._polls
        if self._persistent:
            req = self._barrier
            start, test = req.Start, req.Test

            def barrier() -> None:
                start()
                if not test():
                    for _ in polls:
                        if test():
                            return
                    wait(test, [req], None, what)
            return barrier
        ibarrier = self._comm.Ibarrier

        def barrier_nonpersistent() -> None:
            req = ibarrier()
            if not req.Test():
                wait(req.Test, [req], None, what)
        return barrier_nonpersistent

    def close(self) -> None:
        """Free the barrier (where no wait left it active); the mapping goes with the last
        array made from it."""
        if self._persistent and self._barrier.Test():
            self._barrier.Free()


def _free_bytes() -> int:
    """What /dev/shm has free for this process, in bytes (0 where there is none)."""
    try:
        vfs = os.statvfs(_DIR)
    except OSError:
        return 0
    return vfs.f_bavail * vfs.f_frsize


def _fitting_slot(size: int, limit: int) -> tuple[int, str]:
    """Rank 0's slot for ``size`` ranks: :func:`slot_bytes`, or less where the segment
    would take more than 1/_FREE_SHARE of /dev/shm's free space; (0, why) where that leaves
    less than _LEAST_SLOT."""
    slot = slot_bytes(size, limit)
    free = _free_bytes()
    fitting = free // _FREE_SHARE // (size + 1) // _ALIGN * _ALIGN
    if fitting < slot:
        if fitting < _LEAST_SLOT:
            return 0, f"{_DIR} has {free} bytes free, too few for {size + 1} slots"
        _LOG.info("shared segment: slots of %d bytes, not %d, as %s has %d bytes free",
                  fitting, slot, _DIR, free)
        slot = fitting
    return slot, ""


def _make(nbytes: int) -> tuple[str | None, bytes | None, mmap.mmap | None, str]:
    """Rank 0's segment: (its path, its token, its mapping, ""), or Nones and why not."""
    if not sys.platform.startswith("linux") or not os.path.isdir(_DIR):
        return None, None, None, f"no {_DIR}"
    path = os.path.join(_DIR, f"ringcomm-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return None, None, None, f"{path}: {err}"
    try:
        os.posix_fallocate(fd, 0, nbytes)
        memory = mmap.mmap(fd, nbytes)
    except OSError as err:
        _unlink(path)
        return None, None, None, f"{nbytes} bytes in {_DIR}: {err}"
    finally:
        os.close(fd)
    token = secrets.token_bytes(_TOKEN_BYTES)
    memory[nbytes - _TOKEN_BYTES:] = token  # in the result area, overwritten by any call
    return path, token, memory, ""


def _attach(path: str, nbytes: int, token: bytes | None) -> tuple[mmap.mmap | None, str]:
    """Another rank's mapping of rank 0's segment, or None and why not."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as err:
        return None, f"{path}: {err}"
    try:
        memory = mmap.mmap(fd, nbytes)
    except (OSError, ValueError) as err:
        return None, f"{path}: {err}"
    finally:
        os.close(fd)
    if memory[nbytes - _TOKEN_BYTES:] != token:
        memory.close()
        return None, f"{path} is another file than rank 0's"
    return memory, ""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
