"""MPI backend (mpi4py): NumPy arrays, and CuPy arrays through CUDA-aware MPI or host staging.

Device: when first given CuPy arrays, the transport selects CUDA device ``local_rank %
device_count`` (the rank's position on its host among the job's ranks; ``device=`` picks
another) and runs all of its device work with that device current, whichever thread calls.
Device arrays on another device are refused, with the same error on every rank.

:class:`MPITransport` implements the Transport over four duplicates of an MPI communicator
(the ring's messages, users' point-to-point messages, the host collectives, and the
agreement's exchange of :mod:`ringcomm.backends.mpi_exchange`), and a fifth for the barriers of
the shared segment of medium allreduces (:mod:`ringcomm.backends.mpi_shared`) where every rank
shares a node, so that none of ringcomm's messages can match another's or the application's.
:class:`MPICommunicator` is the Communicator over it.

Bounded time: every wait of the transport is a nonblocking MPI call polled with ``Testall``
until a deadline (MPI's blocking calls cannot be interrupted). A rank that died, stopped or
never joined thus turns into a :class:`~ringcomm.core.types.CollectiveTimeoutError` naming the
collective and the peer, and by default into ``MPI_Abort`` of the whole job.

Why one module past 400 lines: every method of MPITransport works on the same three duplicated
communicators and goes through the same polled waits; MPI's set-up in the process is in
:mod:`ringcomm.backends.mpi_process`, device staging in :mod:`ringcomm.backends.staging`.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections.abc import Callable
from typing import Any, NoReturn, cast

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms.ring import chunk_bounds
from ringcomm.backends import cuda_device, staging
from ringcomm.backends.mpi_exchange import SizedExchange
from ringcomm.backends.mpi_process import FORWARD_S, abort, cores, import_mpi, machine_id
from ringcomm.backends.mpi_shared import SharedAllreduce
from ringcomm.comm.base import Communicator
from ringcomm.comm.settings import agree_env
from ringcomm.comm.transport import (
    TransportBase,
    adopt_ranks,
    agree_split,
    check_timeout,
    split_members,
    timeout_error,
    write_fatal,
)
from ringcomm.core import trace
from ringcomm.core.log import get_logger
from ringcomm.core.types import (
    DEFAULT_INLINE_BYTES,
    RING,
    USER,
    Array,
    InvalidArgumentError,
    ReduceOp,
    drops_nan_natively,
)

__all__ = ["MPICommunicator", "MPITransport"]

_RING_TAG = 7
_P2P_TAG = 11
_WHAT = {RING: "ring exchange", USER: "sendrecv"}  # what a point-to-point wait is, by channel

# Waiting: poll MPI_Testall until the deadline. The first _SPIN_S of a wait spin, as MPI's own
# blocking waits do: a rank that sleeps makes no MPI progress, so its peers' rendezvous
# transfers and the steps of nonblocking collectives wait for it to wake. Past that, each pause
# is _PAUSE_FRACTION of the time waited so far (10 us to 1 ms), which adds at most ~3% to a
# long wait while a straggler no longer costs a core, and a timeout is seen within 1 ms. With
# more ranks than cores here, the first _SHARED_SPIN_S spin yielding the core each round (a
# rank that sleeps at once would stall everyone's collective; MPICH's heavy yield does the
# same), then the pauses start: a rank still waiting by then waits for another's compute,
# which its spinning would slow (its own, where a collective runs on a thread of its own
# beside the caller's work, as the torch.distributed backend's large ones do).
# Measured at 2 ranks on 2 cores against MPI's blocking calls: 4 KiB and 1 MiB allreduces as
# fast in step and with ranks arriving up to 5 ms apart, 2-3% slower at 20 ms apart (doubling
# pauses from 10 us after a 200 us spin cost 15-65% with ranks 2-5 ms apart). At 4 ranks on 2
# cores, 3-8x faster than MPI's blocking calls under MPICH's heavy yield; there, on the
# torch.distributed backend against gloo, a DDP step ran at 0.70-0.80x gloo's rate when the whole
# wait spun and 0.97-1.03x with 1 ms of spin, FSDP2 0.74-0.84x and 1.12-1.17x, all_reduce
# 0.49-3.28x and 1.12-3.06x from 16 B to 32 MiB (5 ms: DDP 0.89-0.99x; 0.2 ms: a 512 KiB
# allreduce 2.5x as long as with 1 ms; bench/results/shared_spin/).
_SPIN_S = 5e-3
_SHARED_SPIN_S = 1e-3
# The agreement's exchange and the persistent allreduces first poll _TIGHT_POLLS times (10-20
# us) without reading the clock: a small collective completes within them, and each round of
# the timed loop below adds to when its completion is seen (measured at 2 ranks: an 8-byte
# allreduce 4.5 us instead of 5.0; the same polls at the start of that loop, reached through
# more calls, gained nothing). None with more ranks than cores, where every poll yields.
_TIGHT_POLLS = 64
_PAUSE_FRACTION = 1 / 32
_FIRST_PAUSE_S = 10e-6
_MAX_PAUSE_S = 1e-3
_now = time.perf_counter

_LOG = get_logger("mpi")

# Dense host allreduces up to (size - 1) * _NATIVE_BYTES_PER_PEER bytes run as MPI's own
# allreduce (MPI_Iallreduce, polled like every wait here); larger ones run ringcomm's ring,
# which moves 2 (n - 1) / n of the array and wins from there. Measured with MPICH 5.0 at 2 and
# 4 ranks on 2 cores (bench/results/allreduce_n*.md): MPI's allreduce 2-8x faster up to 32 KiB,
# even at 512 KiB x (n - 1), the ring 1.2-3.5x faster from 2 MiB x (n - 1) up.
# RINGCOMM_MPI_ALLREDUCE_BYTES sets the limit (0: always the ring); every rank must pass the same.
_NATIVE_BYTES_PER_PEER = 512 << 10
NATIVE_BYTES_ENV = "RINGCOMM_MPI_ALLREDUCE_BYTES"
# A small allreduce repeated past _inline.FUSE_AFTER runs its exchange and reduction as one
# compiled call (ringcomm/backends/mpi_fused.py); RINGCOMM_MPI_FUSED_CALLS=0 keeps the Python
# path (the same messages and bits either way; agreed at start like the limit above).
FUSED_ENV = "RINGCOMM_MPI_FUSED_CALLS"
# Where every rank shares one node, dense allreduces up to (_SHARED_INLINE_BUDGET / (n - 1))
# bytes, at most _SHARED_INLINE_MAX, ride in the agreement's exchange (each rank sends its
# array to each other rank through shared memory and reduces every rank's in rank order), where
# elsewhere they ride up to DEFAULT_INLINE_BYTES: one exchange instead of the header's then
# MPI's allreduce. The budget bounds what one such call sends (and every rank keeps room for
# each other rank's message); across nodes the n - 1 copies would load the NICs, so the
# default stays there. Measured with MPICH 5 on 2 cores (bench/results/inline_shared.md), time
# over MPI_Allreduce's after a barrier: at 2 ranks 6-8000 B 0.87-0.88 inlined against 1.42
# after the header exchange, 8-12 KiB 1.01-1.06 against 1.37-1.44 (past the eager limit, in
# chunks: see mpi_exchange), 16-32 KiB 0.58-0.67 against 1.16-1.18, 40-64 KiB 0.94-1.21
# against 1.05-1.15; at 4 ranks 6-64 KiB 1.01-1.41 against 1.32-1.85, and calls below 4 KiB
# no slower (bench/results/small_medium.md).
_SHARED_INLINE_BUDGET = 192 << 10
_SHARED_INLINE_MAX = 64 << 10
# MPI's allreduce takes these as they are; 16-bit floats (MPI has no half sum; the ring sums
# them in float32) and foreign byte orders take the ring.
_NATIVE_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
# Repeated dense allreduces up to _PERSISTENT_BYTES run a persistent allreduce of their own
# (MPI-4 MPI_Allreduce_init, on a buffer the array is copied into and the result out of: the
# request is bound to its buffers). Measured with MPICH 5 at 2 ranks on 2 cores: 8 KiB in
# 4.6 us with both copies against 5.3 us for MPI_Iallreduce, 32 KiB 16.2 against 16.3,
# 128 KiB 43.8 against 40.5 (the copies then cost more than the set-up saved). The same
# algorithm as MPI_Iallreduce's: bit-identical results (tests/mpi/test_allreduce_native.py).
# At most _PERSISTENT_KEPT of them per transport, each holding its buffer until close; other
# sizes take MPI_Iallreduce.
_PERSISTENT_BYTES = 32 << 10
_PERSISTENT_KEPT = 64
# Where every rank shares one node, the dense allreduces that MPI's would run from
# _SHARED_MIN_BYTES up run through a shared segment instead (ringcomm/backends/mpi_shared.py):
# each rank copies its array in once, reduces its chunk of every rank's in rank order, and
# copies the result out, between two barriers; and the native limit's default is then
# _SHARED_BYTES_PER_PEER x (n - 1). Measured with MPICH 5 on 2 cores, time over
# MPI_Allreduce's after a barrier (bench/results/shared_allreduce.md): at 2 ranks 128 KiB-1 MiB
# 0.87-0.92 against 1.03-1.27 before; with a 4 KiB inline size, against MPI's allreduce,
# 16-32 KiB 1.37 and 1.21 against 1.58 and 1.47 at 2 ranks, 1.95 and 1.42 against 2.11 and
# 1.86 at 4, but 8 KiB 2.11 against MPI's persistent allreduce's 1.83 (4 ranks: 2.55 against
# 2.28), hence _SHARED_MIN_BYTES; against the ring, at 2 ranks
# 1 MiB 0.90 against 1.11, 2 MiB 0.93 against 0.97, 4-8 MiB 1.02-1.03 against 0.82-0.93; at 4
# ranks (two a core) 1-6 MiB 0.75-0.82 against 0.94-1.45.
# Reduce-scatters of the same sizes, which took the ring, take the segment too (each rank
# reduces its own chunk): 1.3-1.9x faster than the ring at 2 and 4 ranks from 16 KiB to 3 MiB;
# the others up to the native limit run MPI_Ireduce_scatter (bench/results/reduce_scatter.md).
# RINGCOMM_MPI_SHARED_ALLREDUCE=0 keeps MPI's (agreed at start like the limit above).
SHARED_ENV = "RINGCOMM_MPI_SHARED_ALLREDUCE"
_SHARED_MIN_BYTES = 16 << 10
_SHARED_BYTES_PER_PEER = 1 << 20
_SHARED_KEPT = 256
_MPI_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "SUM", ReduceOp.MIN: "MIN",
            ReduceOp.MAX: "MAX", ReduceOp.PROD: "PROD"}


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """``a`` itself, or its bytes where MPI has no type for it (bfloat16 from ml_dtypes)."""
    return a.view(np.uint8) if a.dtype.kind == "V" else a


class _Pair:
    """A send and a receive posted together; ``wait()`` completes both within the timeout.

    ``room``: the receive buffer's size in bytes, named when a longer message arrives.
    """

    __slots__ = ("_peer", "_reqs", "_room", "_t", "_what")

    def __init__(self, t: MPITransport, reqs: list[Any], peer: int, what: str,
                 room: int = 0) -> None:
        self._t, self._reqs, self._peer, self._what, self._room = t, reqs, peer, what, room

    def wait(self) -> None:
        statuses = [self._t._MPI.Status() for _ in self._reqs] if self._room else None
        try:
            self._t.wait_all(self._reqs, self._peer, self._what, statuses)
        except self._t._MPI.Exception as err:
            self._failed(err, statuses)

    def _failed(self, err: Exception, statuses: list[Any] | None) -> NoReturn:
        """A receive into a user's buffer too small raises InvalidArgumentError (this rank
        only; the transport stays usable); any other MPI error fails the transport."""
        MPI = self._t._MPI
        if MPI.ERR_TRUNCATE in [MPI.Get_error_class(st.Get_error()) for st in statuses or ()]:
            raise InvalidArgumentError(
                f"{self._what} on rank {self._t.rank}: the message from rank {self._peer} is "
                f"longer than the receive buffer ({self._room} bytes); the receive buffer must "
                f"be at least as large as what rank {self._peer} sends",
                kind=self._what, ranks=(self._t.rank,), reason="message truncated") from None
        failure = RuntimeError(_mpi_failure(self._t, self._what, self._peer, err))
        self._t.strand(self._reqs, failure)
        raise failure from err


def _mpi_failure(t: MPITransport, what: str, peer: int, err: Exception) -> str:
    """The message of an MPI error in a point-to-point exchange: which step, which peer, MPI's
    own words, and the likely cause (calls the consistency check, when off, did not compare)."""
    return (f"{t.operation or what} failed on rank {t.rank} of {t.size} in the {what} with "
            f"rank {peer}: MPI reports an error in the send or the receive ({err!s}). With "
            "the consistency check off, ranks calling with another size, dtype, segment_bytes "
            "or algorithm fail this way: turn it on "
            "(consistency_check=True, RINGCOMM_CONSISTENCY_CHECK=1) to find which argument "
            "differs. The communicator cannot be used after this: close it and end the job")


class MPITransport(TransportBase):
    """The Transport over an mpi4py intracommunicator.

    Every wait is bounded by ``timeout``; on expiry the transport logs a
    :class:`~ringcomm.core.types.CollectiveTimeoutError` and ends the job with ``MPI_Abort``
    (every process exits, non-zero), or raises it with ``abort_on_timeout=False``. After a
    timeout the transport is unusable: the interrupted operation's requests stay posted (they
    keep their buffers alive) and would match a later call's messages.

    Args:
        mpi_comm: the MPI communicator to run on (``MPI.COMM_WORLD`` by default); it is
            duplicated, so ringcomm's messages never match the application's.
        timeout: seconds any wait for the other ranks may last (``DEFAULT_TIMEOUT_S``, 30
            minutes, when None; ``math.inf`` waits forever).
        abort_on_timeout: end the job with ``MPI_Abort`` when a wait times out (True), or
            raise CollectiveTimeoutError on this rank only (False, for tests and for
            applications that end the job themselves).
        device: the CUDA device for device arrays; ``local_rank % device_count`` when None
            (selected when the first device array comes).

    Raises:
        RuntimeError: mpi4py is missing (saying what to install).
        TypeError: ``mpi_comm`` is not an mpi4py intracommunicator.
        ValueError: ``timeout`` is not a positive number, or ``device`` is negative.
        CollectiveTimeoutError: with ``abort_on_timeout=False``, some rank did not join the
            construction (collective) in time.
    """

    backend = "mpi"

    def __init__(self, mpi_comm: Any = None, *, timeout: float | None = None,
                 abort_on_timeout: bool = True, device: int | None = None) -> None:
        MPI = import_mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(base, MPI.Comm) or base == MPI.COMM_NULL:
            raise TypeError(f"mpi_comm must be an mpi4py intracommunicator, got {base!r}")
        super().__init__(base.Get_rank(), base.Get_size())
        self._MPI, self._testall = MPI, MPI.Request.Testall
        self.timeout = check_timeout(timeout)
        self.abort_on_timeout = bool(abort_on_timeout)
        # More ranks than cores: a shorter spin, yielding the core (see _SPIN_S).
        self._yield = False
        self._polls = 0
        self._stranded: list[Any] = []  # requests of timed-out waits, kept with their buffers
        self._persistent: list[Any] = []  # persistent allreduces, freed at close
        self._exchanges: list[SizedExchange] = []  # the agreement's, freed at close
        #: Persistent allreduces by (dtype, nbytes, op) (see _allreduce_of).
        self._allreduces: dict[tuple[Any, ...], Callable[[np.ndarray, np.ndarray], None]] = {}
        #: Reduce-scatters through the shared segment, by (dtype, nbytes, op).
        self._reduce_scatters: dict[tuple[Any, ...], Callable[[np.ndarray], np.ndarray]] = {}
        #: The shared segment of medium allreduces (see SHARED_ENV), made at the first call
        #: that would take it where ``_shared_pending``; None before and where none is made.
        self._shared: SharedAllreduce | None = None
        self._shared_pending = False
        self._shared_comm: Any = None
        self._ctl = base  # until the duplicates exist, a timeout aborts through base
        self.operation = "init"
        dups = [base.Idup() for _ in range(4)]
        self.wait_all([req for _, req in dups], None, "communicator duplication")
        self._ring, self._p2p, self._ctl, self._agree = (comm for comm, _ in dups)
        # Blocking, but every rank has arrived: the duplication above completed.
        local = self._ctl.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        # The ranks sharing this machine's cores: MPI's shared-memory node, or more where
        # containers or network namespaces of one host count as nodes apart.
        here = machine_id()
        self._yield = self._ctl.allgather(here).count(here) > cores()
        self._polls = 0 if self._yield else _TIGHT_POLLS
        self.operation = ""
        self.cuda_aware = staging.cuda_aware(MPI)
        self.moves_device_arrays = self.cuda_aware
        self._device_stage: staging.DeviceStaging | None = None
        #: Which CUDA device this rank's device arrays use (selected with the first one).
        self.device_choice = cuda_device.DeviceChoice(self.local_rank, device)
        self._scratch_order = cuda_device.ScratchOrder()
        #: Dense host allreduces up to this many bytes run as MPI's own (see
        #: _NATIVE_BYTES_PER_PEER); the same on every rank.
        try:
            agreed = agree_env(self, {NATIVE_BYTES_ENV: None},
                               {FUSED_ENV: True, SHARED_ENV: True})
        except ValueError:  # refused on every rank: nothing of this transport stays behind
            self.close()
            raise
        limit = agreed[NATIVE_BYTES_ENV]
        self.native_allreduce_bytes = ((self.size - 1) * self._per_peer(agreed[SHARED_ENV])
                                       if limit is None else limit)
        #: Whether repeated small allreduces may run as one compiled call (see FUSED_ENV).
        self.fused_calls = agreed[FUSED_ENV]
        # (A limit below the segment's least size, 0 for always the ring, makes none.)
        self._shared_pending = (agreed[SHARED_ENV] and self.local_size == self.size > 1
                                and self.native_allreduce_bytes >= _SHARED_MIN_BYTES)
        self._mpi_ops = {op: getattr(MPI, name) for op, name in _MPI_OPS.items()}

    def _per_peer(self, shared: bool) -> int:
        """The default limit of the native allreduce per other rank: _SHARED_BYTES_PER_PEER
        where a shared segment would run it (every rank on one node, ``shared``: SHARED_ENV
        as agreed), else _NATIVE_BYTES_PER_PEER."""
        one_node = self.local_size == self.size > 1
        return _SHARED_BYTES_PER_PEER if shared and one_node else _NATIVE_BYTES_PER_PEER

    def native_allreduce(self, x: Array, out: Array, op: ReduceOp) -> bool:
        """MPI's own allreduce of flat host ``x`` into ``out`` (which may be ``x``) when it
        is small enough and MPI reduces its dtype; False otherwise (the ring runs).

        Every rank decides alike: the size, dtype and op were agreed, and the limit is the
        same everywhere. MPI's algorithms for commutative ops give every rank the same bits
        (each partial sum is formed once, or by both partners as a + b = b + a);
        ``tests/mpi/test_allreduce_native.py`` holds the MPI here to that.
        """
        if type(x) is not np.ndarray or not self._reduces_natively(x.dtype, x.nbytes, op):
            return False
        if x is not out and np.may_share_memory(x, out):
            x = out  # out=x reaches here as another view (partial overlaps are refused)
        self._allreduce_of(x.dtype, x.nbytes, op)(x, out)
        return True

    def _reduces_natively(self, dtype: np.dtype, nbytes: int, op: ReduceOp) -> bool:
        """Whether MPI's own allreduce takes a host array of ``dtype`` and ``nbytes`` for
        ``op`` (not the min or max of floats: MPI's may drop a NaN)."""
        return (nbytes <= self.native_allreduce_bytes and dtype in _NATIVE_DTYPES
                and dtype.isnative and not drops_nan_natively(op, dtype))

    def prepare_native_allreduce(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                                 ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """``native_allreduce`` for repeats of one call (dtype, size, op): the lookups and
        checks made once, so a repeat costs the MPI call and its wait.

        Plans are prepared before their call is agreed, and on the ranks whose arguments
        allow it only, so this sets up nothing collective: the MPI allreduce is chosen (and
        a persistent one made) at the first call of the result, after the agreement, where
        ``native_allreduce`` would make it."""
        if not self._reduces_natively(dtype, nbytes, op):
            return None
        ready = self._allreduces.get((dtype, nbytes, op))
        if ready is not None:
            return ready
        chosen: list[Callable[[np.ndarray, np.ndarray], None]] = []

        def allreduce(x: np.ndarray, out: np.ndarray) -> None:
            if not chosen:
                chosen.append(self._allreduce_of(dtype, nbytes, op))
            chosen[0](x, out)
        return allreduce

    def _allreduce_of(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                      ) -> Callable[[np.ndarray, np.ndarray], None]:
        """MPI's allreduce of flat ``x`` into ``out`` (``out`` may be ``x``) for calls of
        ``dtype``, ``nbytes`` and ``op``, counted in the stats: a persistent one where
        _PERSISTENT_BYTES allows, else ``MPI_Iallreduce``.

        The first call of a (dtype, size, op) that may be persistent makes its request, on
        every rank at the same call (setting one up is collective, and MPI matches a
        persistent allreduce only with persistent ones): every native allreduce of that
        kind then runs it, whether from a prepared plan or from the general path, which
        ranks may take differently for the same call (a rank's arrays strided, another's
        not)."""
        key = (dtype, nbytes, op)
        allreduce = self._allreduces.get(key)
        if allreduce is None:
            shared = self._shared_allreduce(dtype, nbytes, op)
            if shared is not None:  # kept for the sizes seen first (made again: views only)
                if len(self._allreduces) < _SHARED_KEPT:
                    self._allreduces[key] = shared
                return shared
            allreduce = self._persistent_allreduce(dtype, nbytes, op)
            if allreduce is None:
                return self._iallreduce(nbytes, op)
            self._allreduces[key] = allreduce
        return allreduce

    def native_reduce_scatter(self, x: Array, op: ReduceOp) -> Array | None:
        """This rank's chunk of a reduce-scatter of flat host ``x``, ``[r * L // n,
        (r + 1) * L // n)``, as a new array: through the shared segment (from
        _SHARED_MIN_BYTES to its slot), else MPI's own reduce-scatter (up to the native
        allreduce's limit, for what MPI's allreduce takes), or None (the ring runs). Every
        rank decides alike: the call was agreed."""
        if type(x) is not np.ndarray or not x.flags.c_contiguous:
            return None
        key = (x.dtype, x.nbytes, op)
        run = self._reduce_scatters.get(key)
        if run is None:
            run = self._reduce_scatter_of(x.dtype, x.nbytes, op)
            if run is None:
                return None
            if len(self._reduce_scatters) < _SHARED_KEPT:
                self._reduce_scatters[key] = run
        return run(x)

    def _reduce_scatter_of(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                           ) -> Callable[[np.ndarray], np.ndarray] | None:
        """The native reduce-scatter of calls of ``dtype``, ``nbytes`` and ``op``, counted
        in the stats as the ring's would be, or None (see ``native_reduce_scatter``)."""
        if dtype not in _NATIVE_DTYPES or not dtype.isnative:
            return None
        run = None
        if nbytes >= _SHARED_MIN_BYTES and (self._shared_pending or self._shared is not None):
            shared = self._segment()  # every rank at the same call: the sizes were agreed
            if shared is not None and nbytes <= shared.slot:
                run = shared.prepare_reduce_scatter(dtype, nbytes, op)
        if run is None and self._reduces_natively(dtype, nbytes, op):
            run = self._ireduce_scatter(dtype, nbytes, op)
        if run is None:
            return None
        stats, moved = self.stats, (self.size - 1) * nbytes // self.size

        def reduce_scatter(x: np.ndarray) -> np.ndarray:
            chunk = run(x)
            stats.add(moved, moved)
            return chunk
        return reduce_scatter

    def _ireduce_scatter(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                         ) -> Callable[[np.ndarray], np.ndarray]:
        """``MPI_Ireduce_scatter`` of flat arrays of ``dtype`` and ``nbytes``: this rank's
        chunk of the ring's bounds (divided by the size for AVG)."""
        bounds = chunk_bounds(nbytes // dtype.itemsize, self.size)
        counts = np.diff(bounds).tolist()
        length = counts[self.rank]
        ireduce_scatter, mpi_op = self._ctl.Ireduce_scatter, self._mpi_ops[op]
        wait_one = self._wait_one
        divide = _ops.get(np.empty(0)).divide if op is ReduceOp.AVG else None
        size = self.size

        def reduce_scatter(x: np.ndarray) -> np.ndarray:
            chunk = np.empty(length, dtype)
            with trace.span("MPI_REDUCE_SCATTER"):
                wait_one(ireduce_scatter(x, chunk, counts, op=mpi_op), "reduce_scatter")
            if divide is not None:
                divide(chunk, size, chunk)
            return chunk
        return reduce_scatter

    def _segment(self) -> SharedAllreduce | None:
        """The shared segment, made at the first call that asks (every rank at the same
        call), or None where there is none."""
        if self._shared_pending:
            self._shared_pending = False
            self._shared = self._make_shared()
        return self._shared

    def _shared_allreduce(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                          ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """The allreduce of ``dtype``, ``nbytes`` and ``op`` through the shared segment
        (made at the first call that takes it: every rank at the same call), counted in the
        stats; None where the segment does not take it (see SHARED_ENV)."""
        if nbytes < _SHARED_MIN_BYTES:
            return None
        shared = self._segment()
        if shared is None or nbytes > shared.slot:
            return None
        run = shared.prepare(dtype, nbytes, op)
        stats, moved = self.stats, self.native_volume(nbytes)

        def allreduce(x: np.ndarray, out: np.ndarray) -> None:
            run(x, out)
            stats.bytes_sent += moved
            stats.bytes_received += moved
        return allreduce

    def _make_shared(self) -> SharedAllreduce | None:
        """This transport's shared segment, on a duplicate of its own (collective)."""
        comm, req = self._ctl.Idup()
        self._wait_one(req, "shared segment")
        shared = SharedAllreduce.create(self, comm, self.native_allreduce_bytes, self._wait,
                                        self._polls)
        if shared is None:
            comm.Free()
        else:
            self._shared_comm = comm
        return shared

    def _iallreduce(self, nbytes: int, op: ReduceOp) -> Callable[[np.ndarray, np.ndarray], None]:
        iallreduce, mpi_op, in_place = self._ctl.Iallreduce, self._mpi_ops[op], self._MPI.IN_PLACE
        wait_one, stats, size = self._wait_one, self.stats, self.size
        divide = _ops.get(np.empty(0)).divide if op is ReduceOp.AVG else None
        moved = self.native_volume(nbytes)

        def allreduce(x: np.ndarray, out: np.ndarray) -> None:
            with trace.span("MPI_ALLREDUCE"):  # the timeline's row, as Horovod names it
                wait_one(iallreduce(in_place if x is out else x, out, op=mpi_op), "allreduce")
            if divide is not None:
                divide(out, size, out)
            stats.bytes_sent += moved
            stats.bytes_received += moved
        return allreduce

    def _persistent_allreduce(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                              ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """A persistent in-place allreduce of a buffer of its own, the array copied in and
        the result out; None where the size is past _PERSISTENT_BYTES, _PERSISTENT_KEPT are
        held already (the same on every rank: they are made at the same calls), or MPI is
        older than 4.0."""
        if nbytes > _PERSISTENT_BYTES or len(self._persistent) >= _PERSISTENT_KEPT:
            return None
        buf = np.empty(nbytes // dtype.itemsize, dtype)
        try:
            req = self._ctl.Allreduce_init(self._MPI.IN_PLACE, buf, op=self._mpi_ops[op])
        except NotImplementedError:
            return None
        self._persistent.append(req)
        start, test, wait, polls = req.Start, req.Test, self._wait, range(self._polls)
        stats, size, moved = self.stats, self.size, self.native_volume(nbytes)
        divide = _ops.get(buf).divide if op is ReduceOp.AVG else None

        def allreduce(x: np.ndarray, out: np.ndarray) -> None:
            buf[...] = x if x.ndim == 1 else x.reshape(-1)
            with trace.span("MPI_ALLREDUCE"):
                start()
                if not test():
                    for _ in polls:
                        if test():
                            break
                    else:
                        wait(test, [req], None, "allreduce")
            if divide is not None:
                divide(buf, size, buf)
            out[...] = buf if out.ndim == 1 else buf.reshape(out.shape)
            stats.bytes_sent += moved
            stats.bytes_received += moved
        return allreduce

    # ------------------------------------------------------------------------ primitives
    def isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int, *,
                  channel: int = RING) -> Any:
        comm, tag = (self._ring, _RING_TAG) if channel == RING else (self._p2p, _P2P_TAG)
        what = _WHAT.get(channel, "sendrecv")
        if (type(send) is np.ndarray and type(recv) is np.ndarray
                and "V" not in (send.dtype.kind, recv.dtype.kind)):  # the common, host case
            return _Pair(self, [comm.Irecv(recv, source, tag), comm.Isend(send, dest, tag)],
                         source, what, recv.nbytes if channel == USER else 0)
        if _ops.is_device_array(send) or _ops.is_device_array(recv):
            return self._device_staging().isendrecv(comm, tag, send, dest, recv, source)
        reqs = []
        if recv is not None:
            reqs.append(comm.Irecv(_as_bytes(recv), source, tag))
        if send is not None:
            reqs.append(comm.Isend(_as_bytes(send), dest, tag))
        return _Pair(self, reqs, source if recv is not None else dest, what,
                     recv.nbytes if channel == USER and recv is not None else 0)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._wait_one(self._ctl.Iallgather(send, recv), "allgather")

    @property
    def default_inline_bytes(self) -> int:
        """The inline size where ``ringcomm.init`` is given none: larger where every rank
        shares this node (see _SHARED_INLINE_BUDGET); the same on every rank."""
        return shared_inline_bytes(self.size) if self.local_size == self.size else (
            DEFAULT_INLINE_BYTES)

    def prepare_exchange(self, row_bytes: int) -> SizedExchange:
        """The agreement's exchange as point-to-point messages of each rank's own length
        (see :mod:`ringcomm.backends.mpi_exchange`), on a communicator of its own."""
        exchange = SizedExchange(self._agree, row_bytes, self.wait_all, self._polls,
                                 self.fused_calls)
        self._exchanges.append(exchange)
        return exchange

    def allgatherv(self, x: Array, counts: list[int], out: Array) -> None:
        displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64).tolist()
        if not (_ops.is_device_array(x) or _ops.is_device_array(out)):
            # As bytes: MPI has no type for bfloat16 and the like, and nothing is reduced.
            item = x.itemsize
            req = self._ctl.Iallgatherv(x.view(np.uint8), [out.view(np.uint8), (
                [c * item for c in counts], [d * item for d in displs])])
            self._wait_one(req, "allgatherv")
            return
        self._device_staging().allgatherv(self._ctl, x, counts, displs, out)

    def broadcast(self, x: Array, root: int) -> None:
        if not _ops.is_device_array(x):
            self._wait_one(self._ctl.Ibcast(x.view(np.uint8), root), "broadcast")
            return
        self._device_staging().broadcast(self._ctl, x, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank: sizes first, then the pickles' bytes."""
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.empty(self.size, np.int64)
        self._wait_one(self._ctl.Iallgather(np.array([data.size], np.int64), sizes),
                       "allgather of object sizes")
        ends = np.cumsum(sizes).tolist()
        starts = [0, *ends[:-1]]
        out = np.empty(ends[-1], np.uint8)
        self._wait_one(self._ctl.Iallgatherv(data, [out, (sizes.tolist(), starts)]),
                       "allgather of objects")
        return [pickle.loads(out[a:b].data) for a, b in zip(starts, ends, strict=True)]

    def barrier(self) -> None:
        self._wait_one(self._ctl.Ibarrier(), "barrier")

    def split(self, color: int, key: int) -> MPITransport:
        """``MPI_Comm_split`` of this transport's ranks (collective).

        Raises:
            InvalidArgumentError, InvalidTypeError: invalid color or key on some rank (on
                every rank; see ``agree_split``).
        """
        # The arguments are agreed on first, in a bounded exchange: a rank refusing its own
        # alone would leave the others in MPI_Comm_split, which has no nonblocking form; and
        # once every rank has answered, the blocking split cannot wait for a dead one.
        everyone = agree_split(self, color, key)
        color, key = everyone[self.rank]
        sub = self._ctl.Split(color, key)
        try:
            child = MPITransport(sub, timeout=self.timeout,
                                 abort_on_timeout=self.abort_on_timeout)
        finally:
            sub.Free()
        child.device_choice = self.device_choice  # one device per process, in every split
        return adopt_ranks(child, self, split_members(everyone, color))

    def close(self) -> None:
        self.release_scratch()
        for req in self._persistent:
            if req.Test():  # inactive (one left running by a timeout stays allocated)
                req.Free()
        self._persistent.clear()
        self._allreduces.clear()
        self._reduce_scatters.clear()
        for exchange in self._exchanges:
            exchange.free()
        self._exchanges.clear()
        if self._shared is not None:
            self._shared.close()
            self._shared_comm.Free()
        self._shared, self._shared_pending = None, False
        for comm in (self._ring, self._p2p, self._ctl, self._agree):
            comm.Free()

    # ------------------------------------------------------------------------- devices
    @property
    def device_id(self) -> int | None:
        """The CUDA device of this rank's device arrays (None until the first one comes)."""
        return self.device_choice.id

    def check_arrays(self, *arrays: Array) -> None:
        """Accept NumPy arrays, and CuPy arrays on this rank's device (selected with the first
        one: see :class:`~ringcomm.backends.cuda_device.DeviceChoice`).

        Raises:
            ValueError: a CuPy array on another device, or no usable GPU.
        """
        for a in arrays:
            if a is not None and type(a) is not np.ndarray and _ops.is_device_array(a):
                self.device_choice.check(a, self.rank)

    def device_scope(self) -> Any:
        """A context making this rank's CUDA device current (a no-op before one is selected)."""
        return self.device_choice.scope()

    # ------------------------------------------------------------------------ waiting
    def wait_all(self, reqs: list[Any], peer: int | None, what: str,
                 statuses: list[Any] | None = None) -> None:
        """Complete the MPI requests ``reqs`` within the timeout.

        Args:
            reqs: mpi4py requests of one operation.
            peer: the rank they wait for, where one is known (None for a collective).
            what: the step, for the error message ("ring exchange", "allgather", ...).
            statuses: MPI.Status objects to fill, one per request, for the caller to inspect
                when MPI raises.

        Raises:
            CollectiveTimeoutError: the timeout passed first (``abort_on_timeout=False``;
                otherwise the job ends with ``MPI_Abort``).
        """
        testall = self._testall
        if statuses is not None:
            testall = functools.partial(testall, statuses=statuses)
        if not testall(reqs):
            self._wait(functools.partial(testall, reqs), reqs, peer, what)

    def _wait_one(self, req: Any, what: str) -> None:
        """Complete the request of a collective within the timeout (see ``wait_all``)."""
        # Request.Test: cheaper than Testall over a list, on the small collectives' fast path.
        if not req.Test():
            self._wait(req.Test, [req], None, what)

    def _wait(self, done: Callable[[], bool], reqs: list[Any], peer: int | None,
              what: str) -> None:
        """Poll ``done()`` until it is true or the deadline passes (see _SPIN_S)."""
        start = _now()
        deadline = start + self.timeout
        spin_end = start + (_SHARED_SPIN_S if self._yield else _SPIN_S)
        while not done():
            now = _now()
            if now < spin_end:
                if self._yield:
                    os.sched_yield()
                continue
            if now >= deadline:
                self._expired(reqs, peer, what, now - start)
            pause = min(max((now - start) * _PAUSE_FRACTION, _FIRST_PAUSE_S), _MAX_PAUSE_S)
            time.sleep(min(pause, deadline - now))

    def _expired(self, reqs: list[Any], peer: int | None, what: str,
                 elapsed: float) -> NoReturn:
        """Log the timeout, then end the job (MPI_Abort) or raise CollectiveTimeoutError."""
        error = timeout_error(self, what, peer, elapsed, self.timeout)
        _LOG.error("%s", error)
        if self.abort_on_timeout:
            write_fatal(error, "Ending the job (MPI_Abort).")
            time.sleep(FORWARD_S)  # for the launcher to forward it before the job ends
            abort(self._ctl, 1)
        self.strand(reqs, error)
        raise error

    def strand(self, reqs: list[Any], error: Exception) -> None:
        """Keep the requests of a failed wait (MPI may still write into their buffers) and
        fail the transport: they would match a later call's messages."""
        self._stranded.extend(reqs)
        self.fail(error)

    # --------------------------------------------------------------------------- staging
    def scratch(self, key: str, like: Array, n: int, dtype: Any) -> Array:
        """A reusable buffer (see TransportBase.scratch); device scratch is ordered after the
        stream of its last use (see cuda_device.ScratchOrder)."""
        if _ops.is_device_array(like):
            self._scratch_order.follow(self._device_staging().cuda)
        return super().scratch(key, like, n, dtype)

    def _device_staging(self) -> staging.DeviceStaging:
        """How device arrays travel (created with the first one: it needs CuPy)."""
        if self._device_stage is None:
            self._device_stage = staging.DeviceStaging(self._MPI, self.cuda_aware,
                                                       wait=self.wait_all)
        return self._device_stage


def shared_inline_bytes(size: int) -> int:
    """The default inline size of ``size`` ranks on one node: _SHARED_INLINE_BUDGET shared
    among the other ranks, a multiple of 64 bytes from DEFAULT_INLINE_BYTES to
    _SHARED_INLINE_MAX."""
    if size < 2:
        return DEFAULT_INLINE_BYTES
    share = _SHARED_INLINE_BUDGET // (size - 1) // 64 * 64
    return max(DEFAULT_INLINE_BYTES, min(_SHARED_INLINE_MAX, share))


class MPICommunicator(Communicator):
    """The Communicator over MPI; the allreduce is ringcomm's own pipelined ring.

    Args:
        mpi_comm: the MPI communicator to run on (``MPI.COMM_WORLD`` by default); it is
            duplicated, so ringcomm's messages never match the application's.
        consistency_check: check before each collective that every rank passed matching
            arguments (one small allgather; see README, "Consistency check").
        segment_bytes: ring segment size; the measured default when None.
        inline_bytes: see ``ringcomm.init``.
        timeout: seconds a collective may wait for its peers (``DEFAULT_TIMEOUT_S`` when
            None); see MPITransport.
        abort_on_timeout: end the job with ``MPI_Abort`` on a timeout (True), or raise
            CollectiveTimeoutError (False). After a timeout the communicator is unusable:
            close it.
        device: the CUDA device of device arrays (``local_rank % device_count`` when None,
            selected with the first device array; see ``cuda_device``).
        options: the Communicator's own (``algorithm``, ``topology``, ``startup_error``).
    """

    def __init__(self, mpi_comm: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None,
                 timeout: float | None = None, abort_on_timeout: bool = True,
                 device: int | None = None, **options: Any) -> None:
        transport = MPITransport(mpi_comm, timeout=timeout, abort_on_timeout=abort_on_timeout,
                                 device=device)
        super().__init__(transport, consistency_check=consistency_check,
                         segment_bytes=segment_bytes, inline_bytes=inline_bytes, **options)

    @property
    def cuda_aware(self) -> bool:
        """Whether device arrays go to MPI directly (else staged through host memory)."""
        return cast(MPITransport, self.transport).cuda_aware
