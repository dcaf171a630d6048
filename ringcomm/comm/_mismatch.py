"""The one error every rank raises when the calls that met differ between ranks, built from
every rank's description of its call (:meth:`ringcomm.comm.agree.CallSpec.describe`)."""

from __future__ import annotations

from typing import Any

from ringcomm.core.types import (
    ArgumentMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
)

__all__ = ["HOOK_CALLER", "build_error", "is_hook_caller", "rank_groups", "ranks_text"]

#: The caller name of a DDP hook's collectives, "ringcomm-hook-k" for the k-th RingcommState
#: made on a communicator (ringcomm.torch.hooks).
HOOK_CALLER = "ringcomm-hook"


def is_hook_caller(name: object) -> bool:
    """Whether ``name`` is a caller name of a DDP hook's collectives."""
    return str(name).startswith(HOOK_CALLER)


def ranks_text(ranks: list[int]) -> str:
    """"rank 3" or "ranks 0, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def rank_groups(values: list[Any]) -> str:
    """'v1 on ranks 0, 2; v2 on rank 1'."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    # An empty value (a call without compression) is shown as "none", never as a blank.
    return "; ".join(f"{v if v != '' else 'none'!s} on {ranks_text(rs)}"
                     for v, rs in groups.items())


def build_error(descriptions: list[dict[str, Any]]) -> Exception:
    """The one error every rank raises, built from every rank's description of its call."""
    everyone = tuple(range(len(descriptions)))
    kinds = [d["kind"] for d in descriptions]
    called = "/".join(dict.fromkeys(kinds))
    callers = [d["caller"] for d in descriptions]
    if len(set(callers)) > 1:
        hooks = any(map(is_hook_caller, callers))
        return ArgumentMismatchError(
            f"{called}: the calls that met come from different threads:"
            f" {rank_groups([repr(c) for c in callers])}. Calls from several threads are "
            "matched by thread name: make each collective from the same-named thread on every "
            "rank" + (f" ('{HOOK_CALLER}-k' is the DDP hook of the k-th RingcommState made on "
                      "this communicator: make the same states, in the same order, on every "
                      "rank, and run the hooked models' backward passes one at a time, in the "
                      "same order on every rank)" if hooks else ""),
            kind=called, ranks=everyone, differences={"caller": tuple(callers)})
    if len(set(kinds)) > 1:
        calls = [f"a change of {d['setting']}" if d["kind"] == "configure" else
                 d["setting"] if d["kind"] == "checkpoint" else d["kind"]
                 for d in descriptions]
        return ArgumentMismatchError(
            f"collective calls differ between ranks: {rank_groups(calls)}", kind=called,
            ranks=everyone, differences={"kind": tuple(kinds)})
    kind = kinds[0]
    errors: dict[tuple[str, str], list[int]] = {}
    for r, d in enumerate(descriptions):
        if "error" in d:
            errors.setdefault(d["error"], []).append(r)
    if errors:
        (etype, msg), ranks = next(iter(errors.items()))
        cls = InvalidTypeError if etype == "TypeError" else InvalidArgumentError
        return cls(f"{kind} failed on {ranks_text(ranks)}: {msg}", kind=kind, ranks=tuple(ranks),
                   reason=msg)
    parts, differences = [], {}
    for field in ("array", "dtype", "shape", "op", "root", "compression/name", "setting",
                  "algorithm", "segment_bytes"):
        if kind == "allgatherv" and field == "shape":
            values = [d["shape"][1:] for d in descriptions]
            field = "shape after the first dimension"
        else:
            values = [d[field] for d in descriptions]
            if kind == "checkpoint" and field == "setting":
                field = "point"
        if len(set(values)) <= 1:
            continue
        differences[field] = tuple(values)
        parts.append(f"{field} differs between ranks: {rank_groups(values)}")
    hint = " (use allgatherv when the first dimension differs)" if kind == "allgather" else ""
    if "array" in differences:
        hint += (" (every rank must pass the same kind of array, host or device: on the NCCL "
                 "backend they travel different paths)")
    mismatch = DtypeMismatchError if "dtype" in differences else ArgumentMismatchError
    message = f"{kind}: " + "; ".join(parts or ["arguments differ between ranks"]) + hint
    return mismatch(message, kind=kind, ranks=everyone, differences=differences)
