"""Repeated dense host allreduces, prepared so that a repeat does only what must be done again.

A training step reduces the same small and medium tensors every time. The first call is
checked in full (:mod:`ringcomm.comm._allreduce`); its repeats run a prepared call that holds
the call's header and views of the agreement's buffers, so a repeat costs the header exchange
(the transport's prepared exchange, compared against the other ranks' headers), the data's
movement and nothing else. Two kinds:

- :class:`~ringcomm.comm._inline.InlinePlan`: arrays of at most ``inline_bytes`` ride in the
  header exchange itself;
- :class:`NativePlan`: larger ones up to the transport's native limit (MPI's own allreduce,
  ``RINGCOMM_MPI_ALLREDUCE_BYTES``) run the transport's prepared allreduce after the header
  exchange, skipping the per-call planning, routing and checks of the general path.

A repeat with other arguments on another rank still fails the header comparison and raises the
full error on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.comm.agree import HEADER_BYTES, Agreement, CallSpec
from ringcomm.core.types import ReduceOp, Transport

__all__ = ["NativePlan", "PreparedCall"]


class PreparedCall:
    """The header half of a prepared call: its header, and views of the exchange buffers.

    Args:
        agreement: the communicator's agreement (its exchange and buffers).
        spec: the call's checked spec, as the full path agreed on it the first time.
        inline: an array like those that ride in the exchange with the header (None: none).
    """

    __slots__ = ("agreement", "buffers", "chunked", "data", "finish", "header", "heads",
                 "message", "send", "spec", "start", "stats", "threads", "view", "volume")

    def __init__(self, agreement: Agreement, spec: CallSpec,
                 inline: np.ndarray | None = None) -> None:
        self.agreement, self.spec = agreement, spec
        self.threads = agreement.threads
        t = agreement.transport
        self.stats = t.stats
        self.header = spec.header(agreement.segment_bytes)
        self.buffers = agreement.exchange_buffers()
        self.send = self.buffers.exchange
        self.view = self.buffers.view
        self.start, self.finish = self.send.start, self.send.finish
        #: This rank's message: the header, and the array where it rides along.
        self.message = HEADER_BYTES + (0 if inline is None else inline.nbytes)
        self.volume = self.send.moved(self.message)
        #: Whether the exchange may send this message in chunks (``Exchange.rest`` follows).
        self.chunked = self.message > self.send.whole_bytes
        # Views made once, as each costs a few hundred ns on a path of a few microseconds:
        # the other ranks' received headers (this rank's is the one it sent), compared as
        # bytes (``tobytes``: a memoryview compared with bytes goes byte by byte, 4x slower).
        recv = self.buffers.recv
        received = recv.data.cast("B")
        self.heads = [received[r * recv.shape[1]: r * recv.shape[1] + HEADER_BYTES]
                      for r in range(t.size) if r != t.rank]
        #: Where an array riding in the exchange goes: a view of its dtype and shape.
        self.data = None if inline is None or not inline.nbytes else (
            self.buffers.send[HEADER_BYTES:self.message].view(inline.dtype)
            .reshape(inline.shape))

    def exchange(self, x: np.ndarray) -> None:
        """Exchange the call's header (and ``x``'s bytes, where this plan inlines them),
        raising on every rank if another rank's header differs.

        The call's byte counts are kept while the messages travel (between the exchange's
        ``start`` and ``finish``): a call after the ranks part (a barrier, compute) costs the
        work before its messages leave and after they arrive, not the wait between."""
        name, twins = self.threads.caller()
        if name != self.spec.caller:  # another thread repeats the call: its own header
            self.spec.caller = name
            self.header = self.spec.header(self.agreement.segment_bytes)
        if twins is not None:  # raised on every rank
            self.agreement.exchange(self.spec.with_error(twins))
        self.view[:HEADER_BYTES] = self.header
        if self.data is not None:
            self.data[...] = x
        started = self.start(self.message)
        stats = self.stats
        stats.bytes_sent += self.volume
        stats.bytes_received += self.volume
        self.finish(started)
        header = self.header
        for head in self.heads:
            if head.tobytes() != header:
                self.agreement.verify(self.spec, np.ascontiguousarray(
                    self.buffers.recv[:, :HEADER_BYTES]).view(np.int64), self.message)
                break
        if self.chunked:  # every header equals this one: every message is as long
            self.send.rest(self.message)


class NativePlan(PreparedCall):
    """A dense host allreduce above ``inline_bytes`` that the transport's own allreduce runs
    (MPI's, up to ``RINGCOMM_MPI_ALLREDUCE_BYTES``), prepared for its repeats: the header
    exchange, then the prepared allreduce straight from ``x`` into the result.

    Made only where the general path would run that same allreduce: a flat call (the
    two-level allreduce cannot be chosen for it) that the transport reduces natively.
    """

    __slots__ = ("check", "dtype", "native", "shape")

    def __init__(self, agreement: Agreement, spec: CallSpec, x: np.ndarray,
                 native: Callable[[np.ndarray, np.ndarray], None]) -> None:
        super().__init__(agreement, spec)
        self.check = agreement.check
        self.shape, self.dtype = x.shape, x.dtype
        self.native = native

    @staticmethod
    def prepare(agreement: Agreement, t: Transport, spec: CallSpec, x: np.ndarray,
                op: ReduceOp) -> NativePlan | None:
        """A NativePlan for repeats of ``x``'s call over ``t``, or None where the transport
        has no native allreduce for it (dtype, size) or the array is not plain contiguous."""
        if not (type(x) is np.ndarray and x.flags.c_contiguous and x.flags.aligned
                and x.nbytes > agreement.inline_bytes):
            return None
        native = t.prepare_native_allreduce(x.dtype, x.nbytes, op)
        return None if native is None else NativePlan(agreement, spec, x, native)

    def run(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        """Run a repeat: the result, or None (nothing done) where the arrays cannot go to
        the transport as they are (strided or unaligned: the full path runs the call)."""
        flags = x.flags
        if not (flags.c_contiguous and flags.aligned
                and (out is None or fitting_out(x, flags, out, aligned=True))):
            return None
        if self.check:
            self.exchange(x)
        result = np.empty(self.shape, self.dtype) if out is None else out
        self.native(x, result)
        return result


def fitting_out(x: np.ndarray, flags: Any, out: Any, aligned: bool = False,
                contiguous: bool = True) -> bool:
    """Whether ``out`` can take the result of a plan of ``x``'s call as it is: a plain
    writable array of ``x``'s shape and dtype, C-contiguous (where asked) and aligned (where
    asked), ``x`` itself or apart from it (``flags``: ``x.flags``, read once by the caller).
    Two arrays that each own their data are two allocations: told apart without
    ``may_share_memory``'s bounds check."""
    if type(out) is not np.ndarray or out.shape != x.shape or not (
            out.dtype is x.dtype or out.dtype == x.dtype):
        return False
    own = out.flags
    return (own.writeable and (own.c_contiguous or not contiguous)
            and (own.aligned or not aligned)
            and (out is x or (flags.owndata and own.owndata)
                 or not np.may_share_memory(x, out)))
