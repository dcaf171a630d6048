"""A small allreduce's exchange and reduction as one compiled call (MPI).

A repeated small allreduce (every training step's loss, a metric, a flag) rides in the
agreement's exchange (:mod:`ringcomm.comm._inline`): copy the array behind the call's header,
exchange every rank's message, compare the headers, reduce the rows in rank order. In Python
that is a dozen calls of a few hundred nanoseconds each around the messages' own 2-3 us. Here
it is one Numba function that starts the exchange's persistent MPI requests and polls them
through MPI's C functions (``MPI_Startall``, ``MPI_Testall``, bound by name from the library
mpi4py loaded), compares every rank's header with this rank's and reduces
(bench/results/fused_small.md).

A message past MPICH's eager limit travels in chunks as on the Python path
(:mod:`ringcomm.backends.mpi_exchange`): the later chunks' receives start once every header
is found equal to this rank's. Only what reproduces the Python path's bits is compiled: dtypes
whose arithmetic Numba does as NumPy does (float32 and float64 by sum, prod and avg; int32 and
int64 by sum, prod, min and max, wrapping alike), every element reduced in rank order as
``ufunc.reduce`` does. Everything else keeps the Python path, which is also where every error
is raised: headers that differ are handed back (``verify`` then raises on every rank), and an
exchange still on the way after the polls is completed by the transport's timed wait.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.backends import _mpi_fused_jit as _jit
from ringcomm.backends._mpi_fused_jit import (
    DIFFER,
    DONE,
    ERROR,
    HANDLE,
    HANDLES,
    HEADER_WORDS,
    IERR,
    LENGTH,
    NFIRST,
    NRECVS,
    NROWS,
    NSENDS,
    OP,
    OPS,
    PENDING_FIRST,
    PENDING_REST,
    POLLS,
    RANK,
    ROW_ITEMS,
    ROWS,
    STALE,
    STATUSES,
)
from ringcomm.backends.mpi_process import import_mpi

__all__ = ["DIFFER", "DONE", "STALE", "FusedAllreduce", "supports"]

_FLOAT_OPS = ("sum", "prod", "avg")
_INT_OPS = ("sum", "prod", "min", "max")


def supports(dtype: np.dtype, op: str) -> bool:
    """Whether the compiled call reduces ``dtype`` by ``op`` with the Python path's bits."""
    if not dtype.isnative:
        return False
    if dtype.kind == "f" and dtype.itemsize in (4, 8):
        return op in _FLOAT_OPS
    return dtype.kind == "i" and dtype.itemsize in (4, 8) and op in _INT_OPS


class FusedAllreduce:
    """One prepared length's exchange, with the reduction of its inlined arrays, compiled.

    Args:
        first: the persistent requests of every message's first chunk (every peer's receive,
            then this rank's sends), which carries the header.
        recvs, sends: those of the later chunks (none where the message travels whole); the
            receives are started once every header is found equal to this rank's.
        rest: receives the later chunks from Python (the exchange's ``rest`` of this length),
            after headers that differ only where the call allows.
        recv: the exchange's buffer (ranks x row bytes; this rank's row is what it sends).
        rank: this rank's row.
        header: this call's header (96 bytes), written before the array.
        dtype, op: the inlined array's dtype, and the reduction.
        polls: how many times to test the requests before handing them to ``wait_all``.
        wait_all: the transport's timed wait (``MPITransport.wait_all``).
    """

    __slots__ = ("__weakref__", "_after_first", "_entry", "_first", "_later", "_reduce", "_rest",
                 "_wait_all", "ctrl", "rows", "start")

    def __init__(self, first: list[Any], recvs: list[Any], sends: list[Any],
                 rest: Callable[[], None], recv: np.ndarray, rank: int, header: bytes,
                 dtype: np.dtype, op: str, polls: int,
                 wait_all: Callable[[list[Any], int | None, str], None]) -> None:
        MPI = import_mpi()
        handle = MPI._sizeof(MPI.Request)
        status = MPI._sizeof(MPI.Status)
        if len(header) != 8 * HEADER_WORDS or recv.shape[1] % 8:
            raise ValueError("the exchange's rows do not hold whole words after the header")
        self._entry, self._after_first, self._reduce = _kernels()
        self._first, self._later, self._rest = first, recvs + sends, rest
        self._wait_all = wait_all
        # Every rank's row as the array's dtype: the header, then the inlined array.
        self.rows = recv.view(dtype)
        requests = first + recvs + sends
        statuses = HANDLES + (len(requests) * handle + 7) // 8
        self.ctrl = np.zeros(statuses + (len(requests) * status + 7) // 8, np.int64)
        self.ctrl[:HEADER_WORDS] = np.frombuffer(header, np.int64)
        handles = self.ctrl[HANDLES:statuses].view(np.uint8)
        for i, req in enumerate(requests):  # the C handles, as MPI holds them
            handles[i * handle:(i + 1) * handle] = np.frombuffer(
                ctypes.string_at(MPI._addressof(req), handle), np.uint8)
        self.ctrl[[NFIRST, NRECVS, NSENDS, HANDLE, STATUSES, RANK, POLLS, OP, LENGTH, ROWS,
                   NROWS, ROW_ITEMS]] = (
            len(first), len(recvs), len(sends), handle, statuses, rank, max(polls, 1), OPS[op],
            self.ctrl.size, self.rows.ctypes.data, *self.rows.shape)
        # Compiled (or loaded from Numba's cache) before the first call, which then sends
        # nothing if this fails.
        _compile(self.rows, self.ctrl, dtype)
        #: ``start(x, out)``: the compiled call's first part, its code as it returns it
        #: (``finish`` takes any other than DONE): the caller's path of every repeat, with
        #: nothing between it and the compiled code. It reaches ``ctrl`` and ``rows`` by
        #: address: this object holds them.
        self.start = functools.partial(self._entry, self.ctrl.ctypes.data)

    def set_header(self, header: bytes) -> None:
        """Send ``header`` from now on (the caller's name changed)."""
        self.ctrl[:HEADER_WORDS] = np.frombuffer(header, np.int64)

    def forget(self) -> None:
        """The requests were freed: every later call returns STALE, sending nothing."""
        self.ctrl[NFIRST] = 0

    def finish(self, code: int, out: np.ndarray) -> int:
        """After ``start(x, out)`` returned ``code`` (not DONE): wait for what is still on
        the way (the transport's timed wait) and reduce. Returns DONE (``out`` holds the
        reduction); DIFFER where a rank's header differs from this rank's (``out``
        untouched; ``reduce`` after the check); STALE where the requests were freed (nothing
        sent: the caller runs the call another way).

        Raises:
            CollectiveTimeoutError: the other ranks did not come within the timeout.
            mpi4py.MPI.Exception: MPI refused to start or test the requests.
        """
        if code == PENDING_FIRST:
            self._wait_all(self._first, None, "agreement exchange")
            code = self._after_first(self.rows, self.ctrl, out)
        if code == PENDING_REST:
            self._wait_all(self._later, None, "agreement exchange")
            self._reduce(self.rows, self.ctrl, out)
            return DONE
        if code == ERROR:
            raise import_mpi().Exception(int(self.ctrl[IERR]))
        return code

    def reduce(self, out: np.ndarray) -> None:
        """After a call that returned DIFFER, where the headers differ only as the call
        allows: receive the later chunks, then reduce the rows into ``out``."""
        self._rest()
        self._reduce(self.rows, self.ctrl, out)


def precompile(dtype: np.dtype | type) -> None:
    """Compile the compiled call for ``dtype`` into Numba's on-disk cache (or load it from
    there), as its first use in a job would: the processes of a job that start at once then
    load it instead of each compiling it (about 6 s a dtype on one core). Binds MPI's
    functions (imports mpi4py's MPI). Sends nothing."""
    dtype = np.dtype(dtype)
    if not supports(dtype, "sum"):
        raise ValueError(f"the compiled call reduces float32/64 and int32/64; got {dtype}")
    rows = np.zeros((2, HEADER_WORDS + 1), np.int64).view(dtype)
    ctrl = np.zeros(HANDLES, np.int64)
    ctrl[[LENGTH, ROWS, NROWS, ROW_ITEMS]] = (ctrl.size, rows.ctypes.data, *rows.shape)
    _compile(rows, ctrl, dtype)


def _compile(rows: np.ndarray, ctrl: np.ndarray, dtype: np.dtype) -> None:
    """Call every entry point once for ``dtype`` (which compiles it, or loads it from
    Numba's cache), sending nothing: the call with no requests returns at once, the headers
    are made to differ, the reduction goes into a scratch element."""
    entry, after_first, reduce = _kernels()
    scratch, idle = np.zeros(1, dtype), ctrl.copy()
    idle[NFIRST] = 0
    entry(idle.ctypes.data, scratch, scratch)
    idle[:HEADER_WORDS] = 1 + rows[0].view(np.int64)[:HEADER_WORDS]  # differs
    after_first(rows, idle, scratch)
    reduce(rows, ctrl, scratch)


_bound = False


def _kernels() -> tuple[Any, Any, Any]:
    """The compiled call, its continuation and its reduction, MPI's functions bound (once a
    process)."""
    global _bound
    if not _bound:
        _jit.bind(ctypes.CDLL(import_mpi().__file__))
        _bound = True
    return _jit.start, _jit.after_first, _jit.reduce
