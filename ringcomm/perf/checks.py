"""Result checks of the benchmark: wrong elements against MPI's float64 reduction, results that
differ between ranks, and the relative error of compressed calls."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["count_differing", "count_wrong", "host", "mpi_op", "relative_error"]


def host(x: Any) -> np.ndarray:
    """``x`` as a host array (a copy from the device for CuPy arrays)."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _eps(dtype: np.dtype) -> float:
    if dtype.name == "bfloat16":
        return 2.0 ** -7
    return float(np.finfo(dtype).eps) if dtype.kind == "f" else 0.0


def mpi_op(op: str) -> Any:
    """MPI's reduction for ``op`` (``avg``: MPI.SUM, divided afterwards)."""
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX,
            "prod": MPI.PROD}[op]


def count_wrong(world: Any, x: Any, y: Any, op: str) -> int:
    """Elements of ``y`` off the float64 reference by more than rounding, plus any rank whose
    result differs in a single bit from rank 0's (then every element counts as wrong); the
    same count on every rank (collective)."""
    from mpi4py import MPI

    host_x, host_y = host(x), host(y)
    n = world.Get_size()
    if host_x.dtype.kind in "fV":  # V: bfloat16
        wide = host_x.astype(np.float64)
        ref = np.empty_like(wide)
        world.Allreduce(wide, ref, op=mpi_op(op))
        scale = np.empty_like(wide)
        world.Allreduce(np.abs(wide), scale, op=MPI.SUM if op in ("sum", "avg") else MPI.MAX)
        if op == "avg":
            ref /= n
            scale /= n
        if op == "prod":
            scale = np.abs(ref)
        tol = 4 * n * _eps(host_x.dtype) * (scale + np.finfo(np.float64).tiny)
        wrong = int(np.count_nonzero(~(np.abs(host_y.astype(np.float64) - ref) <= tol)))
    else:
        ref = np.empty_like(host_x)
        world.Allreduce(host_x, ref, op=mpi_op(op))
        wrong = int(np.count_nonzero(host_y != ref))
    first = world.bcast(host_y.tobytes() if world.Get_rank() == 0 else None, root=0)  # bytes
    if host_y.tobytes() != first:
        wrong = host_y.size
    return int(world.allreduce(wrong, op=MPI.MAX))


def count_differing(world: Any, y: Any) -> int:
    """Elements of ``y`` whose bits differ from rank 0's result, the most over the ranks:
    compressed results must be bit-identical on every rank too (collective)."""
    from mpi4py import MPI

    mine = np.ascontiguousarray(host(y)).reshape(-1)
    first = world.bcast(mine.tobytes() if world.Get_rank() == 0 else None, root=0)
    bits = mine.view(np.uint8).reshape(mine.size, mine.itemsize)
    theirs = np.frombuffer(first, dtype=np.uint8).reshape(bits.shape)
    differing = int(np.count_nonzero((bits != theirs).any(axis=1)))
    return int(world.allreduce(differing, op=MPI.MAX))


def relative_error(world: Any, xs: Any, y: Any, op: str) -> float:
    """||y - exact|| / ||exact|| against the float64 reduction of the inputs (collective)."""
    from mpi4py import MPI

    wide = host(xs).astype(np.float64)
    ref = np.empty_like(wide)
    world.Allreduce(wide, ref, op=MPI.SUM)
    if op == "avg":
        ref /= world.Get_size()
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(host(y).astype(np.float64) - ref) / (denom or 1.0))
