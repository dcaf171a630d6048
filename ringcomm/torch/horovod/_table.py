"""The table of pending operations: what a negotiation cycle decides, alike on every rank.

Every rank feeds the same messages (every rank's new requests, see
:mod:`ringcomm.torch.horovod._control`) into its table in the same order, so every rank decides the
same: which operations are ready (submitted by every rank, or by every rank that has not
joined), which fail (fields that differ, a kind that cannot run with joined ranks, a stall),
in which order they run, and which allreduces run fused. Nothing here talks to other ranks
or runs anything (see :mod:`ringcomm.torch.horovod._negotiate`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ringcomm.comm._mismatch import ranks_text
from ringcomm.core.log import get_logger
from ringcomm.torch._errors import (
    HorovodArgumentError,
    HorovodInternalError,
    StalledOperationError,
    differs,
)
from ringcomm.torch.horovod._control import Message, Request, ResponseCache

__all__ = ["Entry", "Outcome", "PendingTable", "meta_dtype"]

_LOG = get_logger("torch.negotiate")
_MEMO_LIMIT = 4096  # fusion keys remembered before the memo starts over


@dataclasses.dataclass(slots=True)
class Entry:
    """A pending operation as every rank knows it (the same on every rank)."""

    name: str
    kind: str
    user_name: str
    metas: dict[int, dict[str, Any]]
    fusable: dict[int, bool]
    arrival: tuple[int, int, int]  # (cycle, rank, position): the agreed order
    # Rank 0's clock at the start of the first cycle after the one that brought it: every
    # rank sent its message of that cycle (and so had submitted it) before that moment, so a
    # stall counted from it is never shorter than the limit on any rank's own clock. None
    # during the cycle that brought it.
    first_seen: float | None
    request: Request  # the first rank's request
    uniform: bool = True  # every rank's request so far equals ``request``
    warned: bool = False


@dataclasses.dataclass(slots=True)
class Outcome:
    """What a cycle decided for one entry: run it, or fail it with ``error``; ``mine`` is
    what this rank submitted for it (None where it joined instead), set before it runs."""

    entry: Entry
    error: Exception | None = None
    mine: Any = None


class PendingTable:
    """The operations some ranks submitted and that have not run yet.

    Args:
        size: the number of ranks.
        rank: this rank (only rank 0 logs stall warnings).
        cache: the response cache, taught what every rank submitted alike.
        stall_limit: seconds after which an operation pending on some ranks only fails.
        stall_warning: seconds after which such an operation is logged (rank 0).
    """

    def __init__(self, size: int, rank: int, cache: ResponseCache, *, stall_limit: float,
                 stall_warning: float) -> None:
        self.size, self.rank, self.cache = size, rank, cache
        self.stall_limit, self.stall_warning = stall_limit, stall_warning
        #: The rank that joined last, as the last decided join found it.
        self.last_joined = -1
        self._entries: dict[str, Entry] = {}
        self._joined_cycle: dict[int, int] = {}
        self._memo: dict[int, tuple[dict[str, Any], int, int]] = {}
        self._keys: dict[tuple[Any, ...], int] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def clear(self) -> None:
        """Forget every pending operation (shutdown)."""
        self._entries.clear()

    def absorb(self, everyone: list[Message], cycle: int) -> list[Outcome]:
        """Add every rank's new requests of cycle ``cycle``; return what is decided now, in
        the order it runs."""
        now0 = everyone[0][2]
        table = self._entries
        for older in table.values():
            if older.first_seen is None:
                older.first_seen = now0
        for r, (requests, _, _) in enumerate(everyone):
            for pos, request in enumerate(requests):
                name, kind = request[0], request[1]
                entry = table.get(name)
                if entry is None:
                    table[name] = Entry(name, kind, request[2], {r: request[3]},
                                        {r: request[4]}, (cycle, r, pos), None, request)
                else:
                    if entry.uniform and request is not entry.request:
                        entry.uniform = request == entry.request
                    entry.metas[r] = request[3]
                    entry.fusable[r] = request[4]
                if kind == "join":
                    self._joined_cycle[r] = cycle
        joined = set(table["join"].metas) if "join" in table else set()
        crossed = self._crossed() if len(table) > 1 else {}
        outcomes = []
        pending = table.values() if len(table) == 1 else sorted(table.values(),
                                                                 key=_arrival)
        for entry in pending:
            error = crossed.get(entry.name)
            outcome = (Outcome(entry, error) if error is not None
                       else self._decide(entry, joined, now0))
            if outcome is not None:
                outcomes.append(outcome)
                if outcome.error is None and entry.uniform and len(entry.metas) == self.size:
                    self.cache.learn(entry.request)
        for o in outcomes:
            del table[o.entry.name]
        return outcomes

    def _decide(self, entry: Entry, joined: set[int], now0: float) -> Outcome | None:
        if len(entry.metas) == self.size:
            if entry.kind == "join":
                last = self._joined_cycle
                self.last_joined = max(last, key=lambda r: (last[r], r))
                self._joined_cycle.clear()
            return Outcome(entry, self._mismatch(entry))
        have = set(entry.metas)
        if entry.kind != "join" and joined and len(have | joined) == self.size:
            if entry.kind in _WITH_JOINED:
                return Outcome(entry, self._mismatch(entry))
            return Outcome(entry, HorovodInternalError(
                f"{entry.kind} {entry.user_name!r}: {ranks_text(sorted(joined))} joined "
                "(hvd.join) before submitting it; only allreduces (grouped ones included) run "
                "with joined ranks"))
        waited = 0.0 if entry.first_seen is None else now0 - entry.first_seen
        missing = sorted(set(range(self.size)) - have - joined)
        if waited > self.stall_limit:
            return Outcome(entry, StalledOperationError(
                f"{entry.kind} {entry.user_name!r} was submitted by {ranks_text(sorted(have))} "
                f"but not by {ranks_text(missing)} within {self.stall_limit:g} s; every rank "
                f"must submit every operation (with the same name){_bucket_hint(entry)}"))
        if waited > self.stall_warning and not entry.warned:
            entry.warned = True
            if self.rank == 0:
                _LOG.warning("%s %r has waited %.0f s for %s (submitted by %s); an operation "
                             "submitted by some ranks only stalls the job%s", entry.kind,
                             entry.user_name, waited, ranks_text(missing),
                             ranks_text(sorted(have)), _bucket_hint(entry))
        return None

    def _crossed(self) -> dict[str, Exception]:
        """The operations of one name and different kinds that split the ranks between them
        (an allreduce named "a" on some ranks, an allgather named "a" on the others): each
        would wait for the ranks that submitted the other until the stall limit, where
        Horovod, which matches operations by name alone, fails them at once. Failed here on
        every rank, by entry name, with the kinds and ranks."""
        by_name: dict[str, list[Entry]] = {}
        for entry in self._entries.values():
            if entry.kind not in ("join", "barrier") and len(entry.metas) < self.size:
                by_name.setdefault(entry.user_name, []).append(entry)
        failed: dict[str, Exception] = {}
        for user_name, entries in by_name.items():
            if len(entries) < 2 or len({e.kind for e in entries}) < 2:
                continue
            ranks = [r for e in entries for r in e.metas]
            if len(ranks) != self.size or len(set(ranks)) != self.size:
                continue  # not every rank has submitted one of them, or some both
            parts = "; ".join(f"{e.kind} on {ranks_text(sorted(e.metas))}"
                              for e in sorted(entries, key=_arrival))
            error = HorovodInternalError(
                f"operation {user_name!r} differs between ranks: {parts}; operations are "
                "matched by name: every rank must submit the same operation under a name")
            failed.update((e.name, error) for e in entries)
        return failed

    @staticmethod
    def _mismatch(entry: Entry) -> Exception | None:
        invalid = {r: m["error"] for r, m in entry.metas.items() if "error" in m}
        if invalid:  # arguments a rank refused: the operation runs nowhere
            ranks = sorted(invalid)
            return HorovodArgumentError(
                f"{entry.kind} {entry.user_name!r}: invalid arguments on "
                f"{ranks_text(ranks)}: {invalid[ranks[0]]}")
        if entry.uniform:  # every rank sent the same request: nothing can differ
            return None
        metas = list(entry.metas.values())
        if all(m == metas[0] for m in metas[1:]):
            return None
        ranks = sorted(entry.metas)
        fields = sorted({f for m in metas for f in m}, key=str)
        parts = [d for f in fields
                 if (d := differs(f, [entry.metas[r].get(f) for r in ranks], ranks))]
        return HorovodInternalError(f"{entry.kind} {entry.user_name!r}: " + "; ".join(parts))

    # ----------------------------------------------------------------------- fusion
    def groups(self, outcomes: list[Outcome], threshold: int) -> list[list[Outcome]]:
        """Cut the decided entries into what runs together (the same on every rank): fusable
        allreduces whose fields other than the shape are equal, up to ``threshold`` bytes."""
        if len(outcomes) == 1:
            return [outcomes]
        if len(self._memo) >= _MEMO_LIMIT or len(self._keys) >= _MEMO_LIMIT:
            # Between calls only: within one, equal numbers must mean equal fields.
            self._memo.clear()
            self._keys.clear()
        groups: list[list[Outcome]] = []
        open_groups: dict[int, tuple[list[Outcome], int]] = {}
        for o in outcomes:
            key, nbytes = self._fusion(o)
            if key is None:
                groups.append([o])
                continue
            group, total = open_groups.get(key, (None, 0))
            if group is not None and total + nbytes <= threshold:
                group.append(o)
                open_groups[key] = (group, total + nbytes)
            else:
                group = [o]
                groups.append(group)
                open_groups[key] = (group, nbytes)
        return groups

    def _fusion(self, o: Outcome) -> tuple[int | None, int]:
        """The fusion key (None: it runs alone) and size of a decided entry; equal keys are
        equal fields other than the shape."""
        entry = o.entry
        if o.error is not None or entry.kind != "allreduce":
            return None, 0
        if entry.uniform:  # every rank sent ``request``: its flag and fields are everyone's
            if not entry.request[4]:
                return None, 0
            meta = entry.request[3]
        elif all(entry.fusable.values()):
            meta = next(iter(entry.metas.values()))
        else:
            return None, 0
        # Remembered per fields object: a cached request brings the same one every step.
        known = self._memo.get(id(meta))
        if known is not None and known[0] is meta:
            return known[1], known[2]
        fields = tuple((k, v) for k, v in sorted(meta.items()) if k != "shape")
        key = self._keys.setdefault(fields, len(self._keys))  # a small int hashes faster
        nbytes = _nbytes(meta)
        self._memo[id(meta)] = (meta, key, nbytes)
        return key, nbytes


#: The kinds that run with ranks that have joined (which take part with zeros), as in Horovod,
#: whose controller refuses the others there.
_WITH_JOINED = ("allreduce", "grouped_allreduce")


def _arrival(entry: Entry) -> tuple[int, int, int]:
    return entry.arrival


def meta_dtype(name: str) -> torch.dtype:
    """The torch dtype a ``meta`` names ("torch.float32")."""
    return getattr(torch, name.removeprefix("torch."))


def _nbytes(meta: dict[str, Any]) -> int:
    shape = meta.get("shape", ())
    return math.prod(shape) * meta_dtype(meta["dtype"]).itemsize if "dtype" in meta else 0


def _bucket_hint(entry: Entry) -> str:
    """Where a stalled allreduce is a DistributedOptimizer bucket, what makes the ranks'
    buckets differ."""
    if entry.kind != "allreduce" or not any(m.get("bucket") for m in entry.metas.values()):
        return ""
    return ("; it is a DistributedOptimizer bucket, and the ranks cut different ones where "
            "their parameters' names, which of them require a gradient, "
            "fusion_threshold_bytes or the compression differ, or where a gradient is sparse "
            "on some ranks and missing on others (an embedding used by some ranks only: "
            "sparse_as_dense=True reduces it as the others' zeros)")
