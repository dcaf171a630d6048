"""Compressors and their NumPy operations, in one process."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import ringcomm
from ringcomm.ops import numpy as ops


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    # crc32, not hash(): str hashes change with every process (PYTHONHASHSEED).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ----------------------------------------------------------------------------------- int8
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 4097])
@pytest.mark.parametrize("block", [1, 7, 256])
def test_int8_roundtrip_error_within_half_a_step(rng, n, block):
    x = rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 10)
    payload = np.full(ops.int8_nbytes(n, block), 0xAB, np.uint8)  # poisoned
    err = np.full(n, np.nan, np.float32)
    ops.int8_encode(x, payload, block, error=err)
    dec = np.full(n, np.nan, np.float32)
    ops.int8_decode(payload, dec, block)
    pad = -len(x) % block
    absmax = np.abs(np.concatenate([x, np.zeros(pad, np.float32)])).reshape(-1, block).max(1)
    step = np.repeat(absmax / 127, block)[:n]
    # Half a step, plus the float32 rounding of q * scale (an ulp or two of x).
    assert np.all(np.abs(dec - x) <= step / 2 + 2 * np.spacing(np.abs(x)))
    np.testing.assert_array_equal(err, x - dec)
    # The block maximum is represented exactly (q = +-127).
    for b in range(0, n, block):
        i = b + int(np.argmax(np.abs(x[b:b + block])))
        assert dec[i] == pytest.approx(x[i], rel=1e-6)


def test_int8_payload_layout():
    x = np.array([1.0, -2.0, 0.5, 4.0, 0.0], np.float32)
    payload = np.zeros(ops.int8_nbytes(5, 2), np.uint8)
    ops.int8_encode(x, payload, 2)
    assert payload.nbytes == 24  # 3 scales (12 B) + 5 int8, padded to 8
    scales = payload[:12].view(np.float32)
    np.testing.assert_allclose(scales, np.array([2.0, 4.0, 0.0]) / 127)
    np.testing.assert_array_equal(payload[12:17].view(np.int8), [64, -127, 16, 127, 0])


def test_int8_non_finite_block_decodes_to_nan():
    x = np.ones(12, np.float32)
    x[1], x[6] = np.nan, np.inf
    payload = np.zeros(ops.int8_nbytes(12, 4), np.uint8)
    err = np.empty(12, np.float32)
    ops.int8_encode(x, payload, 4, error=err)
    dec = np.empty(12, np.float32)
    ops.int8_decode(payload, dec, 4)
    assert np.isnan(dec[:8]).all() and np.all(dec[8:] == 1)
    assert np.isfinite(err).all()  # the residual never stores a NaN


def test_int8_stochastic_rounding_is_unbiased_and_seeded(rng):
    x = rng.uniform(-1, 1, 256).astype(np.float32)
    decoded = []
    for seed in range(400):
        payload = np.zeros(ops.int8_nbytes(256, 256), np.uint8)
        ops.int8_encode(x, payload, 256, stochastic=True, seed=seed)
        dec = np.empty(256, np.float32)
        ops.int8_decode(payload, dec, 256)
        decoded.append(dec)
    mean = np.mean(decoded, axis=0)
    step = np.abs(x).max() / 127
    assert np.abs(mean - x).max() < step * 0.2  # nearest rounding would be off by up to step/2
    assert np.abs(mean - x).mean() < step * 0.05
    a, b = (np.zeros(ops.int8_nbytes(256, 256), np.uint8) for _ in range(2))
    ops.int8_encode(x, a, 256, stochastic=True, seed=3)
    ops.int8_encode(x, b, 256, stochastic=True, seed=3)
    np.testing.assert_array_equal(a, b)


def test_uniform_is_independent_of_segmentation():
    whole = ops.uniform(7, 0, 1000)
    parts = np.concatenate([ops.uniform(7, 0, 300), ops.uniform(7, 300, 700)])
    np.testing.assert_array_equal(whole, parts)
    assert 0 <= whole.min() and whole.max() < 1 and abs(whole.mean() - 0.5) < 0.05


def test_int8_hop_is_decode_add_encode(rng):
    n, block = 1000, 64
    a, own = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    pa = np.zeros(ops.int8_nbytes(n, block), np.uint8)
    ops.int8_encode(a, pa, block)
    out, err = np.zeros_like(pa), np.zeros(n, np.float32)
    ops.int8_hop(pa, own, out, block, error=err)
    acc = np.empty(n, np.float32)
    ops.int8_decode(pa, acc, block)
    acc += own
    expect, expect_err = np.zeros_like(pa), np.zeros(n, np.float32)
    ops.int8_encode(acc, expect, block, error=expect_err)
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(err, expect_err)


# ----------------------------------------------------------------------------------- casts
def test_fp16_matches_numpy_cast(rng):
    x = (rng.standard_normal(1001) * 1e3).astype(np.float32)
    x[:3] = [7e4, -1e6, np.nan]  # overflow to +-inf, NaN stays NaN
    payload = np.zeros(ops.cast_nbytes(x.size), np.uint8)
    ops.cast_encode(x, payload, "f16")
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    np.testing.assert_array_equal(payload[: 2 * x.size].view(np.float16), expected)
    out = np.empty_like(x)
    ops.cast_decode(payload, out, "f16")
    np.testing.assert_array_equal(out, expected.astype(np.float32))


def test_bf16_rounds_to_nearest_even():
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7FC00001],
                    np.uint32)
    x = bits.view(np.float32)
    payload = np.zeros(ops.cast_nbytes(x.size), np.uint8)
    ops.cast_encode(x, payload, "bf16")
    words = payload[: 2 * x.size].view(np.uint16)
    # 1.0 exact; tie to even (down); tie to even (up); below the tie (down); overflow -> inf
    np.testing.assert_array_equal(words[:5], [0x3F80, 0x3F80, 0x3F82, 0x3F80, 0x7F80])
    out = np.empty_like(x)
    ops.cast_decode(payload, out, "bf16")
    assert np.isnan(out[5])


# ----------------------------------------------------------------------------------- top-k
SIZES = [(1, 1), (10, 3), (1000, 10), (100_000, 1000), (100_000, 60_000), (300_001, 3001)]


@pytest.mark.parametrize(("n", "k"), SIZES)
def test_topk_exact_selects_the_largest_magnitudes(rng, n, k):
    x = rng.standard_normal(n).astype(np.float32)
    idx, val = ops.topk(x, k, seed=5)
    assert idx.dtype == np.int32 and val.dtype == np.float32 and idx.size == k
    assert np.all(np.diff(idx) > 0)  # sorted, unique
    np.testing.assert_array_equal(val, x[idx])
    expected = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
    np.testing.assert_array_equal(idx, expected)


@pytest.mark.parametrize(("n", "k"), SIZES)
def test_topk_approximate_selects_large_magnitudes(rng, n, k):
    x = rng.standard_normal(n).astype(np.float32)
    idx, val = ops.topk(x, k, approximate=True, seed=5)
    assert idx.size == k and np.all(np.diff(idx) > 0)
    np.testing.assert_array_equal(val, x[idx])
    kth = np.sort(np.abs(x))[-k]
    assert np.abs(val).min() >= 0.25 * kth  # large entries, if not exactly the largest


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("n", [100, 100_000])
def test_topk_ranks_nan_and_inf_first(approximate, n):
    x = np.arange(n, dtype=np.float32)
    x[3], x[50] = np.nan, -np.inf
    idx, val = ops.topk(x, 3, approximate=approximate)
    assert 3 in idx and 50 in idx
    assert np.isnan(val[list(idx).index(3)]) and val[list(idx).index(50)] == -np.inf
    idx, val = ops.topk(x, 1, approximate=approximate)  # more non-finite entries than k
    assert not np.isfinite(val).any()


def test_topk_k_and_parameters():
    assert ringcomm.TopK(0.01).k_for(1000) == 10
    assert ringcomm.TopK(0.01).k_for(1001) == 11
    assert ringcomm.TopK(0.01).k_for(5) == 1
    assert ringcomm.TopK(0.3).k_for(0) == 0
    assert ringcomm.TopK(1.0).k_for(7) == 7


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ratio": 0}, r"ratio must be in \(0, 1\], got 0"),
    ({"ratio": 1.5}, r"ratio must be in \(0, 1\], got 1.5"),
    ({"ratio": "0.1"}, r"ratio must be in \(0, 1\]"),
    ({"algorithm": "tree"}, "unknown algorithm 'tree'; expected 'ring' or 'allgather'"),
])
def test_topk_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ringcomm.TopK(**kwargs)


@pytest.mark.parametrize("block", [0, -1, 2.5, True])
def test_int8_bad_block_size(block):
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        ringcomm.Int8(block_size=block)


# ---------------------------------------------------------------------- public compress API
@pytest.mark.parametrize("comp", [ringcomm.FP16(), ringcomm.BF16(), ringcomm.Int8(),
                                  ringcomm.Int8(block_size=3, stochastic=True),
                                  ringcomm.TopK(0.5)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_compress_decompress(rng, comp, dtype):
    x = rng.standard_normal((7, 9)).astype(dtype)
    payload, ctx = comp.compress(x)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    y = comp.decompress(payload, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = np.linalg.norm(y.astype(np.float64) - x) / np.linalg.norm(x.astype(np.float64))
    assert rel < (0.75 if isinstance(comp, ringcomm.TopK) else 0.02)


def test_compress_refuses_integers():
    with pytest.raises(TypeError, match="compression needs a floating dtype, got int32"):
        ringcomm.Int8().compress(np.ones(4, np.int32))


def test_compressor_equality_and_repr():
    assert ringcomm.Int8(128) == ringcomm.Int8(128) != ringcomm.Int8(64)
    assert repr(ringcomm.TopK(0.1, "allgather")) == (
        "TopK(ratio=0.1, algorithm='allgather', approximate=False)")
    assert ringcomm.Int8().shardable and ringcomm.FP16().shardable and ringcomm.TopK().shardable
    assert not ringcomm.PowerSGD().shardable


# ------------------------------------------------------------------------- error feedback
def test_error_feedback_bookkeeping():
    ef = ringcomm.ErrorFeedback()
    assert ef.residual("w") is None and len(ef) == 0
    r = ef.take("w", np.zeros(5))
    assert r.dtype == np.float32 and r.shape == (5,) and not r.any()
    assert ef.take("w", np.zeros(5)) is r
    assert "w" in ef and ef.names() == ["w"] and list(ef) == ["w"]
    with pytest.raises(ValueError, match="residual 'w' holds 5 elements but the tensor has 6"):
        ef.take("w", np.zeros(6))
    ef.reset("w")
    assert ef.residual("w") is None
    ef.take("a", np.zeros(1))
    ef.take("b", np.zeros(1))
    ef.reset()
    assert len(ef) == 0 and "0 residuals" in repr(ef)
