"""Helpers shared by reducescatter, alltoall and grouped_allgather: argument checks, an
operation's description, row and byte arithmetic, and an allgather of small integers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ringcomm.comm.base import Communicator
from ringcomm.torch._errors import collective_error
from ringcomm.torch._tensors import as_array, flat_bytes, from_array, sync_device
from ringcomm.torch.horovod._ops import describe

__all__ = [
    "allgather_ints",
    "byte_view",
    "check_tensor",
    "check_tensors",
    "describe_each",
    "op_label",
    "row_elems",
    "total_nbytes",
]


def check_tensor(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def check_tensors(tensors: Any) -> list[torch.Tensor]:
    given = type(tensors).__name__
    if not isinstance(tensors, torch.Tensor):
        tensors = list(tensors)
        if all(isinstance(t, torch.Tensor) for t in tensors):
            return tensors
    raise TypeError(f"expected a list of torch.Tensor, got {given}")


def describe_each(tensors: list[torch.Tensor], *, trailing: bool) -> dict[str, Any]:
    """The ``meta`` of a list: its length, and each tensor's fields named by position."""
    meta: dict[str, Any] = {"tensors": len(tensors),
                            "devices in the list": len({t.device for t in tensors})}
    for i, t in enumerate(tensors):
        fields = describe(t, trailing=trailing)
        if trailing:
            fields["dim"] = t.dim()
        if "error" in fields:  # refused: the operation fails on every rank
            meta.setdefault("error", fields.pop("error"))
        meta.update({f"{field} of tensor {i}": value for field, value in fields.items()})
    return meta


def op_label(kind: str, name: str | None) -> str:
    return kind if name is None else f"{kind} {name!r}"


def total_nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def row_elems(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return flat_bytes(t.detach().contiguous())


def allgather_ints(comm: Communicator, values: list[int], device: torch.device) -> np.ndarray:
    """Every rank's ``values`` (as many on every rank) as a (size, len(values)) int64 array."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    try:
        everyone = comm.allgather(as_array(mine))
    except (ValueError, TypeError) as err:
        raise collective_error(comm, err, "allgather", None) from err
    sync_device(everyone)
    return from_array(everyone).cpu().numpy().reshape(comm.size, len(values))

