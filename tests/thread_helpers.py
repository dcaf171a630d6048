"""Helpers for the one-process tests of the algorithms over the threads backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringcomm.backends.threads import run_ranks
from ringcomm.comm.base import Communicator

#: Rank counts every algorithm is tested at.
SIZES = (1, 2, 3, 5, 8, 16)
#: A segment small enough that several segments run even on small arrays.
SEGMENT = 256


def identical(arrays: Sequence[np.ndarray]) -> bool:
    """Whether every array has the first one's dtype, shape and bytes (NaN bits included)."""
    first = arrays[0]
    return all(a.dtype == first.dtype and a.shape == first.shape
               and a.tobytes() == first.tobytes() for a in arrays)


def rank_inputs(rng: np.random.Generator, n: int, length: int, dtype: str,
                op: str) -> np.ndarray:
    """Every rank's input (n x length), with values for which ``op`` cannot overflow."""
    dt = np.dtype(dtype)
    if dt.kind == "i":
        hi = 3 if op == "prod" else 1000  # 3**16 still fits int32
        return rng.integers(-hi, hi + 1, size=(n, length)).astype(dt)
    if op == "prod":  # magnitudes around 1, so 16 factors stay in float16's range
        signs = rng.choice(np.array([-1.0, 1.0]), size=(n, length))
        return (signs * rng.uniform(0.7, 1.3, size=(n, length))).astype(dt)
    return rng.standard_normal((n, length)).astype(dt)


def reference(xs: np.ndarray, op: str) -> np.ndarray:
    """The reduction of the rows of ``xs`` in float64 (int64 for integers: exact)."""
    wide = xs.astype(np.float64 if xs.dtype.kind == "f" else np.int64)
    fn = {"sum": np.sum, "avg": np.sum, "min": np.min, "max": np.max, "prod": np.prod}[op]
    out = fn(wide, axis=0)
    return out / xs.shape[0] if op == "avg" else out


def assert_matches_reference(y: np.ndarray, xs: np.ndarray, op: str) -> None:
    """Assert ``y`` equals the float64 reduction of ``xs``'s rows.

    Integers, min and max are exact. Otherwise, with n ranks, accumulation epsilon e (float32
    for 16-bit floats, whose partials travel in float32) and M the magnitude of the terms
    (sum |x| for sum, the same / n for avg, |result| for prod): |y - ref| <= 2 n e M, plus
    one rounding to the output dtype for 16-bit floats (eps16 |ref|).
    """
    ref = reference(xs, op)
    assert y.dtype == xs.dtype and y.shape == ref.shape
    if xs.dtype.kind != "f" or op in ("min", "max"):
        np.testing.assert_array_equal(y.astype(ref.dtype), ref)
        return
    n = xs.shape[0]
    small = xs.dtype.itemsize == 2
    acc = np.finfo(np.float32 if small else xs.dtype).eps
    if op == "prod":
        magnitude = np.abs(ref)
    else:
        magnitude = np.abs(xs.astype(np.float64)).sum(axis=0) / (n if op == "avg" else 1)
    rounding = np.finfo(xs.dtype).eps * np.abs(ref) if small else 0.0
    bound = 2 * n * acc * magnitude + rounding + np.finfo(xs.dtype).tiny
    error = np.abs(y.astype(np.float64) - ref)
    assert (error <= bound).all(), (
        f"max error {error.max():.3g} over the bound at {int(np.argmax(error - bound))}")


def assert_conserved(per_rank: Sequence[tuple[Any, Any]], xs: np.ndarray, op: str) -> None:
    """(sum of results, in sum units) + (sum of residuals) == (sum of inputs), elementwise.

    Tolerance: 2 n float32 epsilons times the total magnitude of the inputs at the element
    (sum over steps and ranks of |x|): every hop rounds one float32 addition of a partial sum,
    and the partials of all steps together are at most that magnitude. (Measured here: at
    most 0.75 epsilon times the magnitude.)
    """
    n = xs.shape[1]
    results, _ = per_rank[0]
    lhs = sum(y.astype(np.float64) for y in results) * (n if op == "avg" else 1)
    lhs = lhs + sum(res.astype(np.float64) for _, res in per_rank)
    rhs = xs.astype(np.float64).sum(axis=(0, 1))
    magnitude = np.abs(xs.astype(np.float64)).sum(axis=(0, 1))
    bound = 2 * n * np.finfo(np.float32).eps * magnitude
    error = np.abs(lhs - rhs)
    assert (error <= bound).all(), f"mass lost: max error {error.max():.3g}"


def on_grid(shape: tuple[int, int], fn: Callable[[Any, Any, int], Any], *,
            timeout: float = 60.0) -> list:
    """Run ``fn(local, cross, rank)`` on every rank of a ``shape`` (nodes, ranks per node) job
    of thread ranks; results in rank order."""
    nodes, per_node = shape

    def body(t: Any) -> Any:
        local = t.split(t.rank // per_node, t.rank)
        cross = t.split(t.rank % per_node, t.rank)
        return fn(local, cross, t.rank)

    return run_ranks(nodes * per_node, body, timeout=timeout)


def communicators(n: int, fn: Callable[[Communicator], Any], **options: Any) -> list:
    """Run ``fn(comm)`` on a Communicator (``options``) per rank of an n-rank threads job."""

    def body(t: Any) -> Any:
        with Communicator(t, **options) as comm:
            return fn(comm)

    return run_ranks(n, body)
