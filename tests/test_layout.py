"""The ring's chunk/segment layout and schedule (pure arithmetic, no processes)."""

from __future__ import annotations

import itertools

import pytest

from ringcomm.algorithms.ring import RingLayout, _units, chunk_bounds, schedule


@pytest.mark.parametrize(("length", "parts", "align"),
                         list(itertools.product([0, 1, 3, 7, 256, 1000, 4097], [1, 2, 3, 4, 8],
                                                           [1, 4, 256])))
def test_chunk_bounds_cover_in_aligned_near_equal_runs(length, parts, align):
    b = chunk_bounds(length, parts, align)
    assert len(b) == parts + 1 and b[0] == 0 and b[-1] == length
    assert all(lo <= hi for lo, hi in itertools.pairwise(b))
    assert all(x % align == 0 for x in b[:-1] if x < length)
    sizes = [-(-(hi - lo) // align) for lo, hi in itertools.pairwise(b)]  # in blocks
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("length", "n", "seg"), [(0, 2, 4), (1, 4, 4), (10, 3, 2),
                                                  (1000, 4, 7), (4096, 2, 1024)])
def test_layout_segments_agree_between_neighbours(length, n, seg):
    layouts = [RingLayout.build(length, n, r, seg) for r in range(n)]
    for lay in layouts:
        assert lay.nseg == layouts[0].nseg
        for c in range(n):
            covered = [i for j in range(lay.nseg) for i in range(lay.seg(c, j).start,
                                                                  lay.seg(c, j).stop)]
            assert covered == list(range(lay.chunks[c], lay.chunks[c + 1]))


@pytest.mark.parametrize(("steps", "nseg"), [(1, 1), (2, 1), (2, 5), (6, 3), (3, 8)])
def test_schedule_orders_every_exchange_after_its_dependency(steps, nseg):
    order = schedule(steps, nseg)
    assert sorted(order) == [(t, j) for t in range(steps) for j in range(nseg)]
    pos = {u: p for p, u in enumerate(order)}
    assert all(pos[(t - 1, j)] < pos[(t, j)] for t, j in order if t)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_units_pair_up_across_neighbours(n):
    """What rank r sends at every position is what rank r + 1 expects there, and every rank
    ends owning its own chunk."""
    nseg = 3
    units = {r: _units(n, r, nseg, True) for r in range(n)}
    for r in range(n):
        right = (r + 1) % n
        for mine, theirs in zip(units[r], units[right], strict=True):
            assert mine.send_chunk == theirs.recv_chunk
            assert mine.segment == theirs.segment
        finals = {u.recv_chunk for u in units[r] if u.final}
        assert finals == {r}
