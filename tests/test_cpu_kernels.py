"""The compiled CPU codecs (ringcomm.ops.cpu) give the NumPy reference's bits, and fall back to it.

Every output is compared byte for byte with ringcomm.ops.numpy's: payloads, decoded values and
error-feedback outputs, NaN payloads and the sign of zero included. Inputs mix gradient-like
values of every magnitude with NaN (quiet, signalling, with payloads, negative), +-Inf, -0.0,
subnormals, FLT_MAX and the values where fp16/bf16 rounding turns; outputs start as garbage,
so an element a kernel forgets to write shows.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringcomm import ops
from ringcomm.ops import _topk_plan as _plan
from ringcomm.ops import cpu
from ringcomm.ops import numpy as ref

# The bit-identity tests compare something only where the kernels compile; the switch and the
# fallback are tested everywhere.
needs_numba = pytest.mark.skipif(cpu.kernels() is None, reason="Numba is not usable here")

SPECIAL_BITS = [
    0x00000000, 0x80000000,  # +-0
    0x00000001, 0x807FFFFF, 0x00400000,  # subnormals
    0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # smallest normal, +-FLT_MAX
    0x03000000, 0x83800000,  # normal but below 127 / FLT_MAX: a block of these stays unsent
    0x7F800000, 0xFF800000,  # +-Inf
    0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFFFFFFF,  # quiet NaNs, with payloads
    0x7F800001, 0x7FA00000, 0xFF802000,  # signalling NaNs
    0x33000000, 0x33000001, 0x337FFFFF, 0x387FE000, 0x387FEFFF, 0x38800000,  # fp16 subnormal
    0x477FEFFF, 0x477FF000, 0x477FE000, 0x47800000,  # fp16 overflow boundary
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F7FFFFF,  # bf16 ties and near-ties
    0x3F801000, 0x3F803000, 0x3F800FFF,  # fp16 ties
]
BLOCKS = st.one_of(st.sampled_from([1, 2, 7, 64, 255, 256, 1000]), st.integers(1, 5000))
SEEDS = st.integers(0, 2**32 - 1)
# A base near 2**32 makes the counters of stochastic rounding wrap within the array.
BASES = st.one_of(st.integers(0, 1 << 20), st.integers(2**32 - 5000, 2**32 + 10))
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def values(draw: Any, n: int) -> np.ndarray:
    """``n`` float32 values of one magnitude class (subnormal to huge), specials written over
    some of them, sometimes a whole run of one special (blocks of nothing else)."""
    rng = np.random.default_rng(draw(SEEDS))
    scale = 10.0 ** draw(st.integers(-46, 38))
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(n) * scale).astype(np.float32)
    if n:
        bits = x.view(np.uint32)
        specials = st.one_of(st.sampled_from(SPECIAL_BITS), st.integers(0, 2**32 - 1))
        for i, value in draw(st.lists(st.tuples(st.integers(0, n - 1), specials), max_size=12)):
            bits[i] = value
        if draw(st.booleans()):
            lo = draw(st.integers(0, n - 1))
            bits[lo: lo + draw(st.integers(1, 600))] = draw(st.sampled_from(SPECIAL_BITS))
    return x


def arrays(max_size: int = 3000) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays of 0 to ``max_size`` elements, now and then a large one."""
    sizes = st.one_of(st.integers(0, 600), st.integers(0, max_size),
                      st.sampled_from([65_536, 100_003]))
    return sizes.flatmap(values)


def garbage(nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """An output filled with finite garbage (a missed write never looks right)."""
    return np.full(nbytes, 0x7B, np.uint8).view(dtype)


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.tobytes() != b.tobytes():
        wrong = np.flatnonzero(a.view(np.uint8) != b.view(np.uint8))
        raise AssertionError(f"{wrong.size} bytes differ, first at byte {wrong[0]}")


def run_both(call: Any, *shapes: tuple[int, Any]) -> None:
    """``call(module, *outputs)`` with fresh garbage outputs, under the reference and the
    compiled module; every output must be identical."""
    results = []
    for module in (ref, cpu):
        outs = [garbage(nbytes, dtype) for nbytes, dtype in shapes]
        with np.errstate(all="ignore"):  # the reference's overflow and Inf - Inf warnings
            call(module, *outs)
        results.append(outs)
    for a, b in zip(*results, strict=True):
        assert_same(a, b)


# -------------------------------------------------------------------------------------- int8
@needs_numba
@PROPERTY
@given(x=arrays(), block=BLOCKS, stochastic=st.booleans(), seed=SEEDS, base=BASES,
       with_error=st.booleans())
def test_int8_encode_matches_reference(x, block, stochastic, seed, base, with_error):
    n = x.size

    def encode(m, payload, error):
        m.int8_encode(x, payload, block, stochastic=stochastic, seed=seed, base=base,
                      error=error if with_error else None)

    run_both(encode, (ref.int8_nbytes(n, block), np.uint8), (4 * n, np.float32))


@needs_numba
@PROPERTY
@given(x=arrays(), block=BLOCKS, raw=st.booleans(), seed=SEEDS)
def test_int8_decode_matches_reference(x, block, raw, seed):
    n = x.size
    payload = _payload(x, block, raw, seed)
    run_both(lambda m, out: m.int8_decode(payload, out, block), (4 * n, np.float32))


@needs_numba
@PROPERTY
@given(x=arrays(), block=BLOCKS, raw=st.booleans(), stochastic=st.booleans(), seed=SEEDS,
       base=BASES, with_error=st.booleans(), data=st.data())
def test_int8_hop_matches_reference(x, block, raw, stochastic, seed, base, with_error, data):
    n = x.size
    payload = _payload(x, block, raw, seed)
    own = data.draw(values(n), label="own")

    def hop(m, out, error):
        m.int8_hop(payload, own, out, block, stochastic=stochastic, seed=seed, base=base,
                   error=error if with_error else None)

    run_both(hop, (payload.size, np.uint8), (4 * n, np.float32))


def _payload(x: np.ndarray, block: int, raw: bool, seed: int) -> np.ndarray:
    """An int8 payload of ``x``'s size: ``x`` encoded, or random bytes (any scale: negative,
    NaN with a payload, Inf; any q, -128 included)."""
    nbytes = ref.int8_nbytes(x.size, block)
    if raw:
        return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    payload = np.zeros(nbytes, np.uint8)
    ref.int8_encode(x, payload, block)
    return payload


@needs_numba
@pytest.mark.parametrize("clean", [True, False])
def test_int8_error_past_flt_max(clean):
    """127 * (FLT_MAX / 127) rounds to Inf: the error (-Inf) is zeroed, whether every block is
    finite or some block is not (zero, here), as the CUDA kernels do; a residual never holds
    Inf, which would make the next call's block NaN; so does the compiled path."""
    x = np.array([np.finfo(np.float32).max, 1.0, 0.0 if not clean else 2.0], np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(127) * (x[0] / np.float32(127)))
    payload = np.zeros(ref.int8_nbytes(3, 1), np.uint8)
    error = np.full(3, np.nan, np.float32)
    ref.int8_encode(x, payload, 1, error=error)
    assert error.tolist() == [0.0, 0.0, 0.0]
    run_both(lambda m, p, e: m.int8_encode(x, p, 1, error=e),
             (payload.size, np.uint8), (12, np.float32))
    run_both(lambda m, p, e: m.int8_hop(payload, np.zeros(3, np.float32), p, 1, error=e),
             (payload.size, np.uint8), (12, np.float32))


@needs_numba
def test_int8_hop_in_place():
    """A hop may write its payload over the one it received, as the reference allows."""
    rng = np.random.default_rng(0)
    x, own = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000)
    own = own.astype(np.float32)
    results = []
    for m in (ref, cpu):
        payload = np.zeros(ref.int8_nbytes(1000, 64), np.uint8)
        ref.int8_encode(x, payload, 64)
        m.int8_hop(payload, own, payload, 64)
        results.append(payload)
    assert_same(*results)


# ------------------------------------------------------------------------------------- casts
FORMATS = st.sampled_from(["f16", "bf16"])


@needs_numba
@PROPERTY
@given(x=arrays(), fmt=FORMATS, with_error=st.booleans())
def test_cast_encode_matches_reference(x, fmt, with_error):
    n = x.size

    def encode(m, payload, error):
        m.cast_encode(x, payload, fmt, error=error if with_error else None)

    run_both(encode, (ref.cast_nbytes(n), np.uint8), (4 * n, np.float32))


@needs_numba
@PROPERTY
@given(x=arrays(), fmt=FORMATS, with_error=st.booleans(), data=st.data())
def test_cast_hop_matches_reference(x, fmt, with_error, data):
    n = x.size
    payload = np.zeros(ref.cast_nbytes(n), np.uint8)
    payload[: 2 * n].view(np.uint16)[:] = data.draw(values(n)).view(np.uint32) >> 16
    run_both(lambda m, out, error: m.cast_hop(payload, x, out, fmt,
                                              error=error if with_error else None),
             (payload.size, np.uint8), (4 * n, np.float32))


@needs_numba
@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_cast_decode_every_word(fmt):
    words = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    run_both(lambda m, out: m.cast_decode(words, out, fmt), (4 << 16, np.float32))


@needs_numba
@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_cast_encode_sweep_of_float32(fmt):
    """Every 1021st float32 bit pattern: every exponent and sign, and (1021 being odd) every
    pattern of the low bits where fp16 and bf16 rounding turns; 4.2 million values."""
    x = (np.arange(0, 1 << 32, 1021, dtype=np.uint64).astype(np.uint32)).view(np.float32)
    run_both(lambda m, out: m.cast_encode(x, out, fmt), (2 * x.size, np.uint8))


@needs_numba
def test_cast_hop_in_place():
    rng = np.random.default_rng(1)
    x, own = (rng.standard_normal(1001).astype(np.float32) for _ in range(2))
    for fmt in ("f16", "bf16"):
        results = []
        for m in (ref, cpu):
            payload = np.zeros(ref.cast_nbytes(x.size), np.uint8)
            ref.cast_encode(x, payload, fmt)
            m.cast_hop(payload, own, payload, fmt)
            results.append(payload)
        assert_same(*results)


# ------------------------------------------------------------------------------------- top-k
@needs_numba
@PROPERTY
@given(n=st.one_of(st.integers(4096, 20_000), st.sampled_from([65_536, 100_003])),
       ratio=st.sampled_from([0.001, 0.01, 0.05, 0.2]), seed=SEEDS, ties=st.booleans(),
       approximate=st.booleans(), data=st.data())
def test_topk_matches_reference(n, ratio, seed, ties, approximate, data):
    """Indices and values, on the sampled paths: ties at the threshold (few distinct
    magnitudes) go to the lowest indices; non-finite entries always selected."""
    x = data.draw(values(n), label="x")
    if ties:  # magnitudes from a handful of values: the k-th largest is tied many times
        top = np.max(np.abs(x[np.isfinite(x)]), initial=np.float32(1))
        with np.errstate(all="ignore"):
            x = np.round(x * (np.float32(4) / top)).astype(np.float32)
    k = max(1, int(n * ratio))
    with np.errstate(all="ignore"):
        expected = ref.topk(x, k, approximate=approximate, seed=seed)
        got = cpu.topk(x, k, approximate=approximate, seed=seed)
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


@needs_numba
def test_topk_without_candidates_enough():
    """A sample that puts the threshold too high (every large entry off the sample's stride)
    leaves fewer than k candidates: the whole array is selected from, as the reference does."""
    n, k = 100_000, 2000
    x = np.ones(n, np.float32)
    off, stride, _, _ = _plan.sample_plan(n, _plan.prefilter_rank(n, k), 7)
    x[off::stride] = 2.0  # the sample sees only the 2.0s: threshold 2.0, which too few reach
    assert np.count_nonzero(x == 2.0) < k
    for a, b in zip(ref.topk(x, k, seed=7), cpu.topk(x, k, seed=7), strict=True):
        assert_same(a, b)


@needs_numba
def test_topk_with_more_candidates_than_room():
    """A threshold that every entry reaches (all magnitudes tied) passes more candidates than
    the kept buffers hold: the pass runs again with room, and the values returned are the
    entries' own bits (NaN payloads and -0.0 included)."""
    n, k = 100_000, 2000
    x = np.full(n, -1.0, np.float32)
    x[::3] = 1.0
    x[5] = np.float32(np.nan)
    x[7] = -0.0
    x.view(np.uint32)[11] = 0x7FC00123  # a NaN with a payload
    for a, b in zip(ref.topk(x, k, seed=3), cpu.topk(x, k, seed=3), strict=True):
        assert_same(a, b)


# ------------------------------------------------------------- what the kernels do not take
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_dtypes_run_the_reference(dtype):
    """Sources of another dtype and strided views give the reference's results."""
    rng = np.random.default_rng(2)
    base = rng.standard_normal(2 * 777).astype(dtype)
    for x in (base[:777], base[::2]):
        n = x.size
        run_both(lambda m, p, e, x=x: m.int8_encode(x, p, 64, error=e),
                 (ref.int8_nbytes(n, 64), np.uint8), (4 * n, np.float32))
        run_both(lambda m, p, x=x: m.cast_encode(x, p, "f16"), (ref.cast_nbytes(n), np.uint8))


def _frozen(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


@needs_numba
def test_read_only_inputs_run_the_reference():
    """Inputs the caller froze (a memory map, ``np.frombuffer`` of bytes) match no kernel's
    signature: they get the reference's results, never Numba's "No matching definition"."""
    rng = np.random.default_rng(5)
    n, block = 20_000, 64
    x = _frozen(rng.standard_normal(n).astype(np.float32))
    run_both(lambda m, p, e: m.int8_encode(x, p, block, error=e),
             (ref.int8_nbytes(n, block), np.uint8), (4 * n, np.float32))
    run_both(lambda m, p: m.cast_encode(x, p, "bf16"), (ref.cast_nbytes(n), np.uint8))
    payload = np.empty(ref.int8_nbytes(n, block), np.uint8)
    ref.int8_encode(rng.standard_normal(n).astype(np.float32), payload, block)
    received = _frozen(payload)
    run_both(lambda m, o: m.int8_decode(received, o, block), (4 * n, np.float32))
    run_both(lambda m, o: m.int8_hop(received, x, o, block), (ref.int8_nbytes(n, block), np.uint8))
    words = np.empty(ref.cast_nbytes(n), np.uint8)
    ref.cast_encode(rng.standard_normal(n).astype(np.float32), words, "f16")
    run_both(lambda m, o: m.cast_hop(_frozen(words), x, o, "f16"), (ref.cast_nbytes(n), np.uint8))
    for a, b in zip(ref.topk(x, 200, seed=1), cpu.topk(x, 200, seed=1), strict=True):
        assert_same(a, b)


def test_short_outputs_raise_like_the_reference():
    """An output too small is the reference's error, never a write past its end."""
    x = np.ones(1000, np.float32)
    for module in (ref, cpu):
        with pytest.raises(ValueError):
            module.int8_encode(x, np.zeros(100, np.uint8), 256)
        with pytest.raises(ValueError):
            module.cast_encode(x, np.zeros(100, np.uint8), "bf16")
        with pytest.raises(ValueError):
            module.cast_decode(np.zeros(100, np.uint8), x, "f16")


# ------------------------------------------------------------- the switch and the fallback
class _Records(logging.Handler):
    """Keeps the records of one logger (whatever RINGCOMM_LOG_LEVEL did to propagation)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize(("value", "expected"), [
    (None, cpu), ("numba", cpu), ("numpy", ref), (" NumPy ", ref)])
def test_switch_chooses_the_cpu_operations(monkeypatch, value, expected):
    monkeypatch.setitem(ops._loaded, "host", None)  # chosen again, restored afterwards
    if value is None:
        monkeypatch.delenv(ops.CPU_KERNELS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(ops.CPU_KERNELS_VARIABLE, value)
    assert ops.get(np.zeros(3, np.float32)) is expected


def test_switch_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setitem(ops._loaded, "host", None)  # chosen again, restored afterwards
    monkeypatch.setenv(ops.CPU_KERNELS_VARIABLE, "fortran")
    with pytest.raises(ValueError, match=r"RINGCOMM_CPU_KERNELS.*fortran"):
        ops.get(np.zeros(3, np.float32))


@needs_numba
def test_every_kernel_compiles():
    assert cpu.prepare()


def test_a_compile_failure_falls_back_once(monkeypatch):
    """A kernel that does not compile turns the compiled path off with one warning; every
    codec then runs the reference, with its results."""
    def broken(name: str) -> None:
        raise RuntimeError(f"LLVM cannot lower {name}")

    fake = SimpleNamespace(KERNELS={"int8_encode": None}, compile_kernel=broken)
    monkeypatch.setattr(cpu, "_STATE", {})
    monkeypatch.setattr(cpu, "_COMPILED", {})
    monkeypatch.setattr(cpu, "_import", lambda: fake)
    records = _Records()
    logger = logging.getLogger("ringcomm.ops.cpu")
    logger.addHandler(records)
    try:
        x = np.linspace(-3, 3, 1000, dtype=np.float32)
        for _ in range(3):
            run_both(lambda m, p: m.int8_encode(x, p, 64), (ref.int8_nbytes(1000, 64), np.uint8))
            run_both(lambda m, p: m.cast_encode(x, p, "bf16"), (ref.cast_nbytes(1000), np.uint8))
        assert cpu.kernels() is None and not cpu.prepare()
    finally:
        logger.removeHandler(records)
    assert [r.levelno for r in records.records] == [logging.WARNING]
    assert "LLVM cannot lower int8_encode" in records.records[0].getMessage()


_WITHOUT_NUMBA = """
import json, logging, sys
import numpy as np
sys.modules["numba"] = None  # as if it were not installed: importing it raises ImportError
from ringcomm import ops
from ringcomm.ops import numpy as ref
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("ringcomm.ops.cpu").addHandler(handler)
module = ops.get(np.zeros(1, np.float32))
x = np.linspace(-3, 3, 1000, dtype=np.float32)
same = []
for _ in range(2):
    for m in (module, ref):
        p = np.zeros(ref.int8_nbytes(1000, 64), np.uint8)
        m.int8_hop(p, x, p, 64)
        w = np.zeros(ref.cast_nbytes(1000), np.uint8)
        m.cast_encode(x, w, "f16")
        same.append(p.tobytes() + w.tobytes())
print(json.dumps({"module": module.__name__, "kernels": module.kernels() is not None,
                  "warnings": [r.getMessage() for r in records],
                  "same": len(set(same)) == 1}))
"""


def test_without_numba_the_reference_runs(subprocess_env):
    out = subprocess.run([sys.executable, "-c", _WITHOUT_NUMBA], env=subprocess_env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["module"] == "ringcomm.ops.cpu" and not result["kernels"]
    assert result["same"]
    assert len(result["warnings"]) == 1 and "import Numba failed" in result["warnings"][0]


_COMPILE_ONE = """
from ringcomm.ops import cpu
assert cpu.kernel("bf16_decode") is not None
"""


@needs_numba
def test_kernels_are_cached_on_disk(subprocess_env, tmp_path):
    """A kernel compiled in a fresh process lands in Numba's on-disk cache."""
    env = {**subprocess_env, "NUMBA_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _COMPILE_ONE], env=env, timeout=120, check=True)
    names = {p.suffix for p in tmp_path.rglob("*_cpu_codecs.bf16_decode*")}
    assert names == {".nbi", ".nbc"}
