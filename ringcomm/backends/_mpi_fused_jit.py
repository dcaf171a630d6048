"""The compiled half of :mod:`ringcomm.backends.mpi_fused`: Numba functions that call MPI.

MPI's functions are declared by name (``ExternalFunction``) and bound to the addresses of the
library mpi4py loaded (``bind``, before the first call), so the compiled code is cached on
disk like ringcomm's other kernels and never holds an address of another process.

The control array (``ctrl``, int64 words; mpi_fused builds it): the header (12 words); the
number of requests of the first chunks (every peer's receive, this rank's sends; 0 once they
were freed), of the later chunks' receives and of their sends; the bytes of one request handle;
MPI's completion flag; its last error code; the word where the statuses start; this rank's row;
how many times to poll; the reduction; the control array's length; the address of the
exchange's rows, their number and their length in elements; then the handles, in that order
(first chunks, later receives, later sends), and the statuses. What stays the same from call to
call lives there, not in arguments: each array an argument costs Numba's dispatch time on every
call, so ``start``, the entry point of every repeat, takes the control array's address and
finds the rows through it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from ringcomm.ops._cpu_jit import cached_njit

__all__ = ["DIFFER", "DONE", "ERROR", "FLAG", "HANDLE", "HANDLES", "HEADER_WORDS", "IERR",
           "LENGTH", "NFIRST", "NRECVS", "NROWS", "NSENDS", "OP", "OPS", "PENDING_FIRST",
           "PENDING_REST", "POLLS", "RANK", "ROWS", "ROW_ITEMS", "STALE", "STATUSES",
           "after_first", "bind", "reduce", "run", "start"]

# Defined here, with the functions that read them, and imported by mpi_fused: Numba's cache of
# these functions is renewed when this file changes, not when another one does.
#: The control array's words: the header, the counts of requests (first chunks, later
#: receives, later sends), a handle's bytes, MPI's flag and error code, where the statuses
#: start, this rank, the polls, the reduction (``OPS``), the control array's length, the
#: rows' address, number and length; the handles from word HANDLES.
HEADER_WORDS = 12
(NFIRST, NRECVS, NSENDS, HANDLE, FLAG, IERR, STATUSES, RANK, POLLS, OP, LENGTH, ROWS, NROWS,
 ROW_ITEMS) = range(12, 26)
HANDLES = 26
#: The reductions, as the ``OP`` word holds them.
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
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
    """``fn`` compiled with these options, its code cached on disk as ringcomm's other
    kernels' (``cached_njit``)."""
    return cached_njit(fn, options=_OPTIONS)


def bind(lib: ctypes.CDLL) -> None:
    """Bind the MPI functions the kernels call to ``lib``'s (the MPI library in use)."""
    for name in ("MPI_Startall", "MPI_Testall"):
        llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)


@intrinsic
def _pointer(typingctx: Any, address: Any) -> Any:
    """The address (an int64) as a pointer, for ``numba.carray``."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


@_jit
def start(address, x, out):
    """``run`` with the control array at ``address`` (kept alive by its owner), and the rows
    where it says: the entry point of every repeat, two arrays to unbox instead of four."""
    ctrl = numba.carray(_pointer(address), (HANDLES,), np.int64)
    ctrl = numba.carray(_pointer(address), (ctrl[LENGTH],), np.int64)
    rows = numba.carray(_pointer(ctrl[ROWS]), (ctrl[NROWS], ctrl[ROW_ITEMS]), x.dtype)
    return run(rows, ctrl, x, out)


@_jit
def _start(ctrl, begin, count):
    """MPI_Startall on ``count`` requests from handle ``begin``; MPI's error code."""
    handles = ctrl[HANDLES:].view(np.uint8)[begin * ctrl[HANDLE]:]
    ierr = _startall(count, handles.ctypes)
    if ierr != 0:
        ctrl[IERR] = ierr
    return ierr


@_jit
def _poll(ctrl, begin, count):
    """MPI_Testall on ``count`` requests from handle ``begin``, up to ``ctrl[POLLS]`` times: 0
    (all complete), 1 (not yet) or 3 (MPI's error, in ctrl)."""
    handles = ctrl[HANDLES:].view(np.uint8)[begin * ctrl[HANDLE]:]
    flag = ctrl[FLAG:FLAG + 1].view(np.int32)
    statuses = ctrl[ctrl[STATUSES]:]
    for _ in range(ctrl[POLLS]):
        ierr = _testall(count, handles.ctypes, flag.ctypes, statuses.ctypes)
        if ierr != 0:
            ctrl[IERR] = ierr
            return ERROR
        if flag[0]:
            return 0
    return 1


@_jit
def run(rows, ctrl, x, out):
    """Write the header and ``x`` into this rank's row, start the exchange (the first chunks,
    and this rank's later chunks' sends), poll the first chunks up to ``ctrl[POLLS]`` times, then
    (``after_first``) compare and reduce. Returns 0 (done), 1 (the first chunks still on the
    way: wait for them, then ``after_first``), 2 (headers differ), 3 (MPI's error, in ctrl),
    4 (the requests were freed: nothing sent) or 5 (the later chunks still on the way: wait
    for them, then ``reduce``)."""
    nfirst = ctrl[NFIRST]
    if nfirst == 0:
        return STALE
    rank = ctrl[RANK]
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
    code = _poll(ctrl, 0, nfirst)
    if code != 0:
        return PENDING_FIRST if code == 1 else code
    return after_first(rows, ctrl, out)


@_jit
def after_first(rows, ctrl, out):
    """Every rank's first chunk is in: compare every header with this call's, receive the
    later chunks (polled up to ``ctrl[POLLS]`` times), reduce. Returns 0, 2, 3 or 5 (as
    ``run``)."""
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
        code = _poll(ctrl, nfirst, nrecvs + ctrl[NSENDS])
        if code != 0:
            return PENDING_REST if code == 1 else code
    reduce(rows, ctrl, out)
    return 0


@_jit
def reduce(rows, ctrl, out):
    """Reduce every rank's array into ``out`` in rank order: each element is ((row 0 op row 1)
    op row 2) ..., the order of ``ufunc.reduce`` over axis 0; avg then divides by the ranks."""
    size, op = rows.shape[0], ctrl[OP]
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
