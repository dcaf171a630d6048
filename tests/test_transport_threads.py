"""The algorithms over the in-process threads Transport, at 1 to 16 ranks.

Every result is compared bit for bit across ranks and against NumPy in float64 with the
tolerances stated in ``thread_helpers.assert_matches_reference``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thread_helpers import (
    SEGMENT,
    SIZES,
    assert_conserved,
    assert_matches_reference,
    communicators,
    identical,
    rank_inputs,
    reference,
)

import ringcomm
from ringcomm.algorithms import compressed as algorithms
from ringcomm.algorithms import ring
from ringcomm.algorithms.auto import Auto, AutoFigures, LinkModel
from ringcomm.algorithms.compressed_ring import mix_seed
from ringcomm.backends.threads import (
    ThreadTransport,
    ThreadWorld,
    WorldAbortedError,
    run_ranks,
)
from ringcomm.comm.base import Communicator
from ringcomm.core.types import (
    DEFAULT_INLINE_BYTES,
    RING,
    USER,
    ArgumentMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    InvalidTypeError,
    ReduceOp,
)

pytestmark = pytest.mark.timeout(120)

OPS = ("sum", "avg", "min", "max", "prod")
DTYPES = ("float32", "float64", "float16", "int32", "int64")
COMPRESSORS = {
    "fp16": ringcomm.FP16(),
    "bf16": ringcomm.BF16(),
    "int8-b64": ringcomm.Int8(block_size=64),
    "int8-b32-stochastic": ringcomm.Int8(block_size=32, stochastic=True, seed=3),
    "topk-ring": ringcomm.TopK(0.1, algorithm="ring"),
    "topk-allgather": ringcomm.TopK(0.1, algorithm="allgather"),
}
STEPS = 5


def lengths(n: int) -> list[int]:
    """0, 1, fewer than n, not divisible by n, and several segments per chunk (SEGMENT)."""
    return sorted({0, 1, max(n - 1, 0), 7 * n + 3, 300 * n + 7})


# --------------------------------------------------------------------------- dense ring
@pytest.mark.parametrize(("op", "dtype"), [(op, dt) for op in OPS for dt in DTYPES
                                           if not (op == "avg" and dt.startswith("int"))])
@pytest.mark.parametrize("n", SIZES)
def test_ring_allreduce(n, op, dtype):
    rng = np.random.default_rng(n * 100 + OPS.index(op))
    cases = [rank_inputs(rng, n, length, dtype, op) for length in lengths(n)]

    def body(t):
        outs = []
        for xs in cases:
            out = np.full(xs.shape[1], 7, xs.dtype)
            ring.allreduce(t, xs[t.rank], out, ReduceOp(op), segment_bytes=SEGMENT)
            outs.append(out)
        return outs

    per_rank = run_ranks(n, body)
    for i, xs in enumerate(cases):
        ys = [outs[i] for outs in per_rank]
        assert identical(ys), f"length {xs.shape[1]}: ranks differ"
        assert_matches_reference(ys[0], xs, op)


@pytest.mark.parametrize("n", SIZES)
def test_ring_allreduce_in_place(n):
    xs = rank_inputs(np.random.default_rng(n), n, 300 * n + 7, "float32", "sum")

    def body(t):
        x = xs[t.rank].copy()
        ring.allreduce(t, x, x, ReduceOp.SUM, segment_bytes=SEGMENT)
        return x

    ys = run_ranks(n, body)
    assert identical(ys)
    assert_matches_reference(ys[0], xs, "sum")


@pytest.mark.parametrize(("dtype", "op"), [("float32", "sum"), ("float16", "avg"),
                                           ("float64", "prod"), ("int32", "sum"),
                                           ("int64", "max"), ("float32", "min")])
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter(n, dtype, op):
    rng = np.random.default_rng(n)
    cases = [rank_inputs(rng, n, length, dtype, op) for length in lengths(n)]

    def body(t):
        return [ring.reduce_scatter(t, xs[t.rank], ReduceOp(op), segment_bytes=SEGMENT)
                for xs in cases]

    per_rank = run_ranks(n, body)
    for i, xs in enumerate(cases):
        length = xs.shape[1]
        for r, outs in enumerate(per_rank):
            lo, hi = r * length // n, (r + 1) * length // n
            assert outs[i].shape == (hi - lo,), f"rank {r}, length {length}"
            assert_matches_reference(outs[i], xs[:, lo:hi], op)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), length=st.integers(0, 5000), segment=st.integers(8, 4096),
       dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS), seed=st.integers(0, 2**16))
def test_ring_allreduce_property(n, length, segment, dtype, op, seed):
    if op == "avg" and dtype.startswith("int"):
        op = "sum"
    xs = rank_inputs(np.random.default_rng(seed), n, length, dtype, op)

    def body(t):
        out = np.empty(length, xs.dtype)
        ring.allreduce(t, xs[t.rank], out, ReduceOp(op), segment_bytes=segment)
        return out

    ys = run_ranks(n, body)
    assert identical(ys)
    assert_matches_reference(ys[0], xs, op)


# ------------------------------------------------------------------------ compression
def compressed_steps(n: int, comp, op: str, xs: np.ndarray, *, segment: int = SEGMENT):
    """Run ``len(xs)`` error-feedback steps (xs: steps x n x length); per rank: (results,
    final residual)."""

    def body(t):
        ef = ringcomm.ErrorFeedback()
        results = []
        for step, x in enumerate(xs):
            out = np.empty(x.shape[1], x.dtype)
            algorithms.allreduce(t, x[t.rank], out, ReduceOp(op), comp, ef, "w",
                                 mix_seed(step, t.rank), segment_bytes=segment)
            results.append(out)
        return results, ef.residual("w")

    return run_ranks(n, body)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("comp", list(COMPRESSORS), ids=list(COMPRESSORS))
@pytest.mark.parametrize("n", SIZES)
def test_compressed_identical_and_conserving(n, comp, op):
    rng = np.random.default_rng(n)
    for length in (1, max(n - 1, 1), 1000 + n):
        xs = rng.standard_normal((STEPS, n, length)).astype(np.float32)
        per_rank = compressed_steps(n, COMPRESSORS[comp], op, xs)
        for step in range(STEPS):
            assert identical([res[step] for res, _ in per_rank]), f"step {step} differs"
        assert_conserved(per_rank, xs, op)


@pytest.mark.parametrize("comp", list(COMPRESSORS), ids=list(COMPRESSORS))
def test_compressed_read_only_input_on_one_rank(comp):
    """An input the caller froze on one rank only (a memory map, ``np.frombuffer``) takes the
    compiled codecs' reference path there: the same bits as the writeable input, on every rank
    (it once raised Numba's "No matching definition" on that rank while the others waited)."""
    x = np.random.default_rng(9).standard_normal((2, 20_000)).astype(np.float32)

    def job(frozen: bool) -> list:
        def body(comm: Communicator) -> np.ndarray:
            mine = x[comm.rank].copy()
            mine.flags.writeable = not (frozen and comm.rank == 0)
            return comm.allreduce(mine, compression=COMPRESSORS[comp])
        return communicators(2, body)

    expected, got = job(False), job(True)
    assert identical(got)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, got, strict=True))


# Errors of one encoding relative to the magnitude of what is encoded.
_ACCURACY = {"fp16": 2.0**-10, "bf16": 2.0**-7, "int8-b64": 1 / 127, "int8-b32-stochastic": 2 / 127}


@pytest.mark.parametrize("comp", list(_ACCURACY))
@pytest.mark.parametrize("n", SIZES)
def test_compressed_accuracy(n, comp):
    """One step of a dense compressor is within n encodings' error of the exact sum."""
    xs = np.random.default_rng(n).standard_normal((1, n, 2000)).astype(np.float32)
    (results, _), *_ = compressed_steps(n, COMPRESSORS[comp], "sum", xs)
    partial = np.abs(np.cumsum(xs[0].astype(np.float64), axis=0)).max()
    error = np.abs(results[0] - reference(xs[0], "sum")).max()
    assert error <= 2 * n * _ACCURACY[comp] * partial


@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
@pytest.mark.parametrize("n", SIZES)
def test_topk_keeping_everything_is_exact(n, algorithm):
    xs = np.random.default_rng(n).standard_normal((2, n, 333 + n)).astype(np.float32)
    per_rank = compressed_steps(n, ringcomm.TopK(1.0, algorithm=algorithm), "sum", xs)
    for step in range(2):
        assert identical([res[step] for res, _ in per_rank])
        assert_matches_reference(per_rank[0][0][step], xs[step], "sum")
    assert all(not res.any() for _, res in per_rank)


@pytest.mark.parametrize("comp", ["int8-b64", "fp16"])
@pytest.mark.parametrize("n", [2, 5, 16])
def test_compressed_float16_conserving(n, comp):
    """16-bit results: the owner's final rounding goes to its residual too."""
    xs = np.random.default_rng(n).standard_normal((STEPS, n, 700)).astype(np.float16)
    per_rank = compressed_steps(n, COMPRESSORS[comp], "avg", xs)
    for step in range(STEPS):
        assert identical([res[step] for res, _ in per_rank])
    assert_conserved(per_rank, xs, "avg")


@pytest.mark.parametrize("comp", ["int8-b64", "int8-b32-stochastic", "topk-ring",
                                  "topk-allgather", "fp16"])
@pytest.mark.parametrize("n", SIZES)
def test_nonfinite_stays_nonfinite(n, comp):
    xs = np.random.default_rng(n).standard_normal((2, n, 500)).astype(np.float32)
    poisoned = {3: np.nan, 100: np.inf, 257: -np.inf}
    for i, v in poisoned.items():
        xs[0, n - 1, i] = v
    per_rank = compressed_steps(n, COMPRESSORS[comp], "avg", xs)
    first = [res[0] for res, _ in per_rank]
    assert identical(first)
    for i in poisoned:
        assert not np.isfinite(first[0][i]), f"element {i} became {first[0][i]}"
    for results, residual in per_rank:
        # A non-finite residual would poison every later step; the next step is clean.
        assert np.isfinite(residual).all()
        assert identical([results[1], per_rank[0][0][1]])
        assert np.isfinite(results[1]).all()


# ------------------------------------------------------------------------------- auto
_CANDIDATES = (None, ringcomm.FP16(), ringcomm.Int8(), ringcomm.TopK(0.01))
# Link bandwidth (bytes/s) and per-candidate hop throughput (bytes/s, in _CANDIDATES' order)
# under which the model prefers each compressor once the array is past the inline slot.
_FIGURES = {
    "int8": (1.25e8, (2e10, 4e9, 1e9, 2e8)),
    "topk": (1e7, (2e10, 4e9, 1e9, 2e8)),
    "fp16": (1e9, (2e10, 4e9, 1e8, 2e8)),
}


def _fixed_auto(figures: str) -> Auto:
    bandwidth, speeds = _FIGURES[figures]
    throughput = dict(zip([Auto.key(c) for c in _CANDIDATES], speeds, strict=True))
    return Auto(_CANDIDATES, link=LinkModel(1e-5, bandwidth), throughput=throughput)


@pytest.mark.parametrize("figures", list(_FIGURES))
@pytest.mark.parametrize("n", SIZES)
def test_auto_fixed_figures(n, figures):
    sizes = (16, 3000, 60_000)
    xs = {s: np.random.default_rng(s).standard_normal((n, s)).astype(np.float32)
          for s in sizes}

    def body(t):
        auto, ef, out = _fixed_auto(figures), ringcomm.ErrorFeedback(), []
        for s, x in xs.items():
            choice = auto.resolve(t, AutoFigures(), x[t.rank], DEFAULT_INLINE_BYTES)
            y = np.empty(s, np.float32)
            algorithms.allreduce(t, x[t.rank], y, ReduceOp.SUM, choice, ef, f"w{s}",
                                 mix_seed(s, t.rank), segment_bytes=SEGMENT)
            out.append((repr(choice), y))
        return out

    per_rank = run_ranks(n, body)
    expected = [repr(_fixed_auto(figures).choose(4 * s, n, DEFAULT_INLINE_BYTES, 4 * s))
                for s in sizes]
    for i in range(len(sizes)):
        assert [outs[i][0] for outs in per_rank] == [expected[i]] * n
        assert identical([outs[i][1] for outs in per_rank])
    if n > 1:  # the small array rides inline, dense; the others take the figures' winner
        assert expected[0] == "None"
        assert {e.split("(")[0].lower() for e in expected[1:]} == {figures}


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_auto_measured_agrees(n):
    x = np.random.default_rng(n).standard_normal((n, 50_000)).astype(np.float32)

    def body(t):
        figures = AutoFigures()
        choice = Auto().resolve(t, figures, x[t.rank], DEFAULT_INLINE_BYTES)
        y = np.empty(x.shape[1], np.float32)
        algorithms.allreduce(t, x[t.rank], y, ReduceOp.AVG, choice, ringcomm.ErrorFeedback(),
                             "w", mix_seed(0, t.rank), segment_bytes=SEGMENT)
        return repr(choice), figures.links, figures.throughput, y

    per_rank = run_ranks(n, body)
    assert all(r[:3] == per_rank[0][:3] for r in per_rank), "figures or choices differ"
    assert identical([r[3] for r in per_rank])


# ------------------------------------------------------------------------ communicator
@pytest.mark.parametrize("n", SIZES)
def test_communicator_collectives(n):
    rng = np.random.default_rng(n)
    big = rank_inputs(rng, n, 3000, "float32", "sum")  # beyond the inline slot: the ring
    small = rank_inputs(rng, n, 12, "int64", "sum").reshape(n, 3, 4)

    def body(t):
        comm = Communicator(t, segment_bytes=SEGMENT)
        r = t.rank
        out = {
            "big": comm.allreduce(big[r], op="avg"),
            "small": comm.allreduce(small[r], op="max"),
            "gather": comm.allgather(np.full((2, 3), r, np.int32)),
            "gatherv": comm.allgatherv(np.full((r % 3, 2), r, np.float64)),
            "bcast": comm.broadcast(np.full(5, r, np.float32), root=n - 1),
            "chunk": comm.reduce_scatter(big[r]),
            "shift": comm.sendrecv(np.array([r]), (r + 1) % n, np.empty(1, np.int64),
                                   (r - 1) % n),
        }
        comm.barrier()
        comm.close()
        return out

    per_rank = run_ranks(n, body)
    for key in ("big", "small", "gather", "gatherv", "bcast"):
        assert identical([o[key] for o in per_rank]), key
    first = per_rank[0]
    assert_matches_reference(first["big"], big, "avg")
    np.testing.assert_array_equal(first["small"], small.max(axis=0))
    np.testing.assert_array_equal(first["gather"],
                                  np.broadcast_to(np.repeat(np.arange(n), 2)[:, None], (2 * n, 3)))
    np.testing.assert_array_equal(first["gatherv"][:, 0],
                                  np.repeat(np.arange(n), [r % 3 for r in range(n)]))
    assert (first["bcast"] == n - 1).all()
    for r, o in enumerate(per_rank):
        lo, hi = r * 3000 // n, (r + 1) * 3000 // n
        assert_matches_reference(o["chunk"], big[:, lo:hi], "sum")
        assert o["shift"][0] == (r - 1) % n


def _outcome(call):
    try:
        call()
    except Exception as err:
        return type(err), str(err)
    return None


@pytest.mark.parametrize("n", [2, 3, 8])
def test_communicator_misuse_same_error_everywhere(n):
    x = np.arange(3000, dtype=np.float32)

    def body(t):
        comm = Communicator(t, segment_bytes=SEGMENT)
        r = t.rank
        outcomes = [
            _outcome(lambda: comm.allreduce(x[: 3000 - (r == 1)])),
            _outcome(lambda: comm.allreduce(x[:10], op="bogus" if r == n - 1 else "sum")),
            _outcome(lambda: comm.allreduce(list(x[:10]) if r == 0 else x[:10])),
            _outcome(lambda: comm.broadcast(x[:100].copy(), root=r)),
            _outcome(lambda: comm.allreduce(x, compression=ringcomm.Int8(block_size=64 + r))),
        ]
        return outcomes, comm.allreduce(x)  # still usable

    per_rank = run_ranks(n, body)
    expected = [ArgumentMismatchError, InvalidArgumentError, InvalidTypeError,
                ArgumentMismatchError, ArgumentMismatchError]
    for i, cls in enumerate(expected):
        outcomes = [o[0][i] for o in per_rank]
        assert outcomes[0] is not None and issubclass(outcomes[0][0], cls), outcomes[0]
        assert all(o == outcomes[0] for o in outcomes), f"call {i}: {outcomes}"
    assert identical([o[1] for o in per_rank])
    np.testing.assert_array_equal(per_rank[0][1], x * n)


@pytest.mark.parametrize("check", [True, False])
def test_checkpoint_meets_only_the_same_point(check):
    """``checkpoint(label)``: ranks at the same point pass (with the consistency check on or
    off); a rank at another point, in a collective, or with a label that is not a str makes
    every rank raise the same error, naming what each rank was at; the communicator stays
    usable. (With the check off a collective exchanges no header for a checkpoint to meet:
    that case runs with the check on only.)"""
    n = 3
    x = np.arange(4, dtype=np.float32)
    expected = [(ArgumentMismatchError, "checkpoint: point differs between ranks: step 2 on "
                                        "ranks 0, 2; step 3 on rank 1")]
    if check:
        expected.append((ArgumentMismatchError, "collective calls differ between ranks: "
                                                "gather on ranks 0, 1; allreduce on rank 2"))
    expected.append((InvalidTypeError, "checkpoint failed on rank 0: checkpoint's label must "
                                       "be a str, got int"))

    def body(t):
        comm = Communicator(t, consistency_check=check)
        r = t.rank
        comm.checkpoint("step 1")
        outcomes = [_outcome(lambda: comm.checkpoint("step 2" if r != 1 else "step 3"))]
        if check:
            outcomes.append(_outcome(
                lambda: comm.allreduce(x) if r == 2 else comm.checkpoint("gather")))
        outcomes.append(_outcome(lambda: comm.checkpoint(5 if r == 0 else "five")))
        return outcomes, comm.allreduce(x)

    per_rank = run_ranks(n, body)
    for i, (cls, words) in enumerate(expected):
        outcomes = [o[0][i] for o in per_rank]
        assert outcomes[0] is not None and issubclass(outcomes[0][0], cls), outcomes
        assert all(o == outcomes[0] for o in outcomes), outcomes
        assert words in outcomes[0][1], outcomes[0][1]
    for _, y in per_rank:
        np.testing.assert_array_equal(y, x * n)


# ------------------------------------------------------------------------------- split
def test_split_subgroups_reduce_their_own_ranks():
    n = 8
    xs = rank_inputs(np.random.default_rng(0), n, 1001, "float64", "sum")

    def body(t):
        sub = t.split(t.rank % 2, -t.rank)
        out = np.empty(xs.shape[1])
        ring.allreduce(sub, xs[t.rank], out, ReduceOp.SUM, segment_bytes=SEGMENT)
        whole = np.empty(xs.shape[1])
        ring.allreduce(t, xs[t.rank], whole, ReduceOp.SUM, segment_bytes=SEGMENT)
        return sub.rank, sub.size, out, whole

    per_rank = run_ranks(n, body)
    for color in (0, 1):
        members = sorted(range(color, n, 2), key=lambda r: -r)
        assert [per_rank[r][:2] for r in members] == [(i, 4) for i in range(4)]
        assert identical([per_rank[r][2] for r in members])
        assert_matches_reference(per_rank[members[0]][2], xs[members], "sum")
    assert identical([p[3] for p in per_rank])
    assert_matches_reference(per_rank[0][3], xs, "sum")


def test_split_parent_and_child_messages_never_mix():
    n = 8

    def body(t):
        sub = t.split(t.rank % 2, -t.rank)
        received = []
        for rounds in range(3):
            got_p, got_c = np.empty(4, np.int64), np.empty(4, np.int64)
            # Both messages go from this rank to the same peer on the same channel (the
            # child's right neighbour is the parent's rank - 2), the parent's first: only
            # the world tells them apart.
            p = t.isendrecv(np.full(4, 100 * rounds + t.rank), (t.rank - 2) % n, got_p,
                            (t.rank + 2) % n)
            c = sub.isendrecv(np.full(4, -100 * rounds - t.rank), (sub.rank + 1) % 4, got_c,
                              (sub.rank - 1) % 4)
            c.wait()
            p.wait()
            received.append((got_p[0], got_c[0]))
            comm = Communicator(sub)  # parent and child collectives interleaved
            t.barrier()
            received.append(tuple(comm.allgather(np.array([t.rank]))))
        return received

    per_rank = run_ranks(n, body)
    for r, got in enumerate(per_rank):
        members = sorted(range(r % 2, n, 2), key=lambda m: -m)
        left_in_sub = members[(members.index(r) - 1) % 4]
        for rounds in range(3):
            assert left_in_sub == (r + 2) % n
            assert got[2 * rounds] == (100 * rounds + (r + 2) % n, -100 * rounds - left_in_sub)
            assert got[2 * rounds + 1] == tuple(members)


def test_split_nested_and_invalid():
    def body(t):
        halves = t.split(t.rank // 4, 0)
        singles = halves.split(halves.rank, 0)
        x = np.arange(10.0) * (t.rank + 1)
        y = np.empty(10)
        ring.allreduce(halves, x, y, ReduceOp.SUM)
        z = np.empty(10)
        ring.allreduce(singles, x, z, ReduceOp.SUM)
        bad = _outcome(lambda: t.split(-1 if t.rank == 3 else 0, 0))
        return y, z, singles.size, bad

    per_rank = run_ranks(8, body)
    for r, (y, z, size, bad) in enumerate(per_rank):
        group = range(4 * (r // 4), 4 * (r // 4) + 4)
        np.testing.assert_array_equal(y, np.arange(10.0) * sum(g + 1 for g in group))
        np.testing.assert_array_equal(z, np.arange(10.0) * (r + 1))
        assert size == 1
        assert bad == (ValueError, "split failed on rank 3: split color must be >= 0, got -1")


# ---------------------------------------------------------------------------- transport
def test_messages_fifo_per_channel_and_buffered():
    def body(t):
        if t.rank == 0:
            buf = np.arange(3)
            for i in range(3):
                buf[:] = i
                t.isendrecv(buf, 1, None, 0).wait()  # buf is free again after wait()
            t.isendrecv(np.array([42, 42, 42]), 1, None, 0, channel=USER).wait()
            buf[:] = -1
            t.barrier()
            return None
        t.barrier()
        got = np.empty(3, np.int64)
        t.isendrecv(None, 0, got, 0, channel=USER).wait()
        out = [got.copy()]
        for _ in range(3):
            t.isendrecv(None, 0, got, 0, channel=RING).wait()
            out.append(got.copy())
        return out

    got = run_ranks(2, body)[1]
    assert [list(g) for g in got] == [[42] * 3, [0] * 3, [1] * 3, [2] * 3]


def test_size_mismatch_names_both_sizes():
    def body(t):
        t.isendrecv(np.zeros(4, np.float32), 1 - t.rank, np.empty(3, np.float32),
                    1 - t.rank).wait()

    with pytest.raises(ValueError, match="16 bytes but the receive buffer 12"):
        run_ranks(2, body)


@pytest.mark.timeout(30)
def test_receive_timeout_names_the_peer():
    def body(t):
        if t.rank == 1:
            t.isendrecv(None, 0, np.empty(1), 0).wait()

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError,
                       match="rank 1: receive from rank 0 on the ring channel"):
        run_ranks(2, body, timeout=0.3)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(30)
def test_collective_timeout_names_the_missing_rank():
    def body(t):
        if t.rank != 2:
            t.barrier()

    with pytest.raises(CollectiveTimeoutError,
                       match=r"barrier timed out .* waiting for ranks \[2\]"):
        run_ranks(3, body, timeout=0.3)


@pytest.mark.timeout(30)
def test_failing_rank_aborts_the_others_at_once():
    def body(t):
        if t.rank == 2:
            raise KeyError("boom")
        t.isendrecv(None, 0, np.empty(1), 2).wait()  # would wait the whole timeout

    start = time.monotonic()
    with pytest.raises(KeyError, match="boom") as info:
        run_ranks(4, body, timeout=60)
    assert time.monotonic() - start < 5
    assert "raised on rank 2 of 4" in info.value.__notes__


def test_different_collectives_fail_on_every_rank():
    def body(t):
        return _outcome(t.barrier if t.rank else lambda: t.broadcast(np.zeros(2), 0))

    outcomes = run_ranks(3, body)
    assert all(o == outcomes[0] for o in outcomes)
    assert outcomes[0][0] is RuntimeError and "different collectives" in outcomes[0][1]


def test_transport_basics():
    world = ThreadWorld(1, timeout=1)
    t = ThreadTransport(world, 0)
    assert (t.backend, t.rank, t.size) == ("threads", 0, 1)
    with pytest.raises(TypeError, match="takes NumPy arrays"):
        t.check_arrays(np.zeros(1), [1.0])
    with pytest.raises(TypeError, match="takes NumPy arrays"):
        t.isendrecv([1.0], 0, None, 0)
    obj = {"a": [1]}
    assert t.allgather_object(obj) == [obj] and t.allgather_object(obj)[0] is not obj
    with pytest.raises(ValueError, match=r"rank must be a rank in \[0, 1\)"):
        ThreadTransport(world, 1)
    with pytest.raises(ValueError, match="size must be"):
        ThreadWorld(0)
    t.close()
    world.abort("test")
    with pytest.raises(WorldAbortedError, match="test"):
        ThreadTransport(world, 0).barrier()


def test_bfloat16_and_byte_collectives():
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def body(t):
        x = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16) * (t.rank + 1)
        t.broadcast(x, 1)
        counts = [r + 1 for r in range(t.size)]
        out = np.empty(sum(counts), np.int16)
        t.allgatherv(np.full(t.rank + 1, t.rank, np.int16), counts, out)
        return x.astype(np.float32), out

    for x, out in run_ranks(3, body):
        np.testing.assert_array_equal(x, np.arange(6) * 2)
        np.testing.assert_array_equal(out, [0, 1, 1, 2, 2, 2])
