"""The compiled half of :mod:`ringcomm.backends.mpi_fused`: Numba functions that call MPI.

MPI's functions are declared by name (``ExternalFunction``) and bound to the addresses of the
library mpi4py loaded (``bind``, before the first call), so the compiled code is cached on
disk like ringcomm's other kernels and never holds an address of another process. The control
array's layout (``ctrl``, int64 words) is mpi_fused's: the header (12 words), the number of
requests, MPI's completion flag, its last error code, where the statuses start, then the
request handles and the statuses.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

__all__ = ["bind", "finish", "run"]

_HEADER_WORDS = 12
_NREQ, _FLAG, _IERR, _STATUSES, _HANDLES = 12, 13, 14, 15, 16
_PENDING, _DIFFER, _ERROR, _STALE = 1, 2, 3, 4

_startall = types.ExternalFunction(
    "MPI_Startall", types.int32(types.int32, types.voidptr))
_testall = types.ExternalFunction(
    "MPI_Testall", types.int32(types.int32, types.voidptr, types.voidptr, types.voidptr))

# As ringcomm's other kernels (ops/_cpu_jit.py): IEEE semantics, no fast-math, which keeps
# every sum the bits NumPy gives. The GIL is kept: the polls are few.
_OPTIONS: dict[str, Any] = {"cache": True, "error_model": "numpy", "fastmath": False}


def bind(lib: ctypes.CDLL) -> None:
    """Bind the MPI functions the kernels call to ``lib``'s (the MPI library in use)."""
    for name in ("MPI_Startall", "MPI_Testall"):
        llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)


@numba.njit(**_OPTIONS)
def run(x, rows, ctrl, out, rank, polls, op):
    """Write the header and ``x`` into this rank's row, start the exchange, poll it up to
    ``polls`` times, then (``finish``) compare and reduce. Returns 0 (done), 1 (still on the
    way: wait, then ``finish``), 2 (headers differ), 3 (MPI error, in ctrl) or 4 (stale)."""
    nreq = ctrl[_NREQ]
    if nreq == 0:
        return _STALE
    own = rows[rank].view(np.int64)
    for i in range(_HEADER_WORDS):
        own[i] = ctrl[i]
    skip = _HEADER_WORDS * 8 // rows.itemsize
    mine = rows[rank][skip:skip + x.shape[0]]
    for i in range(x.shape[0]):
        mine[i] = x[i]
    handles = ctrl[_HANDLES:].ctypes
    ierr = _startall(nreq, handles)
    if ierr != 0:
        ctrl[_IERR] = ierr
        return _ERROR
    flag = ctrl[_FLAG:_FLAG + 1].view(np.int32)
    statuses = ctrl[ctrl[_STATUSES]:].ctypes
    for _ in range(polls):
        ierr = _testall(nreq, handles, flag.ctypes, statuses)
        if ierr != 0:
            ctrl[_IERR] = ierr
            return _ERROR
        if flag[0]:
            return finish(rows, ctrl, out, True, op)
    return _PENDING


@numba.njit(**_OPTIONS)
def finish(rows, ctrl, out, check, op):
    """Compare every rank's header with this call's (where ``check``), then reduce the rows
    into ``out`` in rank order: each element is ((row 0 op row 1) op row 2) ..., the order of
    ``ufunc.reduce`` over axis 0. Returns 0 or 2."""
    size = rows.shape[0]
    if check:
        for r in range(size):
            head = rows[r].view(np.int64)
            for i in range(_HEADER_WORDS):
                if head[i] != ctrl[i]:
                    return _DIFFER
    skip = _HEADER_WORDS * 8 // rows.itemsize
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
    return 0
