"""The control messages of negotiation cycles: a fixed-size header, and a response cache.

Every cycle, every rank tells every other which operations it submitted since its last cycle
(see :mod:`ringcomm.torch.horovod._negotiate`). A request is ``(name, kind, user_name, meta,
fusable)``; training steps submit the same requests step after step, so, as in Horovod's
response cache, a request that every rank once submitted identically and that a cycle found
ready is kept under a small number (its *slot*), the same on every rank, and travels as that
number.

The message is one fixed-size allgather of int64 words per rank (no pickling):

    flags | clock (ns) | request count | cache capacity | cache generation | entries...

An entry is a slot (>= 0), or -1 for a request sent whole. Requests sent whole (first
submissions, changed fields, automatic names, too many for the header) go in a second,
pickled allgather that runs only in cycles where some rank has such a request. Decoding gives
every rank exactly the requests each rank submitted, in its submission order, so what the
cycle decides does not depend on how the requests travelled.

Every rank changes its cache in the same way at the same point (when a cycle decides an
operation), so the caches stay equal; each header carries the cache's capacity and
generation, and ranks whose caches differ all fail alike rather than decode differently.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, NoReturn

import numpy as np

from ringcomm.core.digest import fingerprint

__all__ = ["DEFAULT_CACHE_CAPACITY", "ControlChannel", "Message", "Request", "ResponseCache",
           "cache_capacity"]

#: What a rank says about one operation: name, kind, user's name, fields to agree, fusable.
Request = tuple[str, str, str, dict[str, Any], bool]
#: What a cycle's exchange hands back per rank: its requests, whether it shuts down, its clock.
Message = tuple[list[Request], bool, float]

#: Requests kept in the response cache (HOROVOD_CACHE_CAPACITY; 0 turns it off), as Horovod.
DEFAULT_CACHE_CAPACITY = 1024
_STOP, _WHOLE = 1, 2  # flag bits
_FLAGS, _CLOCK, _COUNT, _CAPACITY, _GENERATION = range(5)
_HEADER = 5
#: Words per rank and cycle: room for this many entries minus the header. 1 KiB: at 2 ranks
#: an allgather of 1 KiB costs what one of 8 bytes does (measured, ~2.3 us).
_WORDS = 128
_ROOM = _WORDS - _HEADER  # entries in the header
_UNNAMED = ".noname."


def cache_capacity() -> int:
    """HOROVOD_CACHE_CAPACITY, or the default.

    Raises:
        ValueError: not an integer >= 0.
    """
    raw = os.environ.get("HOROVOD_CACHE_CAPACITY", "")
    try:
        value = int(raw) if raw else DEFAULT_CACHE_CAPACITY
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"HOROVOD_CACHE_CAPACITY must be an integer >= 0, got {raw!r}")
    return value


class ResponseCache:
    """Requests every rank submitted identically, each under a slot number (the same on every
    rank, since every rank makes the same calls to :meth:`learn` in the same order).

    Args:
        capacity: slots at most; the least recently decided request gives its slot up.
    """

    __slots__ = ("_by_name", "_recent", "_slots", "capacity", "generation")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: A checksum of the changes of slots so far: equal on every rank, unless the caches
        #: went apart.
        self.generation = 0
        self._slots: list[Request] = []
        self._by_name: dict[str, int] = {}
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_name)

    def slot_of(self, request: Request) -> int:
        """The slot holding exactly ``request``, else -1 (then it travels whole)."""
        slot = self._by_name.get(request[0], -1)
        if slot >= 0:
            kept = self._slots[slot]
            # The fields, not just the name: a reused name with another shape goes whole.
            if not (kept[1:3] == request[1:3] and kept[4] == request[4]
                    and (kept[3] is request[3] or kept[3] == request[3])):
                return -1
        return slot

    def request(self, slot: int) -> Request:
        """The request under ``slot``.

        Raises:
            RuntimeError: no such slot (the caches of the ranks went apart).
        """
        if not 0 <= slot < len(self._slots):
            raise RuntimeError(f"ringcomm.torch's response cache has no slot {slot}")
        return self._slots[slot]

    def learn(self, request: Request) -> None:
        """Keep ``request``, which every rank submitted identically and a cycle decided to
        run (call it on every rank, in the order of the decisions)."""
        if self.capacity == 0 or _UNNAMED in request[0]:
            return  # automatic names are never submitted twice: they would only evict
        name = request[0]
        slot = self._by_name.get(name, -1)
        if slot >= 0:
            if self._slots[slot] != request:  # the name came back with other fields
                self._keep(slot, request)
            self._recent.move_to_end(slot)
            return
        if len(self._slots) < self.capacity:
            slot = len(self._slots)
            self._slots.append(request)
        else:
            slot, _ = self._recent.popitem(last=False)
            del self._by_name[self._slots[slot][0]]
        self._keep(slot, request)
        self._by_name[name] = slot
        self._recent[slot] = None

    def _keep(self, slot: int, request: Request) -> None:
        self._slots[slot] = request
        # A checksum of every change, not a count: caches that evicted different slots differ.
        self.generation = fingerprint((self.generation, slot, request[0]))


class ControlChannel:
    """A cycle's exchange of requests over the control transport (see the module docstring).

    Args:
        control: the transport (``allgather_fixed`` and ``allgather_object``).
        size: its number of ranks.
        cache: the response cache (the same on every rank).
    """

    __slots__ = ("_control", "_heads", "_recv", "_recv_bytes", "_rows", "_send", "_send_bytes",
                 "cache", "size")

    def __init__(self, control: Any, size: int, cache: ResponseCache) -> None:
        self._control, self.size, self.cache = control, size, cache
        self._send = np.zeros(_WORDS, np.int64)
        self._recv = np.zeros(size * _WORDS, np.int64)
        self._send_bytes, self._recv_bytes = self._send.view(np.uint8), self._recv.view(np.uint8)
        self._rows = self._recv.reshape(size, _WORDS)
        self._heads = self._rows[:, :_HEADER]

    def exchange(self, requests: list[Request], stop: bool) -> list[Message]:
        """Send this rank's new ``requests``; return every rank's message, in rank order.

        Raises:
            CollectiveTimeoutError: no other rank joined the cycle within the timeout.
            RuntimeError: the ranks' caches differ (every rank raises it).
        """
        whole = self._encode(requests, stop)
        self._control.allgather_fixed(self._send_bytes, self._recv_bytes)
        heads = self._heads.tolist()  # Python ints: one NumPy call, not one per word
        first, longest, any_whole = heads[0], 0, False
        for h in heads:
            if h[_CAPACITY] != first[_CAPACITY] or h[_GENERATION] != first[_GENERATION]:
                self._caches_differ(heads)
            any_whole = any_whole or bool(h[_FLAGS] & _WHOLE)
            longest = max(longest, h[_COUNT])
        wholes = self._control.allgather_object(whole) if any_whole else None
        entries = self._rows[:, _HEADER:_HEADER + min(longest, _ROOM)].tolist()
        clock = first[_CLOCK] / 1e9
        return [(self._decode(h[_COUNT], entries[r], wholes[r] if wholes else ()),
                 bool(h[_FLAGS] & _STOP), clock) for r, h in enumerate(heads)]

    def _encode(self, requests: list[Request], stop: bool) -> list[Any]:
        """Fill the header; return what travels whole: requests not cached, in order, then
        the entries that did not fit (slots or requests)."""
        cache = self.cache
        slots = [cache.slot_of(r) for r in requests]
        whole: list[Any] = []
        if len(slots) > _ROOM or -1 in slots:
            whole = [r for r, s in zip(requests[:_ROOM], slots, strict=False) if s < 0]
            whole += [r if s < 0 else s
                      for r, s in zip(requests[_ROOM:], slots[_ROOM:], strict=True)]
            slots = slots[:_ROOM]
        flags = (_STOP if stop else 0) | (_WHOLE if whole else 0)
        self._send[:_HEADER + len(slots)] = [flags, time.monotonic_ns(), len(requests),
                                             cache.capacity, cache.generation, *slots]
        return whole

    def _decode(self, count: int, shown: list[int], whole: Any) -> list[Request]:
        """One rank's requests: ``shown`` holds its header's entries (slots, or -1 for the
        next of ``whole``), then ``whole`` what did not fit."""
        if count == 0:
            return []
        request, rest = self.cache.request, iter(whole)
        out = [request(s) if s >= 0 else next(rest) for s in shown[:count]]
        if count > _ROOM:
            out += [request(e) if isinstance(e, int) else e for e in rest]
        return out

    @staticmethod
    def _caches_differ(heads: list[list[int]]) -> NoReturn:
        capacities = [h[_CAPACITY] for h in heads]
        if capacities.count(capacities[0]) != len(capacities):
            raise RuntimeError(f"HOROVOD_CACHE_CAPACITY differs between ranks ({capacities}); "
                               "set the same value on every rank")
        # A bug, never a user's error: decoding with unequal caches could mix operations.
        raise RuntimeError(f"ringcomm.torch's response caches differ between ranks "
                           f"(generations {[h[_GENERATION] for h in heads]})")
