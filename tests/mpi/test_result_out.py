"""allgather and reduce_scatter writing into a given ``out``: the same bytes as without it,
in place as FSDP gathers (each rank's input a view of its own rows of out), and a bad out on
one rank refused with the same error on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import reference, same_on_all_ranks


def _rows(comm) -> list[int]:
    """Rows per rank: empty, one, both sides of the inline slot, large (FSDP-sized)."""
    return [0, 1, 7, comm.inline_bytes // 8 - 1, comm.inline_bytes // 8 + 3, 300_001]


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_allgather_into_out_matches_a_new_result(comm, world, rng, dtype):
    for rows in _rows(comm):
        x = (rng.standard_normal((rows, 2)) * 100).astype(dtype)
        out = np.full((comm.size * rows, 2), -1, dtype)
        got = comm.allgather(x, out=out)
        assert got is out
        np.testing.assert_array_equal(out, comm.allgather(x))
        np.testing.assert_array_equal(out, np.concatenate(world.allgather(x)))


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_allgather_out_may_have_any_shape_of_its_size(comm, world, shape):
    x = np.arange(4, dtype=np.float64) + 10 * comm.rank
    out = np.empty((comm.size, *shape))
    comm.allgather(x, out=out)
    np.testing.assert_array_equal(out.reshape(-1), np.concatenate(world.allgather(x)))


@pytest.mark.parametrize("n", [3, 5000, 1 << 18])
def test_allgather_in_place_from_its_own_rows(comm, world, rng, n):
    """Each rank's input is its own rows of out (FSDP's all_gather_copy_in): the result is
    every rank's input, as with separate buffers."""
    mine = rng.standard_normal(n).astype(np.float32)
    out = np.zeros(comm.size * n, np.float32)
    own = out[comm.rank * n:(comm.rank + 1) * n]
    own[...] = mine
    comm.allgather(own, out=out)
    np.testing.assert_array_equal(out, np.concatenate(world.allgather(mine)))
    assert same_on_all_ranks(world, out)


def test_reduce_scatter_into_out_matches_a_new_result(comm, world, rng):
    for n in (0, 1, comm.size + 1, 1000, 300_001):
        x = rng.standard_normal(n)
        lo, hi = comm.rank * n // comm.size, (comm.rank + 1) * n // comm.size
        out = np.full(hi - lo, np.nan)
        assert comm.reduce_scatter(x, out=out) is out
        np.testing.assert_array_equal(out, comm.reduce_scatter(x))
        np.testing.assert_allclose(out, reference(world, x, "sum")[lo:hi], rtol=1e-12,
                                   atol=1e-12)


def test_reduce_scatter_out_may_be_part_of_its_input(comm, world, rng):
    """out a view of x's own chunk (a reduce-scatter in place): written once the ring has
    read x."""
    n = 4096 * comm.size
    x = rng.standard_normal(n).astype(np.float32)
    ref = comm.reduce_scatter(x.copy(), op="max")
    chunk = x[comm.rank * 4096:(comm.rank + 1) * 4096].reshape(64, 64)
    comm.reduce_scatter(x, op="max", out=chunk)
    np.testing.assert_array_equal(chunk.reshape(-1), ref)


BAD_OUT = {
    "size": lambda shape, dt: np.empty(shape[0] + 1, dt),
    "dtype": lambda shape, dt: np.empty(shape, np.float64),
    "strided": lambda shape, dt: np.empty(2 * shape[0], dt)[::2],
    "read-only": lambda shape, dt: np.frombuffer(bytes(shape[0] * 4), dt),
}


@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("bad", list(BAD_OUT))
def test_a_bad_out_on_one_rank_raises_everywhere(comm, world, collective, bad):
    """One rank's out cannot take the result: every rank raises the same error, naming that
    rank, before anything moves, and the next call is in step."""
    if comm.size < 2:
        pytest.skip("needs at least 2 ranks")
    n = 1000 * comm.size
    x = np.ones(n, np.float32)
    shape = (n * comm.size,) if collective == "allgather" else (n // comm.size,)
    last = comm.rank == comm.size - 1
    out = BAD_OUT[bad](shape, np.float32) if last else np.empty(shape, np.float32)
    with pytest.raises((TypeError, ValueError)) as caught:
        getattr(comm, collective)(x, out=out)
    messages = world.allgather((type(caught.value).__name__, str(caught.value)))
    assert all(m == messages[0] for m in messages), messages
    assert f"rank {comm.size - 1}" in messages[0][1] and "out" in messages[0][1], messages
    np.testing.assert_array_equal(comm.allgather(np.full(2, comm.rank)),
                                  np.repeat(np.arange(comm.size), 2))
