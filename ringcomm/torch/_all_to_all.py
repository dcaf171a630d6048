"""All-to-all on a ringcomm communicator: every rank's counts agreed and checked, then the
bytes moved in pairwise exchanges.

:func:`move_bytes` is the data movement of Horovod's ``alltoall`` and of the torch.distributed
backend's ``all_to_all_single`` (:func:`all_to_all_single`). The latter first gathers every
rank's dtype and element counts (one agreed allgather), so that what gloo gets wrong without a
word is refused by every rank alike: tensors whose dtypes differ between ranks (gloo moves
their bytes: each rank gets another wrong answer), and a rank that expects from another more
or fewer elements than that one sends (gloo ends the process).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from ringcomm.comm.base import Communicator
from ringcomm.core.types import ArgumentMismatchError, DtypeMismatchError, InvalidArgumentError
from ringcomm.torch._tensors import as_array, flat_bytes

__all__ = ["agree_counts", "all_to_all_single", "apart", "move_bytes"]


def move_bytes(comm: Communicator, src: np.ndarray, dst: np.ndarray, sends: np.ndarray) -> None:
    """Move bytes between every pair of ranks: ``sends[s, d]`` bytes from rank ``s`` to rank
    ``d``, in ``size - 1`` pairwise steps (to ``rank + k`` and from ``rank - k`` at step k).

    Args:
        comm: the communicator.
        src: this rank's bytes to send (uint8), what goes to each rank in rank order.
        dst: where this rank receives (uint8), what comes from each rank in rank order.
        sends: every rank's byte counts, the same (size, size) table on every rank.
    """
    size, rank = comm.size, comm.rank
    sent = np.concatenate([[0], np.cumsum(sends[rank])])
    got = np.concatenate([[0], np.cumsum(sends[:, rank])])
    dst[got[rank]: got[rank + 1]] = src[sent[rank]: sent[rank + 1]]
    for k in range(1, size):
        to, frm = (rank + k) % size, (rank - k) % size
        comm.sendrecv(src[sent[to]: sent[to + 1]], to, dst[got[frm]: got[frm + 1]], frm)


# What a rank's split sizes may be wrong with, by code (see _counts).
_PROBLEMS = {
    1: "the {name} is a scalar; all_to_all_single splits the first dimension",
    2: "{detail} {name} split sizes; expected one per rank ({size})",
    3: "a negative {name} split size ({detail})",
    4: "the {name} split sizes add up to {detail}, not the {name}'s first dimension ({dim0})",
    5: "the {name}'s first dimension ({dim0}) does not divide among {size} ranks (no split "
       "sizes given)",
}

# At most this many pairs of ranks are named where counts differ (a job may have thousands).
_LISTED = 8

# Each rank's row of the gathered table: dtype code, then for the input and the output its
# first dimension, problem and detail, then its element counts to (from) every rank.
_HEAD = 7


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


_DTYPE_NAMES = {_dtype_code(d): str(d).removeprefix("torch.")
                for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _counts(t: torch.Tensor, splits: list[int], size: int) -> tuple[list[int], int, int, int]:
    """``(element counts per rank, first dimension, problem, detail)`` for ``t`` split by
    torch's ``splits`` (rows of the first dimension; empty: equal parts); on a problem, zeros."""
    none = [0] * size
    if t.dim() == 0:
        return none, 0, 1, 0
    dim0, row = t.shape[0], math.prod(t.shape[1:])
    if not splits:
        if dim0 % size:
            return none, dim0, 5, 0
        return [dim0 // size * row] * size, dim0, 0, 0
    if len(splits) != size:
        return none, dim0, 2, len(splits)
    if min(splits) < 0:
        return none, dim0, 3, min(splits)
    if sum(splits) != dim0:
        return none, dim0, 4, sum(splits)
    return [s * row for s in splits], dim0, 0, 0


def _row(size: int, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
         input_split_sizes: list[int]) -> list[int]:
    sends, in_dim0, in_problem, in_detail = _counts(input, list(input_split_sizes), size)
    recvs, out_dim0, out_problem, out_detail = _counts(output, list(output_split_sizes), size)
    return [_dtype_code(input.dtype), in_dim0, in_problem, in_detail, out_dim0, out_problem,
            out_detail, *sends, *recvs]


def _check(table: np.ndarray) -> np.ndarray:
    """Raise the same error on every rank (``table`` is every rank's row) unless the call is
    sound; return the element counts, ``[s, d]`` from rank s to rank d."""
    size = len(table)
    label = "all_to_all_single"
    bad = []
    for r, row in enumerate(table.tolist()):
        for name, (dim0, code, detail) in (("input", row[1:4]), ("output", row[4:7])):
            if code:
                bad.append(f"rank {r}: " + _PROBLEMS[code].format(
                    name=name, dim0=dim0, detail=detail, size=size))
    if bad:
        raise InvalidArgumentError(f"{label}: " + "; ".join(bad))
    codes = table[:, 0].tolist()
    if len(set(codes)) > 1:
        named = ", ".join(f"rank {r}: {_DTYPE_NAMES.get(c, f'dtype {c}')}"
                          for r, c in enumerate(codes))
        raise DtypeMismatchError(f"{label}: tensors of different dtypes ({named})")
    sends, recvs = table[:, _HEAD: _HEAD + size], table[:, _HEAD + size:]
    wrong = [f"rank {s} sends {sends[s, d]} elements to rank {d}, which expects {recvs[d, s]}"
             for s in range(size) for d in range(size) if sends[s, d] != recvs[d, s]]
    if wrong:
        more = f"; and {len(wrong) - _LISTED} more" if len(wrong) > _LISTED else ""
        raise ArgumentMismatchError(f"{label}: split sizes differ between ranks: "
                                    + "; ".join(wrong[:_LISTED]) + more)
    return sends


def agree_counts(comm: Communicator, output: torch.Tensor, input: torch.Tensor,
                 output_split_sizes: list[int], input_split_sizes: list[int]) -> np.ndarray:
    """Gather every rank's dtype and element counts for torch.distributed's
    ``all_to_all_single`` (rank s's ``input_split_sizes[d]`` rows go to rank d, where they are
    the ``output_split_sizes[s]`` rows of ``output``; empty split sizes: equal parts) and check
    them; return the element counts, ``[s, d]`` from rank s to rank d.

    Raises, on every rank alike, before anything moves: InvalidArgumentError for bad split
    sizes on any rank, DtypeMismatchError where dtypes differ between ranks,
    ArgumentMismatchError where a rank expects from another more or fewer elements than that
    one sends.
    """
    row = _row(comm.size, output, input, output_split_sizes, input_split_sizes)
    table = comm.allgather(np.asarray(row, dtype=np.int64)).reshape(comm.size, len(row))
    return _check(table)


def all_to_all_single(comm: Communicator, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int]) -> None:
    """torch.distributed's ``all_to_all_single`` of CPU tensors on ``comm``, written into
    ``output`` in place: the counts agreed and checked (:func:`agree_counts`), then the bytes
    moved pairwise (:func:`move_bytes`). Any dtype: the bytes move as they are."""
    sends = agree_counts(comm, output, input, output_split_sizes, input_split_sizes)
    src = _bytes(apart(output, input).contiguous())
    into = (output if output.is_contiguous()
            else torch.empty_like(output, memory_format=torch.contiguous_format))
    move_bytes(comm, src, _bytes(into), sends * input.element_size())
    if into is not output:
        output.copy_(into)


def apart(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``input``, or a copy of it where it lies in ``output``'s memory (an all-to-all in
    place): the pairwise steps receive into parts of the output that later steps still have
    to send, and so does gloo's all-to-all (torch 2.13: rank 2 of 3 in place got
    ``[200, 201, 104, 105, 204, 205]``, not ``[4, 5, 104, ...]``)."""
    if input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        return input.clone(memory_format=torch.contiguous_format)
    return input


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a flat uint8 NumPy array."""
    return as_array(flat_bytes(t))
