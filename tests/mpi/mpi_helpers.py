"""Helpers shared by the multi-process tests."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def same_on_all_ranks(world: MPI.Comm, array: np.ndarray) -> bool:
    """Whether ``array`` has the same bytes on every rank."""
    data = np.ascontiguousarray(array).tobytes()
    first = world.bcast(data if world.Get_rank() == 0 else None, root=0)
    return bool(world.allreduce(int(data == first), op=MPI.MIN))


def gather_inputs(world: MPI.Comm, x: np.ndarray) -> np.ndarray:
    """Every rank's ``x`` stacked in rank order (size x ...)."""
    return np.stack(world.allgather(np.ascontiguousarray(x)))


def reference(world: MPI.Comm, x: np.ndarray, op: str) -> np.ndarray:
    """The reduction of every rank's ``x`` computed with NumPy in float64 (exact for ints)."""
    xs = gather_inputs(world, x)
    wide = xs.astype(np.float64) if xs.dtype.kind == "f" else xs
    fn = {"sum": np.sum, "avg": np.sum, "min": np.min, "max": np.max, "prod": np.prod}[op]
    out = fn(wide, axis=0)
    if op == "avg":
        out = out / xs.shape[0]
    return out


def tolerance(dtype: np.dtype, n: int, op: str) -> float:
    """Relative tolerance of an n-rank reduction in ``dtype`` against float64."""
    if dtype.kind != "f":
        return 0.0
    if op in ("min", "max"):
        return 0.0
    eps = float(np.finfo(np.float32 if dtype.itemsize == 2 else dtype).eps)
    rounding = float(np.finfo(dtype).eps) if dtype.itemsize == 2 else 0.0
    return 4 * n * eps + rounding


def fresh_mpi_communicator(monkeypatch, **env: str):
    """A new MPI communicator over the whole job, made with ``env`` set (its start-up
    settings), a 4 KiB inline size, a 60 s timeout and timeouts raised, not fatal."""
    from ringcomm.backends.mpi import MPICommunicator
    from ringcomm.comm.agree import INLINE_BYTES
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return MPICommunicator(MPI.COMM_WORLD, abort_on_timeout=False, timeout=60,
                           inline_bytes=INLINE_BYTES)
