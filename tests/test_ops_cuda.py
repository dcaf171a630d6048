"""Every ringcomm.ops.cuda operation against its NumPy twin, on a GPU and on the CPU emulator.

The "cuda" runs need CuPy and a CUDA GPU (marker ``gpu``; skipped without one) and use the
sizes 1, 255, 257 and 2**20 + 7. The "emulated" runs execute the same kernels and the same
Python code on the CPU (tests/gpu_emulator.py, with the GPU's float32 arithmetic and shuffled
block and thread orders) at sizes 1, 255, 257 and 4099, so they run in CI. Each test's data and
emulated orders are seeded from its name: a failure replays.
"""

from __future__ import annotations

import inspect
import math
import sys
import zlib

import numpy as np
import ops_twins as twins
import pytest

import ringcomm
from ringcomm.ops import cuda as gpu
from ringcomm.ops import numpy as ref

_BASE_DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")]


def _cuda_device() -> twins.Device:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA GPU")
    except Exception as err:  # no driver
        pytest.skip(f"no CUDA GPU ({err})")
    dtypes = list(_BASE_DTYPES)
    if twins.BF16 is not None:
        try:
            cupy.zeros(1, twins.BF16)
            dtypes.append(twins.BF16)
        except Exception:
            pass
    dev = twins.Device(cupy.asarray, cupy.asnumpy, cupy.empty, dtypes)
    dev.large, dev.sampled = 2**20 + 7, 1 << 22
    return dev


@pytest.fixture(scope="module", params=[pytest.param("cuda", marks=pytest.mark.gpu), "emulated"])
def dev(request: pytest.FixtureRequest):
    """The device under test: a real GPU through CuPy, or the CPU emulator."""
    if request.param == "cuda":
        yield _cuda_device()
        return
    import gpu_emulator

    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir())
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator) as fake:
        dtypes = [*_BASE_DTYPES, *([twins.BF16] if twins.BF16 is not None else [])]
        device = twins.Device(fake.asarray, lambda a: a.get(), fake.empty, dtypes)
        device.large, device.sampled = 4099, 12_000
        device.emulator = emulator
        yield device


@pytest.fixture(params=["1", "255", "257", "large"])
def n(request: pytest.FixtureRequest, dev: twins.Device) -> int:
    return dev.large if request.param == "large" else int(request.param)


@pytest.fixture
def rng(request: pytest.FixtureRequest, dev: twins.Device) -> np.random.Generator:
    """Fresh data per test, and on the emulator fresh block and thread orders, both reproducible
    from the test's name."""
    seed = zlib.crc32(request.node.nodeid.encode())
    emulator = getattr(dev, "emulator", None)
    if emulator is not None:
        emulator.reseed(seed)
    return np.random.default_rng(seed)


def test_copy(dev, rng, n):
    twins.check_copy(dev, rng, n)


def test_reduce(dev, rng, n):
    twins.check_reduce(dev, rng, n)


def test_divide(dev, rng, n):
    twins.check_divide(dev, rng, n)


def test_compensate_and_residuals(dev, rng, n):
    twins.check_compensate_and_residuals(dev, rng, n)


@pytest.mark.parametrize("nonfinite", ["few", "more than k"])
def test_sparse_residual_in_place(dev, rng, n, nonfinite):
    """The sparse ring's residual is written over the values it was selected from: only the
    groups holding NaN or Inf are written (no copy), with NumPy's bits, also when the selection
    is all non-finite and some are left over."""
    acc = twins.data(rng, n, np.float32)
    k = max(1, n // 10)
    if nonfinite == "more than k":
        acc[rng.choice(n, min(n, k + 2), replace=False)] = np.nan
    idx = ref.topk(acc, k)[0]
    want = acc.copy()
    ref.sparse_residual(want, idx, want)
    got = dev.put(acc)
    emulator = getattr(dev, "emulator", None)
    if emulator is not None:
        emulator.launches.clear()
    gpu.sparse_residual(got, dev.put(idx), got)
    twins.assert_bits(dev, got, want)
    if emulator is not None:
        assert [launch.name for launch in emulator.launches] == [
            "rc::zero_nonfinite_kernel<float>", "rc::scatter_zero_kernel"]


def test_uniform(dev, n):
    twins.check_uniform(dev, n)


def test_array_helpers(dev, rng, n):
    twins.check_arrays(dev, rng, n)


@pytest.mark.parametrize("block", [1, 3, 8, 256, 1000, 2048])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int8(dev, rng, n, block, stochastic):
    twins.check_int8(dev, rng, n, block, stochastic)


@pytest.mark.parametrize("lanes", [1, 2, 8])
@pytest.mark.parametrize("block", [8, 256, 2048])
def test_int8_is_the_same_whatever_runs_each_lane_holds(monkeypatch, dev, rng, n, block, lanes):
    """The team of lanes per quantization block (ops/_cuda_codecs.py RUNS_PER_LANE) changes
    how the kernel reads, never what it writes."""
    from ringcomm.ops import _cuda_codecs

    monkeypatch.setattr(_cuda_codecs, "RUNS_PER_LANE", lanes)
    twins.check_int8(dev, rng, n, block, stochastic=lanes == 2)


@pytest.mark.parametrize("block", [16, 64, 256, 512])
@pytest.mark.parametrize("offset, stochastic", [(0, False), (1, False), (0, True)])
def test_int8_without_error_on_both_load_paths(dev, rng, n, block, offset, stochastic):
    twins.check_int8_paths(dev, rng, n, block, offset, stochastic)


def test_int8_unaligned_payload(dev, rng, n):
    twins.check_int8_unaligned(dev, rng, n)


def test_unaligned_views(dev, rng, n):
    twins.check_unaligned_views(dev, rng, n)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_cast(dev, rng, n, fmt):
    twins.check_cast(dev, rng, n, fmt)


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("ratio", [0.001, 0.05, 0.3])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_topk(dev, rng, n, ratio, approximate, nonfinite):
    twins.check_topk(dev, rng, n, max(1, math.ceil(ratio * n)), approximate, nonfinite)


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("ratio", [0.0005, 0.02])
def test_topk_sampled(dev, rng, ratio, approximate):
    """Arrays large enough for the sampled threshold (and its halvings) to be used."""
    n = dev.sampled
    twins.check_topk(dev, rng, n, math.ceil(ratio * n), approximate, nonfinite=True)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.5])
def test_topk_counted_in_one_wave_is_the_same(monkeypatch, dev, rng, ratio):
    """select_count's blocks looping over the tiles (ops/_cuda_topk.py COUNT_WAVE) count what
    one block per tile counts."""
    from ringcomm.ops import _cuda_topk

    monkeypatch.setattr(_cuda_topk, "COUNT_WAVE", True)
    n = dev.sampled
    twins.check_topk(dev, rng, n, math.ceil(ratio * n), False, nonfinite=True)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_topk_compacted_in_two_passes_is_the_same(monkeypatch, dev, rng, ratio):
    """The exact path's candidates counted in one pass and written in another (ops/_cuda_topk.py
    SINGLE_PASS off; on, the default, each tile looks back at the counts of the tiles before
    it) select what one pass selects."""
    from ringcomm.ops import _cuda_topk

    monkeypatch.setattr(_cuda_topk, "SINGLE_PASS", False)
    n = dev.sampled
    twins.check_topk(dev, rng, n, math.ceil(ratio * n), False, nonfinite=True)
    twins.check_topk_gradients(dev, rng, n, math.ceil(ratio * n))


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_topk_with_digits_picked_by_select_pick_is_the_same(monkeypatch, dev, rng, ratio,
                                                             approximate):
    """Each radix pass's digit picked by a select_pick launch (ops/_cuda_topk.py FUSED_PICK
    off) instead of by select_hist's last block (the default): the same selections."""
    from ringcomm.ops import _cuda_topk

    monkeypatch.setattr(_cuda_topk, "FUSED_PICK", False)
    for n in (dev.large, dev.sampled):
        twins.check_topk(dev, rng, n, math.ceil(ratio * n), approximate, nonfinite=True)
    assert gpu.sample_threshold(dev.put(np.ones(dev.large, np.float32)), 3, 0) == 1.0


@pytest.mark.parametrize("ratio", [0.001, 0.1, 0.5])
def test_topk_overflow_is_marked_as_numpy_marks_it(dev, rng, n, ratio):
    twins.check_topk_overflow(dev, rng, n, max(1, math.ceil(ratio * n)))


@pytest.mark.parametrize("ratio", [0.001, 0.1, 0.5])
def test_topk_ties_go_to_the_lowest_indices(dev, rng, n, ratio):
    twins.check_topk_ties(dev, rng, n, max(1, math.ceil(ratio * n)))


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_topk_of_gradients_matches_numpy(dev, rng, ratio):
    """Arrays large enough for the sampled prefilter, with the repeated magnitudes of real
    float32 gradients."""
    twins.check_topk_gradients(dev, rng, dev.sampled, math.ceil(ratio * dev.sampled))


def test_sample_threshold(dev, rng, n):
    twins.check_sample_threshold(dev, rng, n)


@pytest.mark.parametrize("comp", [ringcomm.Int8(), ringcomm.Int8(block_size=100, stochastic=True),
                                  ringcomm.FP16(), ringcomm.BF16(), ringcomm.TopK(0.05)],
                         ids=repr)
def test_compressors_match_numpy(dev, rng, comp):
    """compress / decompress on device arrays give the NumPy path's payload and result."""
    x = twins.data(rng, 3000, np.float32, nonfinite=False).reshape(30, 100)
    want_payload, ctx = comp.compress(x)
    payload, device_ctx = comp.compress(dev.put(x))
    assert device_ctx == ctx
    np.testing.assert_array_equal(dev.get(payload), want_payload)
    twins.assert_same(dev, comp.decompress(payload, ctx), comp.decompress(want_payload, ctx))


# ----------------------------------------------------------------- no device needed
@pytest.mark.parametrize("r", [1, 3])
def test_low_rank_products(dev, rng, n, r):
    """PowerSGD's P Q^T and M - P Q^T: the same bits as NumPy (subnormals kept); the rank-local
    projection close to NumPy's (cuBLAS sums in its own order)."""
    rows = max(1, min(n, 257))
    cols = max(1, n // rows)
    pt = twins.data(rng, r * rows, nonfinite=False).reshape(r, rows)
    qt = twins.data(rng, r * cols, nonfinite=False).reshape(r, cols)
    want = np.empty((rows, cols), np.float32)
    ref.outer_sum(pt, qt, want)
    got = dev.poisoned((rows, cols), np.float32)
    gpu.outer_sum(dev.put(pt), dev.put(qt), got)
    twins.assert_bits(dev, got, want)
    mat = twins.data(rng, rows * cols, nonfinite=False).reshape(rows, cols)
    want = mat.copy()
    ref.subtract_outer(want, pt, qt)
    got = dev.put(mat)
    gpu.subtract_outer(got, dev.put(pt), dev.put(qt))
    twins.assert_bits(dev, got, want)
    want = np.empty((r, cols), np.float32)
    ref.matmul(pt, mat, want)
    got = dev.poisoned((r, cols), np.float32)
    gpu.matmul(dev.put(pt), dev.put(mat), got)
    np.testing.assert_allclose(dev.get(got), want, rtol=1e-4, atol=1e-4 * rows)


def _low_rank_call(rng: np.random.Generator, shapes: list[tuple[int, int, int]]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """A flat buffer of matrices (rows, cols, rank), their P^T and Q^T in two buffers, the
    tensors' table (offset, n, m, r, P at, Q at) and the most elements of one."""
    rows, at, p_at, q_at = [], 0, 0, 0
    for n, m, r in shapes:
        rows.append((at, n, m, r, p_at, q_at))
        at, p_at, q_at = at + n * m + 3, p_at + r * n + 1, q_at + r * m + 2  # gaps between
    mat = twins.data(rng, at, nonfinite=False)
    p = twins.data(rng, p_at, nonfinite=False)
    q = twins.data(rng, q_at, nonfinite=False)
    return mat, p, q, np.asarray(rows, np.int64), max(n * m for n, m, _ in shapes)


SHAPES = [(1, 1, 1), (7, 5, 2), (30, 41, 3), (257, 3, 1)]


def test_low_rank_products_of_every_tensor_at_once(dev, rng):
    """PowerSGD's one-launch passes: P Q^T and M - P Q^T of every tensor of a call have the
    bits of the per-tensor NumPy twins, and nothing between the tensors is written."""
    mat, p, q, table, longest = _low_rank_call(rng, SHAPES)
    table_dev = dev.put(table)
    want = np.full(mat.size, 9.0, np.float32)
    ref.outer_sum_parts(want, p, q, table, longest)
    got = dev.put(np.full(mat.size, 9.0, np.float32))
    gpu.outer_sum_parts(got, dev.put(p), dev.put(q), table_dev, longest)
    twins.assert_bits(dev, got, want)
    for at, n, m, r, po, qo in table.tolist():  # the twin is the per-tensor op
        one = np.empty((n, m), np.float32)
        ref.outer_sum(p[po: po + r * n].reshape(r, n), q[qo: qo + r * m].reshape(r, m), one)
        assert one.tobytes() == want[at: at + n * m].tobytes()
    want = mat.copy()
    ref.subtract_outer_parts(want, p, q, table, longest)
    got = dev.put(mat)
    gpu.subtract_outer_parts(got, dev.put(p), dev.put(q), table_dev, longest)
    twins.assert_bits(dev, got, want)
    gaps = np.ones(mat.size, bool)
    for at, n, m, *_ in table.tolist():
        gaps[at: at + n * m] = False
    assert (want[gaps] == mat[gaps]).all()


@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf, "large", "at the limit"])
def test_mark_dense_parts(dev, rng, bad):
    """A NaN, an Inf or an entry above FLT_MAX / (n ranks r) in one tensor's matrix marks that
    tensor's P^T (its first entry NaN) and no other; an entry at the bound is no mark."""
    ranks = 3
    mat, p, _, table, longest = _low_rank_call(rng, SHAPES)
    at, n, m, r = table[2, :4].tolist()
    limit = ref.dense_limit(n, ranks, r)
    mat[table[3, 0]:] = 3e38 / (table[3, 1] * ranks * table[3, 3]) / 2  # large, below it
    if bad == "large":
        mat[at + 5] = -np.nextafter(np.float32(limit), np.float32(np.inf))
    elif bad == "at the limit":
        below = np.float32(limit)
        below = below if float(below) <= limit else np.nextafter(below, np.float32(0))
        mat[at + 5] = below
    elif bad is not None:
        mat[at + n * m - 1] = bad
    marks = bad not in (None, "at the limit")
    for impl, put, get in ((ref, np.asarray, np.asarray), (gpu, dev.put, dev.get)):
        flags = put(p.copy())
        impl.mark_dense_parts(put(mat), flags, put(table), longest, ranks)
        flags = get(flags)
        marked = np.isnan(flags)
        assert marked.sum() == marks, impl.__name__
        assert not marks or marked[table[2, 4]]
        np.testing.assert_array_equal(flags[~marked], p[~marked])


@pytest.mark.parametrize("divisor", [0, 3])
@pytest.mark.parametrize("take", [False, True])
def test_dense_runs(dev, rng, take, divisor):
    """Runs copied (and divided) into another buffer, and back; taken ones zeroed at the
    source, nothing else touched."""
    src = twins.data(rng, 600, nonfinite=True)
    runs = np.asarray([(5, 0, 1), (10, 1, 300), (400, 301, 7)], np.int64)
    ref_src, ref_dst = src.copy(), np.full(310, 7.0, np.float32)
    ref.dense_runs(ref_dst, ref_src, runs, 300, take=take, divisor=divisor)
    got_src, got_dst = dev.put(src.copy()), dev.put(np.full(310, 7.0, np.float32))
    gpu.dense_runs(got_dst, got_src, dev.put(runs), 300, take=take, divisor=divisor)
    twins.assert_bits(dev, got_src, ref_src)
    # a quotient's NaN has the GPU's payload (kernels/common.cuh), a copy's the source's
    (twins.assert_same if divisor else twins.assert_bits)(dev, got_dst, ref_dst)
    want = np.concatenate([src[5:6], src[10:310], src[400:407]])
    if divisor:
        want = want / np.float32(divisor)
    np.testing.assert_array_equal(ref_dst[:308], want)
    assert (ref_dst[308:] == 7).all()
    moved = np.zeros(600, bool)
    moved[[5, *range(10, 310), *range(400, 407)]] = True
    assert (ref_src[moved] == 0).all() if take else ref_src.tobytes() == src.tobytes()
    assert ref_src[~moved].tobytes() == src[~moved].tobytes()


def _public_functions(module: object) -> dict[str, object]:
    return {name: fn for name, fn in vars(module).items()
            if inspect.isfunction(fn) and not name.startswith("_")
            and fn.__module__ == module.__name__}


def _shape(fn: object) -> list[tuple[str, object, object]]:
    """Parameter names, kinds and defaults (annotations differ: NumPy vs CuPy arrays)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_numpy_operation_has_a_cuda_twin():
    from ringcomm.ops import cuda
    from ringcomm.ops import numpy as reference

    for name, fn in _public_functions(reference).items():
        twin = getattr(cuda, name, None)
        assert callable(twin), f"ringcomm.ops.cuda has no {name}"
        assert _shape(twin) == _shape(fn), f"{name}: {inspect.signature(twin)} vs " \
                                           f"{inspect.signature(fn)}"
        assert name in cuda.__all__


def test_without_cupy_or_gpu_operations_say_what_to_install(monkeypatch):
    from ringcomm.ops import _cuda_runtime, cuda

    monkeypatch.setattr(_cuda_runtime, "_cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'ringcomm\[cuda12\]'"):
        cuda.empty((4,), np.float32)

    class NoDevice:
        class cuda:  # mirrors cupy.cuda.runtime
            class runtime:
                @staticmethod
                def getDeviceCount() -> int:
                    raise OSError("cudaErrorNoDevice")

    monkeypatch.setitem(sys.modules, "cupy", NoDevice)
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        cuda.zeros((4,), np.float32)


def test_residuals_follow_their_buffer_to_the_gpu_and_back(dev):
    """A DistributedOptimizer whose model moves to the GPU after its first steps keeps its
    buckets' cut (the Parameter objects stay): the residuals follow the buffer there, and
    back, values kept (the next call raised that the residual lives on another device)."""
    pytest.importorskip("torch")
    import ringcomm
    from ringcomm.ops import is_device_array
    from ringcomm.torch._residuals import ResidualLayouts

    ef = ringcomm.ErrorFeedback()
    layouts = ResidualLayouts(ef)
    layout = (("a", 0, 3), ("b", 3, 2))
    host = np.zeros(5, np.float32)
    layouts.align("b0", layout, host)
    ef.take("b0", host)[:] = [1, 2, 3, 4, 5]
    on_gpu = dev.put(np.zeros(5, np.float32))
    layouts.align("b0", layout, on_gpu)
    assert is_device_array(ef.residual("b0"))
    ef.check("b0", on_gpu)
    np.testing.assert_array_equal(dev.get(ef.residual("b0")), [1, 2, 3, 4, 5])
    layouts.align("b0", layout, lambda: host)
    assert not is_device_array(ef.residual("b0"))
    np.testing.assert_array_equal(ef.residual("b0"), [1, 2, 3, 4, 5])

