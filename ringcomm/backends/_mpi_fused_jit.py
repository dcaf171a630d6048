"""The compiled half of :mod:`ringcomm.backends.mpi_fused`: Numba functions that call MPI.

MPI's functions are declared by name (``ExternalFunction``) and bound to the addresses of the
library mpi4py loaded (``bind``, before the first call), so the compiled code is cached on
disk like ringcomm's other kernels and never holds an address of another process.

The control array (``ctrl``, int64 words; mpi_fused builds it): the header (12 words); the
number of requests of the first chunks (every peer's receive, this rank's sends; 0 once they
were freed), of the later chunks' receives and of their sends; the bytes of one request handle;
MPI's completion flag; its last error code; the word where the statuses start; then the
handles, in that order (first chunks, later receives, later sends), and the statuses.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

__all__ = ["DIFFER", "DONE", "ERROR", "FLAG", "HANDLE", "HANDLES", "HEADER_WORDS", "IERR",
           "NFIRST", "NRECVS", "NSENDS", "PENDING_FIRST", "PENDING_REST", "STALE", "STATUSES",
           "after_first", "bind", "reduce", "run"]

# Defined here, with the functions that read them, and imported by mpi_fused: Numba's cache of
# these functions is renewed when this file changes, not when another one does.
#: The control array's words: the header, the counts of requests (first chunks, later
#: receives, later sends), a handle's bytes, MPI's flag and error code, where the statuses
#: start; the handles from word HANDLES.
HEADER_WORDS = 12
NFIRST, NRECVS, NSENDS, HANDLE, FLAG, IERR, STATUSES = range(12, 19)
HANDLES = 20
#: What the functions return (see ``run``).
DONE, PENDING_FIRST, DIFFER, ERROR, STALE, PENDING_REST = range(6)

_startall = types.ExternalFunction(
    "MPI_Startall", types.int32(types.int32, types.voidptr))
_testall = types.ExternalFunction(
    "MPI_Testall", types.int32(types.int32, types.voidptr, types.voidptr, types.voidptr))

# As ringcomm's other kernels (ops/_cpu_jit.py): IEEE semantics, no fast-math, which keeps
# every sum the bits NumPy gives. The GIL is kept: the polls are few.
_OPTIONS: dict[str, Any] = {"error_model": "numpy", "fastmath": False}


def _jit(fn: Any) -> Any:
    """``fn`` compiled, its code cached on disk (next to this file, else Numba's user-wide
    directory; in memory only where neither is writable, as ops/_cpu_jit.py does)."""
    try:
        return numba.njit(cache=True, **_OPTIONS)(fn)
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
        return numba.njit(cache=False, **_OPTIONS)(fn)


def bind(lib: ctypes.CDLL) -> None:
    """Bind the MPI functions the kernels call to ``lib``'s (the MPI library in use)."""
    for name in ("MPI_Startall", "MPI_Testall"):
        llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)


@_jit
def _start(ctrl, begin, count):
    """MPI_Startall on ``count`` requests from handle ``begin``; MPI's error code."""
    handles = ctrl[HANDLES:].view(np.uint8)[begin * ctrl[HANDLE]:]
    ierr = _startall(count, handles.ctypes)
    if ierr != 0:
        ctrl[IERR] = ierr
    return ierr


@_jit
def _poll(ctrl, begin, count, polls):
    """MPI_Testall on ``count`` requests from handle ``begin``, up to ``polls`` times: 0 (all
    complete), 1 (not yet) or 3 (MPI's error, in ctrl)."""
    handles = ctrl[HANDLES:].view(np.uint8)[begin * ctrl[HANDLE]:]
    flag = ctrl[FLAG:FLAG + 1].view(np.int32)
    statuses = ctrl[ctrl[STATUSES]:]
    for _ in range(polls):
        ierr = _testall(count, handles.ctypes, flag.ctypes, statuses.ctypes)
        if ierr != 0:
            ctrl[IERR] = ierr
            return ERROR
        if flag[0]:
            return 0
    return 1


@_jit
def run(x, rows, ctrl, out, rank, polls, op):
    """Write the header and ``x`` into this rank's row, start the exchange (the first chunks,
    and this rank's later chunks' sends), poll the first chunks up to ``polls`` times, then
    (``after_first``) compare and reduce. Returns 0 (done), 1 (the first chunks still on the
    way: wait for them, then ``after_first``), 2 (headers differ), 3 (MPI's error, in ctrl),
    4 (the requests were freed: nothing sent) or 5 (the later chunks still on the way: wait
    for them, then ``reduce``)."""
    nfirst = ctrl[NFIRST]
    if nfirst == 0:
        return STALE
    own = rows[rank].view(np.int64)
    for i in range(HEADER_WORDS):
        own[i] = ctrl[i]
    skip = HEADER_WORDS * 8 // rows.itemsize
    mine = rows[rank][skip:skip + x.shape[0]]
    for i in range(x.shape[0]):
        mine[i] = x[i]
    if _start(ctrl, 0, nfirst) != 0:
        return ERROR
    nsends = ctrl[NSENDS]
    if nsends and _start(ctrl, nfirst + ctrl[NRECVS], nsends) != 0:
        return ERROR
    code = _poll(ctrl, 0, nfirst, polls)
    if code != 0:
        return PENDING_FIRST if code == 1 else code
    return after_first(rows, ctrl, out, polls, op)


@_jit
def after_first(rows, ctrl, out, polls, op):
    """Every rank's first chunk is in: compare every header with this call's, receive the
    later chunks (polled up to ``polls`` times), reduce. Returns 0, 2, 3 or 5 (as ``run``)."""
    for r in range(rows.shape[0]):
        head = rows[r].view(np.int64)
        for i in range(HEADER_WORDS):
            if head[i] != ctrl[i]:
                return DIFFER
    nrecvs = ctrl[NRECVS]
    if nrecvs:
        nfirst = ctrl[NFIRST]
        if _start(ctrl, nfirst, nrecvs) != 0:
            return ERROR
        code = _poll(ctrl, nfirst, nrecvs + ctrl[NSENDS], polls)
        if code != 0:
            return PENDING_REST if code == 1 else code
    reduce(rows, out, op)
    return 0


@_jit
def reduce(rows, out, op):
    """Reduce every rank's array into ``out`` in rank order: each element is ((row 0 op row 1)
    op row 2) ..., the order of ``ufunc.reduce`` over axis 0; avg then divides by the ranks."""
    size = rows.shape[0]
    skip = HEADER_WORDS * 8 // rows.itemsize
    n = out.shape[0]
    first = rows[0][skip:skip + n]
    for i in range(n):
        out[i] = first[i]
    for r in range(1, size):
        row = rows[r][skip:skip + n]
        if op == 0 or op == 4:
            for i in range(n):
                out[i] = out[i] + row[i]
        elif op == 1:
            for i in range(n):
                out[i] = out[i] * row[i]
        elif op == 2:
            for i in range(n):
                out[i] = min(out[i], row[i])
        else:
            for i in range(n):
                out[i] = max(out[i], row[i])
    if op == 4:
        divisor = out[:1].copy()
        divisor[0] = size
        for i in range(n):
            out[i] = out[i] / divisor[0]
