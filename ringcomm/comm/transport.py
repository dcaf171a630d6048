"""What every Transport implementation shares: rank, size, wire stats and scratch buffers.

Backends subclass :class:`TransportBase` and implement the rest of the
:class:`~ringcomm.core.types.Transport` protocol (point-to-point exchange, the few host
collectives, ``split``); the defaults here say "no native collective, every array kind taken".
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm import ops as _ops
from ringcomm.comm._mismatch import is_hook_caller
from ringcomm.comm.callers import caller
from ringcomm.core.types import (
    DEFAULT_INLINE_BYTES,
    DEFAULT_TIMEOUT_S,
    Array,
    CollectiveTimeoutError,
    CommStats,
    Exchange,
    InvalidArgumentError,
    InvalidTypeError,
    ReduceOp,
    Transport,
)

__all__ = ["FixedExchange", "TransportBase", "WholeExchange", "adopt_ranks", "agree_split",
           "check_split", "check_timeout", "split_members", "timeout_error", "write_fatal"]

_C_INT = range(-(1 << 31), 1 << 31)  # MPI and NCCL take split colors and keys as C ints


def check_timeout(timeout: Any) -> float:
    """``timeout`` in seconds: a ``datetime.timedelta`` or a number (``DEFAULT_TIMEOUT_S``
    when None). The one check of every timeout ringcomm takes, ``init``'s and the backends'.

    Raises:
        TypeError: neither a timedelta nor a number.
        ValueError: not a positive, finite time.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif (isinstance(timeout, (int, float, np.integer, np.floating))
          and not isinstance(timeout, (bool, np.bool_))):
        seconds = float(timeout)
    else:
        raise TypeError("timeout must be a datetime.timedelta or a number of seconds, "
                        f"got {type(timeout).__name__} {timeout!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be a positive, finite time, got {timeout!r}")
    return seconds


#: Where a communicator's timeout is set, as its timeout errors say, unless its transport
#: names another place (``timeout_source``: a torch.distributed group's, say).
TIMEOUT_SOURCE = "ringcomm.init(timeout=...) or RINGCOMM_TIMEOUT"


def timeout_error(t: Any, what: str, peer: int | None, elapsed: float,
                  timeout: float, *, kind: str | None = None) -> CollectiveTimeoutError:
    """The error of a wait of transport ``t`` that passed ``timeout``: the collective (``kind``,
    or ``t``'s ``operation`` when None), the step ``what``, the rank waited for where one is
    known, the time."""
    kind = kind or t.operation or what
    # Ranks as the whole job numbers them, also in a sub-group (the two-level allreduce's).
    ranks, world = t.world_ranks, t.world_size
    if peer is not None:
        peer = ranks[peer]
    waited = "the other ranks" if peer is None else f"rank {peer}"
    step = "" if what == kind else f" ({what})"
    within = "" if world == t.size else f" in its group of ranks {_listed(ranks)}"
    culprit = "a rank" if peer is None else f"rank {peer}"
    message = (f"{kind} timed out on rank {ranks[t.rank]} of {world}{within} after "
               f"{elapsed:.1f} s waiting for {waited}{step}: {culprit} may have exited, "
               f"stopped, or be in another call. The timeout is {timeout:g} s: change it with "
               f"{getattr(t, 'timeout_source', TIMEOUT_SOURCE)}{_in_a_hook()}")
    return CollectiveTimeoutError(message, kind=kind, peer=peer, elapsed=elapsed,
                                  timeout=timeout)


def _in_a_hook() -> str:
    """What a timeout inside a DDP hook's call adds: the likeliest "other call" there is
    another model's bucket, on a communicator of its own."""
    who = caller()
    if not is_hook_caller(who):
        return ""
    return (f". This call is the DDP hook's of a RingcommState ({who!r}): where several DDP "
            "models are hooked, each on a communicator of its own (RingcommState(comm=...) "
            "with communicators of their own), their backward passes must run in the same "
            "order on every rank; states on one communicator (as register_ddp_hook makes "
            "them) raise at once on a different order instead of waiting")


def _listed(ranks: Any) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}, ..., {ranks[-1]}"


def split_members(everyone: list[tuple[Any, ...]], color: int) -> list[int]:
    """The ranks passing ``color`` in ``agree_split``'s answer, ordered by (key, rank): the
    new group's ranks as its parent numbers them."""
    return [r for _, r in sorted((v[1], r) for r, v in enumerate(everyone) if v[0] == color)]


def adopt_ranks(child: Any, parent: Any, members: list[int]) -> Any:
    """Give the transport ``child``, split from ``parent`` over ``members`` (parent ranks,
    in the child's order), the job's numbering of its ranks, for its messages; return it."""
    child.world_ranks = tuple(parent.world_ranks[r] for r in members)
    child.world_size = parent.world_size
    child.timeout_source = parent.timeout_source
    return child


def write_fatal(error: Exception, action: str) -> None:
    """Say on stderr why the job is about to end (a log record may go nowhere: logging is
    silent unless the application or RINGCOMM_LOG_LEVEL turns it on)."""
    sys.stdout.flush()
    sys.stderr.write(f"ringcomm: {type(error).__name__}: {error}. {action}\n")
    sys.stderr.flush()


class WholeExchange:
    """The parts of an Exchange (:class:`~ringcomm.core.types.Exchange`) whose messages
    travel whole, in one call: ``start`` runs the whole exchange, and ``finish``, ``rest`` and
    ``drain`` have nothing left to do. Subclasses set ``send``, ``recv`` and ``whole_bytes``
    and implement ``__call__`` and ``moved``."""

    def __call__(self, nbytes: int) -> None:
        raise NotImplementedError

    def start(self, nbytes: int) -> None:
        """The whole exchange (it has no started state to hand back)."""
        self(nbytes)

    def finish(self, started: None) -> None:
        """Nothing left: ``start`` completed the exchange."""

    def rest(self, nbytes: int) -> None:
        """Nothing: messages travel whole."""

    def drain(self, lengths: list[int]) -> None:
        """Nothing: messages travel whole."""

    def fused_allreduce(self, nbytes: int, header: bytes, dtype: np.dtype, op: str) -> None:
        """None: no compiled call (the Python path runs every call)."""
        return None


class FixedExchange(WholeExchange):
    """The agreement's exchange as one prepared fixed-size allgather (``sized`` False): every
    rank sends its whole ``send`` buffer, whatever the length of its message, so that the
    collective's sizes match on every rank (see :class:`~ringcomm.core.types.Exchange`)."""

    sized = False

    def __init__(self, t: TransportBase, row_bytes: int) -> None:
        self.send = np.zeros(row_bytes, np.uint8)
        self.recv = np.zeros((t.size, row_bytes), np.uint8)
        self.whole_bytes = row_bytes
        self._allgather = t.prepare_allgather(self.send, self.recv)
        self._moved = row_bytes * (t.size - 1)

    def __call__(self, nbytes: int) -> None:
        self._allgather()

    def moved(self, nbytes: int) -> int:
        """The whole row to each other rank, whatever ``nbytes`` says."""
        return self._moved


class TransportBase:
    """Rank, size, host-local rank and size, stats and scratch buffers of a Transport;
    backends add the messaging.

    The optional capabilities of the Transport protocol have their defaults here, so that
    the Communicator and the algorithms read them without probing: a host-only backend with
    one transport for every array kind inherits them as they are.
    """

    backend: str = ""
    #: Seconds any wait for the other ranks may last (backends set their own).
    timeout: float = DEFAULT_TIMEOUT_S
    #: End the job on a timeout (True), or raise CollectiveTimeoutError (False).
    abort_on_timeout: bool = True
    #: Whether ``transport_for`` may answer another transport than this one.
    routes_arrays: bool = False
    #: Whether the library's own collectives of device arrays already follow the nodes
    #: (NCCL's rings and trees): the two-level allreduce then has nothing to add for them.
    follows_nodes_on_device: bool = False
    #: Whether device arrays travel as they are, or through host memory (a host-only backend).
    moves_device_arrays: bool = False
    #: Whether ``start_native_allreduce`` starts the library's own allreduce of host and
    #: device arrays as they are (gloo's, which copies CUDA tensors through pinned host
    #: memory on streams and threads of its own).
    starts_native_allreduce: bool = False
    #: Segments the ring cuts a chunk of device arrays into at most; None: the ring's own
    #: ``DEVICE_SEGMENTS``. A class attribute of the backend, so the same on every rank.
    device_segments: int | None = None

    def __init__(self, rank: int, size: int, *, local_rank: int | None = None,
                 local_size: int | None = None) -> None:
        self.rank = int(rank)
        self.size = int(size)
        # Without word from the backend, every rank counts as on this host.
        self.local_rank = self.rank if local_rank is None else int(local_rank)
        self.local_size = self.size if local_size is None else int(local_size)
        self.stats = CommStats()
        self.operation = ""
        #: Each rank as the whole job numbers it (a sub-group's differ from its own ranks).
        self.world_ranks: tuple[int, ...] = tuple(range(self.size))
        self.world_size = self.size
        #: Where the user sets this transport's timeout, as its timeout errors say.
        self.timeout_source = TIMEOUT_SOURCE
        self._buffers: dict[tuple[Any, ...], Any] = {}

    @property
    def default_inline_bytes(self) -> int:
        """The largest dense allreduce that rides in the agreement's exchange where the user
        sets none (``inline_bytes``): DEFAULT_INLINE_BYTES; the same on every rank."""
        return DEFAULT_INLINE_BYTES

    #: Allgather equal-sized host byte buffers: every backend implements it.
    allgather_fixed: Callable[[np.ndarray, np.ndarray], None]

    _failure: Exception | None = None
    _on_failure: tuple[Callable[[], None], ...] = ()

    @property
    def failure(self) -> Exception | None:
        """The error that aborted this transport, after which it refuses every call; None."""
        return self._failure

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when this transport fails (``fail``): a communicator drops what
        it prepared, so that its next call sees the failure and refuses."""
        self._on_failure = (*self._on_failure, callback)

    def fail(self, error: Exception) -> None:
        """Mark this transport failed with ``error`` (a wait that timed out left its requests
        posted, and they would match a later call's messages): every later call is refused.
        The first error is kept."""
        if self._failure is None:
            self._failure = error
        for callback in self._on_failure:
            callback()

    @property
    def device_id(self) -> int | None:
        """The CUDA device of this transport's device work; None without one (or before one
        was chosen)."""
        return None

    def scratch(self, key: str, like: Array, n: int, dtype: Any) -> Array:
        """A reusable buffer of ``n`` elements on ``like``'s device, kept between calls.

        Collectives reuse their staging buffers instead of allocating (and page-faulting) new
        ones every call. Two live buffers need two keys.
        """
        xp = _ops.get(like)
        device = getattr(getattr(like, "device", None), "id", None)  # CuPy arrays: the GPU
        k = (key, xp.__name__, device, np.dtype(dtype).str)
        buf = self._buffers.get(k)
        if buf is None or buf.size < n:
            buf = self._buffers[k] = xp.empty((max(n, 1),), dtype)
        return buf[:n]

    def release_scratch(self) -> None:
        """Drop every scratch buffer (they are made again on demand)."""
        self._buffers.clear()

    def native_volume(self, nbytes: int) -> int:
        """The bytes a native allreduce of ``nbytes`` counts each way: what the ring would
        move, 2 (n - 1) / n of the array."""
        return 2 * (self.size - 1) * nbytes // self.size

    def count_native(self, nbytes: int) -> None:
        """Count a native allreduce of ``nbytes`` in ``stats`` (see ``native_volume``)."""
        moved = self.native_volume(nbytes)
        self.stats.add(moved, moved)

    def check_arrays(self, *arrays: Array) -> None:
        """Accept every array kind (NumPy and CuPy); backends that cannot, override."""
        return None

    def transport_for(self, x: Array) -> Any:
        """The transport that moves arrays like ``x``: this one (a backend with a separate
        host transport overrides it, and sets ``routes_arrays``)."""
        return self

    def device_scope(self) -> Any:
        """A context making this transport's CUDA device current: none to make here."""
        return contextlib.nullcontext()

    def wait_gpu(self, what: str) -> None:
        """Wait, within the timeout, for the device work queued so far: none here."""
        return None

    def prepare_allgather(self, send: np.ndarray, recv: np.ndarray) -> Callable[[], None]:
        """``allgather_fixed`` of these buffers, called as it is (no persistent form here)."""
        return functools.partial(self.allgather_fixed, send, recv)

    def prepare_exchange(self, row_bytes: int) -> Exchange:
        """The agreement's exchange as a prepared fixed-size allgather of ``row_bytes`` per
        rank: every call moves the whole row, whatever its message's length."""
        return FixedExchange(self, row_bytes)

    def native_allreduce(self, x: Array, out: Array, op: ReduceOp) -> bool:
        """No native allreduce: the ring runs."""
        return False

    def prepare_native_allreduce(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                                 ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """No native allreduce to prepare."""
        return None

    def takes_native_start(self, x: Array, op: ReduceOp) -> bool:
        """No allreduce that runs on threads of the backend's own: False."""
        return False

    def finished_allreduce(self, x: Array) -> Any:
        """Never asked for: ``takes_native_start`` is False."""
        raise NotImplementedError(f"{type(self).__name__} starts no allreduce of its own")

    def start_native_allreduce(self, x: Array, op: ReduceOp) -> Any | None:
        """No allreduce that runs on threads of the backend's own: None (the caller runs the
        call to the end itself)."""
        return None

    def native_reduce_scatter(self, x: Array, op: ReduceOp) -> Array | None:
        """No native reduce-scatter: the ring runs."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


def check_split(color: Any, key: Any) -> tuple[int, int]:
    """Validate the arguments of ``split``: a color in [0, 2**31), an integer key that fits a
    C int (what MPI_Comm_split and ncclCommSplit take).

    Raises:
        TypeError: color or key is not an integer.
        ValueError: color is negative, or color or key does not fit a C int.
    """
    for label, v in (("color", color), ("key", key)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"split {label} must be an integer, got {type(v).__name__}")
    if color < 0:
        raise ValueError(f"split color must be >= 0, got {color}")
    if color not in _C_INT or key not in _C_INT:
        raise ValueError(f"split color and key must fit a 32-bit int, got {color}, {key}")
    return int(color), int(key)


def agree_split(t: Transport, color: Any, key: Any,
                extra: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Check ``split``'s arguments on every rank of ``t`` before any rank splits (collective).

    A split is collective: a rank that refused its arguments alone would leave the others
    waiting in the library's split forever. Every rank's check travels in one exchange, and
    all raise the same error when any rank's arguments are invalid.

    Args:
        t: the transport being split.
        color, key: this rank's arguments.
        extra: more of this rank's facts to gather in the same exchange (host name, ...).

    Returns:
        Every rank's (color, key, *extra), in rank order.

    Raises:
        InvalidArgumentError, InvalidTypeError: some rank passed invalid arguments (on every
            rank, naming the first failing rank's reason).
    """
    try:
        mine: tuple[Any, ...] = (*check_split(color, key), *extra)
    except (TypeError, ValueError) as err:
        mine = ("TypeError" if isinstance(err, TypeError) else "ValueError", str(err))
    everyone = t.allgather_object(mine)
    failed = [r for r, v in enumerate(everyone) if isinstance(v[0], str)]
    if failed:
        etype, reason = everyone[failed[0]]
        cls = InvalidTypeError if etype == "TypeError" else InvalidArgumentError
        where = ("rank " if len(failed) == 1 else "ranks ") + ", ".join(map(str, failed))
        raise cls(f"split failed on {where}: {reason}", kind="split", ranks=tuple(failed),
                  reason=reason)
    return everyone
