"""The compiled small allreduce over MPI (ringcomm/backends/mpi_fused.py): a plan's repeats
past ``FUSE_AFTER`` run the exchange and the reduction as one Numba call. Each test checks the
bits against the Python path's definition (every rank's row reduced in rank order by the
ufunc, as ``_reduce_rows`` does), on every rank, and that the compiled call did run."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

import ringcomm
from ringcomm.backends import mpi_fused
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.comm import _inline
from ringcomm.core.types import ArgumentMismatchError, CollectiveTimeoutError

_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum}


@pytest.fixture
def comm(monkeypatch):
    """A communicator of its own whose plans fuse after 3 runs (the default waits 64)."""
    monkeypatch.setattr(_inline, "FUSE_AFTER", 3)
    c = ringcomm.init("mpi", abort_on_exception=False, timeout=60)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def quiet_floats():
    """inf - inf and overflows are what the data means here."""
    with np.errstate(all="ignore"):
        yield


def expected(world, x: np.ndarray, op: str) -> np.ndarray:
    """The Python path's result: every rank's array, reduced in rank order by the ufunc."""
    rows = np.stack(world.allgather(x)).reshape(world.Get_size(), -1)
    acc = _UFUNC[op].reduce(rows, axis=0, dtype=rows.dtype)
    if rows.dtype.kind == "f" and _UFUNC[op] is np.add:  # -0.0 + -0.0 is -0.0
        acc[np.signbit(rows).all(axis=0) & (rows == 0).all(axis=0)] = -0.0
    if op == "avg":
        acc = np.divide(acc, rows.shape[0], out=acc)
    return acc.reshape(x.shape)


def fused_of(comm, x, op="sum"):
    plan = comm._plans.get(x, op)
    return None if plan is None or plan.repeat is None else getattr(plan.repeat, "fused", None)


def compile_call(comm, x):
    """Repeat ``x``'s sum past the fixture's FUSE_AFTER: from then on it is compiled."""
    for _ in range(5):
        comm.allreduce(x)
    assert comm.size == 1 or fused_of(comm, x) is not None


def values(dtype: np.dtype, shape: tuple[int, ...], rank: int, step: int,
           rng: np.random.Generator) -> np.ndarray:
    """Data with the cases that show a different order or rounding: for floats NaN, +-inf,
    -0.0, tiny and huge values; for integers the ends of the range (sums and products wrap)."""
    n = int(np.prod(shape))
    if dtype.kind == "f":
        x = rng.standard_normal(n).astype(dtype)
        x *= np.asarray(10.0, dtype) ** rng.integers(-30, 30, n).astype(dtype)
        special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-38, 3e38], dtype)
        x[: min(n, len(special))] = np.roll(special, rank + step)[: min(n, len(special))]
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        x[: min(n, 2)] = np.array([info.max, info.min], dtype)[: min(n, 2)]
    return x.reshape(shape)


DTYPES = ["float32", "float64", "int32", "int64"]  # the host dtypes ringcomm reduces, but 16-bit


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_supported_dtype_and_op_gives_the_python_paths_bits(comm, world, rng, dtype):
    dt = np.dtype(dtype)
    ops = ["sum", "prod", "avg"] if dt.kind == "f" else ["sum", "prod", "min", "max"]
    for op in ops:
        # 1000 bytes travel whole; 12 and 40 KB in chunks where ranks share a node (2-5 at 2
        # ranks, 2 at 3 and 4; 40 KB whole from 3 ranks: MAX_CHUNKS).
        for shape in [(1,), (5,), (), (3, 4), (1000 // dt.itemsize,),
                      (12000 // dt.itemsize,), (40, 1000 // dt.itemsize)]:
            for step in range(6):
                x = values(dt, shape, comm.rank, step, rng)
                got = comm.allreduce(x, op=op)
                want = expected(world, x, op)
                assert got.shape == x.shape and got.dtype == x.dtype
                np.testing.assert_array_equal(got.reshape(-1).view(np.uint8),
                                              want.reshape(-1).view(np.uint8),
                                              err_msg=f"{op} {shape} step {step}")
                # The same bits on every rank.
                assert len({b.tobytes() for b in world.allgather(got)}) == 1
            if comm.size > 1:
                assert fused_of(comm, x, op) is not None, (op, shape)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_sum_of_negative_zeros_is_negative_zero_on_every_path(comm, world, dtype):
    """-0.0 on every rank sums (and averages) to -0.0, IEEE's sum, in every size's path and
    before and after the call is compiled. The Python path's small sums started from NumPy's
    +0.0 (at 3 ranks and more, and for 16-bit floats at any size), so a repeated call's
    result changed sign where the compiled call took over."""
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for n in (3, 500, 40_000, 600_000):  # inline, inline in chunks, segment, ring
        x = np.full(n, -0.0, dt)
        for op in ("sum", "avg"):
            for _ in range(5):  # past the fixture's FUSE_AFTER
                got = comm.allreduce(x, op=op)
                assert np.signbit(got.astype(np.float32)).all(), (n, op)
        part = comm.reduce_scatter(x)
        assert np.signbit(part.astype(np.float32)).all(), n


@pytest.mark.parametrize("dtype,op", [("float32", "min"), ("float64", "max"),
                                      ("float16", "sum")])
def test_what_it_does_not_reduce_alike_stays_on_the_python_path(comm, world, rng, dtype, op):
    """Float min/max (NumPy's choice between -0.0 and 0.0 depends on its SIMD path) and 16-bit
    floats (accumulated in float32) stay on the Python path."""
    assert not mpi_fused.supports(np.dtype(dtype), op)
    x = rng.standard_normal(7).astype(dtype)
    for _ in range(6):
        got = comm.allreduce(x, op=op)
    if dtype != "float16":
        np.testing.assert_array_equal(got, expected(world, x, op))
    assert fused_of(comm, x, op) is None


def test_a_message_in_chunks_is_compiled_with_its_later_chunks(comm, world, rng):
    """At 2 ranks sharing a node a 12 KB array's message goes in 2 chunks: the compiled call
    starts the later chunk's send with the first, and its receive once the headers agree."""
    if comm.size != 2 or comm.local_size != 2:
        pytest.skip("two ranks on one node")
    x = rng.standard_normal(3000).astype(np.float32)
    for _ in range(5):
        got = comm.allreduce(x)
    fused = fused_of(comm, x)
    assert fused is not None and len(fused._later) == 2  # the later chunk's receive and send
    np.testing.assert_array_equal(got, expected(world, x, "sum"))


def test_out_in_place_and_a_strided_out(comm, world, rng):
    x = rng.standard_normal(12).astype(np.float32)
    for _ in range(5):
        comm.allreduce(x)
    assert comm.size == 1 or fused_of(comm, x) is not None
    want = expected(world, x, "sum")
    out = np.empty_like(x)
    assert comm.allreduce(x, out) is out
    np.testing.assert_array_equal(out, want)
    y = x.copy()
    assert comm.allreduce(y, y) is y  # in place: the array is sent before it is written
    np.testing.assert_array_equal(y, want)
    wide = np.zeros(24, np.float32)
    comm.allreduce(x, wide[::2])  # not contiguous: the Python path writes it
    np.testing.assert_array_equal(wide[::2], want)
    assert not wide[1::2].any()


def test_outs_the_repeat_cannot_take_get_the_full_check(comm, world, rng):
    """Once the call is compiled, an ``out`` that is not a second allocation (a view of the
    array's own buffer, apart from it or over the same elements or overlapping), read-only, of
    another dtype or shape gets the full path's result or error, on every rank; then the
    repeats are compiled again."""
    x = rng.standard_normal(12).astype(np.float32)
    buf = np.zeros(40, np.float32)
    buf[:12] = x
    for _ in range(5):
        comm.allreduce(buf[:12])
    fused = fused_of(comm, x)
    assert comm.size == 1 or fused is not None
    want = expected(world, x, "sum")
    apart = buf[20:32]  # a view of the same allocation as buf[:12], no element shared
    assert comm.allreduce(buf[:12], apart) is apart
    np.testing.assert_array_equal(apart, want)
    assert fused_of(comm, x) is fused  # told apart by their bounds: still compiled
    same = buf[:12]  # another view of the same elements: in place
    assert comm.allreduce(buf[:12], same) is same
    np.testing.assert_array_equal(buf[:12], want)
    buf[:12] = x
    with pytest.raises(ValueError, match="overlaps"):
        comm.allreduce(buf[:12], buf[6:18])
    frozen = np.empty_like(x)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        comm.allreduce(x, frozen)
    for wrong in (np.empty(12, np.float64), np.empty(13, np.float32)):
        with pytest.raises(ValueError):
            comm.allreduce(x, wrong)
    for _ in range(5):
        np.testing.assert_array_equal(comm.allreduce(x, np.empty_like(x)), want)
    assert comm.size == 1 or fused_of(comm, x) is not None


def test_a_read_only_array_and_a_fortran_ordered_one(comm, world, rng):
    """A read-only array (another type for Numba, compiled at its first call) and a 2-d array
    in Fortran order (not C-contiguous: the Python path) give the same bits."""
    x = rng.standard_normal(10).astype(np.float64)
    x.flags.writeable = False
    for _ in range(5):
        np.testing.assert_array_equal(comm.allreduce(x), expected(world, x, "sum"))
    assert comm.size == 1 or fused_of(comm, x) is not None
    f = np.asfortranarray(rng.standard_normal((3, 4)))
    for _ in range(5):
        np.testing.assert_array_equal(comm.allreduce(f), expected(world, f, "sum"))


def test_each_call_returns_its_own_array(comm, world):
    """Results are never a view of the exchange's buffers: a later call leaves them alone."""
    results = [comm.allreduce(np.full(4, float(i + comm.rank), np.float64)) for i in range(10)]
    n = comm.size
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, np.full(4, float(n * i + n * (n - 1) // 2)))


@pytest.mark.parametrize("n", [6, 3000])
def test_a_rank_with_another_call_raises_everywhere_then_the_call_runs_again(comm, world, n):
    """Another call on the last rank (another length, dtype, op or collective) meets the
    compiled call on the others: the error on every rank, and nothing left behind (the 12 KB
    call travels in chunks, whose later ones the others drain), then the call runs again."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = np.arange(n, dtype=np.float32)
    for _ in range(5):
        comm.allreduce(x)
    assert fused_of(comm, x) is not None
    last = comm.rank == comm.size - 1
    for other in (np.arange(n + 1, dtype=np.float32), np.arange(n, dtype=np.float64),
                  np.arange(n, dtype=np.int32), np.arange(2 * n, dtype=np.float32), "max",
                  "barrier"):
        with pytest.raises(ArgumentMismatchError):
            if not last:
                comm.allreduce(x)
            elif isinstance(other, np.ndarray):
                comm.allreduce(other)
            elif other == "max":
                comm.allreduce(x, op="max")
            else:
                comm.barrier()
        np.testing.assert_array_equal(comm.allreduce(x), x * comm.size)
    assert fused_of(comm, x) is not None


def test_a_refused_call_is_counted_alike_on_every_rank(comm, world):
    """A call refused on every rank counts as a call on every rank, whether a rank ran it as
    a prepared repeat (the compiled call) or through the full path (another op there)."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = np.ones(4, np.float32)
    compile_call(comm, x)
    before = comm.stats.calls
    with pytest.raises(ArgumentMismatchError):
        comm.allreduce(x, op="max" if comm.rank == 0 else "sum")
    comm.allreduce(x, np.empty(4, np.float32)[::1])
    assert set(world.allgather(comm.stats.calls - before)) == {2}


def test_calls_from_another_thread_carry_its_name(comm, world):
    """The header names the calling thread: calls from a thread of another name (the same on
    every rank) run, and the compiled call carries the new name from then on."""
    x = np.arange(3, dtype=np.int64) + comm.rank
    want = expected(world, x, "sum")
    for _ in range(5):
        np.testing.assert_array_equal(comm.allreduce(x), want)
    results = []

    def worker():
        for _ in range(5):
            results.append(comm.allreduce(x))

    t = threading.Thread(target=worker, name="fused-worker")
    t.start()
    t.join(60)
    assert len(results) == 5
    for r in results:
        np.testing.assert_array_equal(r, want)
    for _ in range(3):
        np.testing.assert_array_equal(comm.allreduce(x), want)


def test_calls_named_differently_on_one_rank_raise_everywhere(comm, world):
    """Threads of other names on rank 0 and on the others: every call of theirs raises on
    every rank, the second as the first (the compiled call must not keep sending the header
    it had before the first failed, which on every rank names the main thread: the calls
    would pair up and mix the two threads' data)."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    x = np.ones(3, np.float32)
    compile_call(comm, x)
    name = "fused-a" if comm.rank == 0 else "fused-b"
    errors = []

    def worker():
        for _ in range(3):
            try:
                comm.allreduce(x)
            except ArgumentMismatchError as err:
                errors.append(err)

    t = threading.Thread(target=worker, name=name)
    t.start()
    t.join(60)
    assert len(errors) == 3 and all("fused-" in str(e) for e in errors)
    np.testing.assert_array_equal(comm.allreduce(x), np.full(3, float(comm.size), np.float32))


def test_freed_requests_send_nothing_and_the_call_goes_on(comm, world):
    """More message lengths than the exchange keeps free the oldest's requests, those of the
    compiled call among them: it sends nothing and the Python path takes the call, which
    is compiled again after its repeats."""
    x = np.arange(5, dtype=np.float32)
    for _ in range(5):
        comm.allreduce(x)
    fused = fused_of(comm, x)
    if comm.size == 1:
        pytest.skip("needs two ranks")
    for n in range(1, 80):  # other lengths, each once
        np.testing.assert_array_equal(comm.allreduce(np.ones(n, np.float64)),
                                      np.full(n, float(comm.size)))
    for _ in range(5):
        np.testing.assert_array_equal(comm.allreduce(x), x * comm.size)
    again = fused_of(comm, x)
    assert again is not None and again is not fused


def test_a_rank_that_comes_late_times_out_the_waiting_rank(world):
    """The compiled call's polls end; the transport's timed wait raises, naming the exchange;
    the late rank's call then completes with the first rank's message."""
    if world.Get_size() != 2:
        pytest.skip("two ranks: one waits, one comes late")
    c = MPICommunicator(world, abort_on_timeout=False, timeout=1)
    try:
        x = np.ones(4, np.float32)
        for _ in range(_inline.FUSE_AFTER + 2):
            c.allreduce(x)
        assert fused_of(c, x) is not None
        if c.rank == 0:
            with pytest.raises(CollectiveTimeoutError, match="agreement exchange"):
                c.allreduce(x)
        else:
            time.sleep(2)
            np.testing.assert_array_equal(c.allreduce(x), x * 2)
        world.Barrier()
    finally:
        c.close()


def test_switch_off_keeps_the_python_path(monkeypatch, world):
    monkeypatch.setenv("RINGCOMM_MPI_FUSED_CALLS", "0")
    monkeypatch.setattr(_inline, "FUSE_AFTER", 3)
    c = ringcomm.init("mpi", abort_on_exception=False)
    try:
        x = np.ones(4, np.float32)
        for _ in range(6):
            c.allreduce(x)
        assert fused_of(c, x) is None
    finally:
        c.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_precompile_sends_nothing_and_the_call_then_runs(comm, world, rng, dtype):
    """``precompile`` (what tests/warm_caches.py runs before the suite) on one rank only,
    while the others wait: nothing is sent or received, and the compiled call runs after."""
    if world.Get_rank() == 0:
        mpi_fused.precompile(dtype)
    world.Barrier()
    x = (rng.standard_normal(6) * 100).astype(dtype)
    compile_call(comm, x)
    np.testing.assert_array_equal(comm.allreduce(x), expected(world, x, "sum"))


@pytest.mark.parametrize("dtype", [np.float16, np.uint8, np.dtype(">f4")])
def test_precompile_refuses_what_the_call_does_not_reduce(dtype):
    with pytest.raises(ValueError, match=r"float32/64 and int32/64; got"):
        mpi_fused.precompile(dtype)
