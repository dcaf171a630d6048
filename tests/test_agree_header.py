"""The agreement's header: what it compares without carrying it is compared by a digest in
which differing values that a checksum would confuse stay apart."""

from __future__ import annotations

import zlib

import numpy as np

from ringcomm.comm.agree import CallSpec
from ringcomm.core.types import ReduceOp


def _spec(shape: tuple[int, ...], extra: str = "") -> CallSpec:
    spec = CallSpec("allreduce")
    spec.set_array(np.empty(shape, np.float32))
    spec.set_op(ReduceOp.SUM)
    spec.extra = extra
    return spec


def _equal_crc32_names() -> tuple[str, str]:
    """Two names whose reprs have one CRC32 (found by the birthday bound, ~2^16 tries)."""
    seen: dict[int, str] = {}
    rng = np.random.default_rng(0)
    for _ in range(1 << 20):
        name = rng.bytes(8).hex()
        crc = zlib.crc32(repr(name).encode())
        if crc in seen:
            return seen[crc], name
        seen[crc] = name
    raise AssertionError("no pair found")


def test_trailing_dimensions_with_equal_crc32s_give_different_headers():
    for a, b in [((4, 38, 50), (597, 12, 1)), ((85, 679), (14874, 4))]:
        assert zlib.crc32(repr(a).encode()) == zlib.crc32(repr(b).encode())
        assert _spec((1, *a)).header(1 << 20) != _spec((1, *b)).header(1 << 20)


def test_names_with_equal_crc32s_give_different_headers():
    a, b = _equal_crc32_names()
    assert _spec((8,), a).header(1 << 20) != _spec((8,), b).header(1 << 20)


def test_equal_calls_give_equal_headers():
    assert _spec((3, 5), "x").header(1 << 20) == _spec((3, 5), "x").header(1 << 20)
    assert _spec((3, 5), "x").header(1 << 20) != _spec((3, 5), "y").header(1 << 20)
