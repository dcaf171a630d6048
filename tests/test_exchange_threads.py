"""The agreement's per-call exchange, sized (each rank sends its own length) and fixed (one
allgather of the whole slot), over the threads backend: ranks whose calls differ in length,
kind or inlining still raise the same error on every rank, and no call reads another's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from thread_helpers import identical

from ringcomm.backends.threads import ThreadTransport, run_ranks
from ringcomm.comm.base import Communicator
from ringcomm.comm.transport import FixedExchange, TransportBase
from ringcomm.core.types import ArgumentMismatchError


class FixedThreadTransport(ThreadTransport):
    """The threads backend with the default, fixed-size exchange (gloo's and NCCL's kind)."""

    def prepare_exchange(self, row_bytes: int) -> FixedExchange:
        return TransportBase.prepare_exchange(self, row_bytes)


def _transport(kind):
    if kind == "sized":
        return lambda t: t
    return lambda t: FixedThreadTransport(t.world, t.rank)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_sized_exchange_rows_hold_each_ranks_own_length(n):
    """Row r holds rank r's message in its first bytes; the rest of the row keeps what an
    earlier, longer message left there (only as much as each rank sent is ever read)."""

    def body(t):
        ex = t.prepare_exchange(64)
        assert ex.sized and ex.send.nbytes == 64 and ex.recv.shape == (n, 64)
        seen = []
        for step, lengths in enumerate([[64] * n, [1 + 7 * r for r in range(n)], [5] * n]):
            mine = lengths[t.rank]
            ex.send[:mine] = 10 * step + t.rank
            ex(mine)
            assert ex.moved(mine) == mine * (n - 1)
            seen.append(ex.recv.copy())
        with pytest.raises(ValueError, match="sends 1 to 64 bytes, got 65"):
            ex(65)  # refused before anything is sent, on every rank alike
        return seen

    for seen in run_ranks(n, body):
        first, second, third = seen
        for r in range(n):
            assert (first[r] == r).all()
            k = 1 + 7 * r
            assert (second[r, :k] == 10 + r).all() and (second[r, k:] == r).all()
            assert (third[r, :5] == 20 + r).all()
            assert (third[r, 5:k] == 10 + r).all() and (third[r, max(5, k):] == r).all()


@pytest.mark.parametrize("kind", ["sized", "fixed"])
@pytest.mark.parametrize("n", [2, 3])
def test_lengths_that_differ_across_the_inline_limit_raise_everywhere(kind, n):
    """A rank whose call is inlined (8 bytes) meets ranks whose call is not (32 KiB), or a
    barrier, or a longer inlined one, first on the checked path and then on the prepared one:
    the same ArgumentMismatchError on every rank each time, and correct sums afterwards."""
    tiny, small = np.arange(2, dtype=np.float32), np.arange(1000, dtype=np.float32)
    big = np.arange(8192, dtype=np.float32)  # 32 KiB: past the 4 KiB inline limit

    def body(t):
        comm = Communicator(_transport(kind)(t), segment_bytes=4096)
        odd = t.rank == n - 1
        outcomes = []
        for _ in range(3):  # the checked call, then its prepared repeats
            for x in (tiny, small, big):
                assert (comm.allreduce(x) == x * n).all()
            for mine, theirs in ((big, tiny), (small, tiny), (tiny, None)):
                x = mine if odd else theirs
                try:
                    comm.barrier() if x is None else comm.allreduce(x)
                except ArgumentMismatchError as err:
                    outcomes.append(str(err))
                else:
                    outcomes.append(None)
        results = [comm.allreduce(x) for x in (tiny * (t.rank + 1), big, small)]
        comm.close()
        return outcomes, results

    per_rank = run_ranks(n, body)
    outcomes = [o for o, _ in per_rank]
    assert all(o == outcomes[0] for o in outcomes)
    assert all(message is not None for message in outcomes[0]), outcomes[0]
    for i in range(3):
        assert identical([r[i] for _, r in per_rank])
    _, (low, big_sum, small_sum) = per_rank[0]
    np.testing.assert_array_equal(low, tiny * sum(range(1, n + 1)))
    np.testing.assert_array_equal(big_sum, big * n)
    np.testing.assert_array_equal(small_sum, small * n)


@pytest.mark.parametrize("kind", ["sized", "fixed"])
def test_a_shorter_call_never_reads_a_longer_ones_bytes(kind):
    """An inlined call after a longer one: its rows hold only this call's bytes."""
    n = 3

    def body(t):
        comm = Communicator(_transport(kind)(t))
        out = []
        for length in (1000, 3, 1000, 0, 17):
            x = np.full(length, float(t.rank + 1), np.float64)
            out.append(comm.allreduce(x))
        comm.close()
        return out

    for results in run_ranks(n, body):
        for y, length in zip(results, (1000, 3, 1000, 0, 17), strict=True):
            np.testing.assert_array_equal(y, np.full(length, 6.0))
