"""Who makes a collective call, as matched across ranks: the calling thread's name.

Calls from several threads are serialized on each rank, and each call's caller is part of its
header (:mod:`ringcomm.comm.agree`): two threads whose calls pair up in a different order on
another rank raise ArgumentMismatchError on every rank instead of mixing their data.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["WITHIN", "ThreadNames", "caller", "calls_as"]


class _Caller(threading.local):
    name: str | None = None  # set by calls_as; a class default, so reading it never raises


_CALLER = _Caller()
#: How many threads are within ``calls_as`` now: while none is, no thread's ``_CALLER.name``
#: is set and the per-call path skips reading the thread-local (a few hundred nanoseconds).
#: A thread within it has counted itself before its calls, so it never reads 0 there.
WITHIN = 0
_WITHIN_LOCK = threading.Lock()


def caller() -> str:
    """Who makes the calls of this thread, as matched across ranks: the thread's name, or the
    name given by ``calls_as``.

    Calls from several threads are serialized on each rank, and each call's caller is part of
    its header: two threads whose calls pair up in a different order on another rank raise
    ArgumentMismatchError on every rank instead of mixing their data.
    """
    name = _CALLER.name
    return threading.current_thread().name if name is None else name


_MAX_OWNERS = 256  # remembered thread names before finished threads are dropped


class ThreadNames:
    """Which thread calls under each thread name on one communicator: one thread a name.

    Calls are matched across ranks by their caller's name, so two live threads of one name
    on one rank could pair with each other's calls on another rank and mix their data. Once
    a thread calls while another live thread of the process bears its name, every call of
    either is refused for as long as either lives (the error is raised on every rank, by the
    agreement): refusing only while both live would let whichever outlives the other pass
    afterwards, and the survivors of two ranks need not be the same logical thread. A thread
    of that name started after they have all ended calls again. Calls made under
    ``calls_as`` are exempt: its threads share one name by design and serialize their calls.

    The names looked at are those of every live thread of the process, whichever
    communicator they call on: two threads of one name on two communicators are refused too
    (the rule is "a name of its own among the process's live threads"), since a thread's
    first call cannot tell whether its twin will call here later.
    """

    __slots__ = ("_twins", "owners")

    def __init__(self) -> None:
        #: The thread that may call under each name (no live twin): Thread objects, not
        #: idents (the ident of a finished thread is given to new ones); finished ones are
        #: dropped as new names come (a pool of new threads each step must not grow this
        #: without bound). Twins are held weakly.
        self.owners: dict[str, threading.Thread] = {}
        self._twins: dict[str, weakref.WeakSet[threading.Thread]] = {}

    def owns(self, name: str) -> bool:
        """Whether the calling thread may call as ``name`` without a look at the others (the
        cheap check of every call)."""
        return _CALLER.name is not None or self.owners.get(name) is threading.current_thread()

    def caller(self) -> tuple[str, ValueError | None]:
        """This thread's caller (as :func:`caller` says) and, where another live thread bears
        its name, the error to raise on every rank: the per-call path's one look."""
        if WITHIN:
            name = _CALLER.name
            if name is not None:
                return name, None
        me = threading.current_thread()
        name = me.name
        if self.owners.get(name) is me:
            return name, None
        return name, self.conflict(name)

    def conflict(self, name: str) -> ValueError | None:
        """None where the calling thread may call as ``name`` (it is then remembered), or the
        error to raise on every rank."""
        if self.owns(name):
            return None
        me = threading.current_thread()
        live = {t for t in threading.enumerate() if t.name == name}
        twins = {t for t in self._twins.get(name, ()) if t.is_alive()}
        if me not in twins and len(live) <= 1:
            self._twins.pop(name, None)
            if len(self.owners) >= _MAX_OWNERS:
                self.owners = {n: t for n, t in self.owners.items() if t.is_alive()}
            self.owners[name] = me
            return None
        self._twins[name] = weakref.WeakSet(twins | live | {me})
        self.owners.pop(name, None)
        return ValueError(
            f"thread {name!r} made a collective call, but another thread of its process "
            "bears the same name and has been alive with it: calls are matched across ranks "
            "by thread name, so threads of one name could take each other's data. Give each "
            "thread that makes collective calls a name of its own, the same on every rank "
            "(threading.Thread(name=...))")


@contextmanager
def calls_as(name: str) -> Iterator[None]:
    """Make this thread's calls, within the block, as ``name`` (for a queue of collectives
    run by whichever thread is free: its calls keep one caller on every rank)."""
    global WITHIN
    before = _CALLER.name
    with _WITHIN_LOCK:
        WITHIN += 1
    _CALLER.name = name
    try:
        yield
    finally:
        _CALLER.name = before
        with _WITHIN_LOCK:
            WITHIN -= 1
