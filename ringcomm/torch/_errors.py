"""The errors the adapters raise, and the translation of the communicator's into Horovod's."""

from __future__ import annotations

from typing import Any

import torch

from ringcomm.comm._mismatch import ranks_text
from ringcomm.comm.base import Communicator
from ringcomm.core.types import ArgumentMismatchError
from ringcomm.torch._objects import allgather_objects

__all__ = ["HorovodArgumentError", "HorovodInternalError", "StalledOperationError",
           "collective_error", "differs"]


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank (arguments differ between ranks, unsupported dtype, ...).

    The communicator stays usable: the job can catch this and go on.
    """


class HorovodArgumentError(HorovodInternalError, ValueError):
    """An operation's arguments were invalid on some rank (an unknown op, ``average`` with
    ``op``, a scale that is no number): raised on every rank, the operation run nowhere. A
    ValueError, as Horovod's own check raises, on the rank that passed them."""


class StalledOperationError(HorovodInternalError):
    """An operation submitted by some ranks only was never matched within the stall limit."""


def differs(field: str, values: list[Any], ranks: list[int] | None = None) -> str | None:
    """"<field> differs between ranks: <value> on ranks ...; ..." or None when all agree.

    Args:
        field: what is compared ("dtype", "shape", ...).
        values: one value per rank of ``ranks``.
        ranks: the ranks the values come from (0, 1, ... when None).
    """
    groups: dict[Any, list[int]] = {}
    for r, v in zip(range(len(values)) if ranks is None else ranks, values, strict=True):
        groups.setdefault(v, []).append(r)
    if len(groups) < 2:
        return None
    shown = "; ".join(f"{v} on {ranks_text(rs)}" for v, rs in groups.items())
    return f"{field} differs between ranks: {shown}"


def collective_error(comm: Communicator, err: Exception, kind: str,
                     tensor: torch.Tensor | None) -> HorovodInternalError:
    """Turn the communicator's ValueError/TypeError of a collective into a RuntimeError.

    When the communicator reports arguments that differ between ranks (raised on every rank
    alike), every rank also exchanges its tensor's torch dtype and shape, so that the message
    names them as the user knows them: tensors of dtypes that travel widened would otherwise
    show up under their wire dtype and shape.

    Args:
        comm: the communicator the collective ran on.
        err: what it raised.
        kind: the collective's name as the communicator reports it ("allreduce", ...).
        tensor: this rank's input tensor.

    Returns:
        A HorovodInternalError (a RuntimeError) carrying the message; raise it ``from err``.
    """
    message = str(err)
    # The type says the agreement raised it, on every rank alike, so every rank takes part in
    # the exchange below; a mismatch of the collectives themselves has nothing to re-describe.
    if tensor is not None and isinstance(err, ArgumentMismatchError) and err.kind == kind:
        described = allgather_objects(comm, (str(tensor.dtype), tuple(tensor.shape)))
        dtypes = differs("dtype", [d for d, _ in described])
        if kind == "allgatherv":
            shapes = differs("shape after the first dimension", [s[1:] for _, s in described])
        else:
            shapes = differs("shape", [s for _, s in described])
        if dtypes or shapes:
            message = f"{kind}: " + "; ".join(p for p in (dtypes, shapes) if p)
    return HorovodInternalError(message)
