"""A refused collective's error in the terms of the tensors given, not of the arrays they
travel as.

Tensors of dtypes the communicator lacks (bool, uint8, int8, int16, bfloat16) travel as
widened copies whose shape carries trailing unit dimensions that tell them apart
(``ringcomm.torch._tensors``). The communicator's agreement then speaks of those: an int8
tensor of shape (3,) against one of (4,) read "shape differs between ranks: (3, 1, 1, 1) on
rank 0; (4, 1, 1, 1) on rank 1", an int8 against an int32 one as a difference of shape, and
an average of int8 tensors as one of int32. Where a refusal involves such a tensor on some
rank, every rank (each got the same error) exchanges what it was given, and the error is
raised again naming the tensors' dtypes and shapes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ringcomm.core.types import (
    ArgumentMismatchError,
    CollectiveError,
    DtypeMismatchError,
    InvalidTypeError,
)
from ringcomm.torch._tensors import travels_widened

__all__ = ["in_torch_terms"]

_DESCRIPTION_BYTES = 512


@contextlib.contextmanager
def in_torch_terms(comm: Any, collective: str, tensor: torch.Tensor,
                   carried: Any) -> Iterator[None]:
    """Re-raise a refusal of ``collective`` naming the tensors' dtypes and shapes.

    Args:
        comm: the communicator the collective ran on (the same on every rank).
        collective: its name, as the message says it ("all_reduce").
        tensor: this rank's tensor.
        carried: the array it travelled as (its dtype is the one the communicator named).
    """
    try:
        yield
    except (ArgumentMismatchError, InvalidTypeError) as err:
        if not _about_the_tensors(err):
            raise
        given = _gathered(comm, tensor)
        if not any(widened for _, _, widened in given):
            raise
        raise _restated(err, collective, given, np.dtype(carried.dtype).name) from err


def _about_the_tensors(err: CollectiveError) -> bool:
    """Whether every rank ran this collective and refused its tensors: a dtype refused, or
    only dtypes and shapes differing (not calls that crossed, whose ranks are in different
    collectives and would not all come to the exchange, nor other arguments)."""
    if isinstance(err, ArgumentMismatchError):
        return bool(err.differences) and set(err.differences) <= {"dtype", "shape"}
    return True


def _gathered(comm: Any, tensor: torch.Tensor) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every rank's (dtype, shape, widened) of its tensor (collective: each rank got the same
    refusal, so each is here)."""
    text = json.dumps([str(tensor.dtype), list(tensor.shape), travels_widened(tensor.dtype)])
    raw = np.zeros(_DESCRIPTION_BYTES, dtype=np.uint8)
    data = text.encode()[:_DESCRIPTION_BYTES]
    raw[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = comm.allgather(raw.reshape(1, -1))
    out = []
    for row in rows:
        dtype, shape, widened = json.loads(bytes(row).rstrip(b"\0").decode())
        out.append((dtype, tuple(shape), bool(widened)))
    return out


def _restated(err: CollectiveError, collective: str,
              given: list[tuple[str, tuple[int, ...], bool]], carried: str) -> CollectiveError:
    dtypes = tuple(dtype for dtype, _, _ in given)
    shapes = tuple(shape for _, shape, _ in given)
    differences = {name: values for name, values in (("dtype", dtypes), ("shape", shapes))
                   if len(set(values)) > 1}
    if differences:
        each = "; ".join(f"{dtype} of shape {shape} on rank {rank}"
                         for rank, (dtype, shape, _) in enumerate(given))
        mismatch = DtypeMismatchError if "dtype" in differences else ArgumentMismatchError
        return mismatch(
            f"{collective}: the tensors differ between ranks ({' and '.join(differences)}): "
            f"{each}", kind=err.kind, ranks=err.ranks, differences=differences)
    def named(text: str) -> str:
        return text.replace(f"got {carried}", f"got {dtypes[0]}")

    return type(err)(named(str(err)), kind=err.kind, ranks=err.ranks,
                     differences=err.differences, reason=named(err.reason))
