"""Top-k: the GPU (ringcomm/ops/_cuda_topk.py, on the CPU emulator) and NumPy select the same
entries, ties included, and the GPU's sampled prefilter spares it the full select.

Ties at the k-th largest magnitude go to the lowest indices on both sides (NumPy's argpartition
used to break them arbitrarily, so exact comparisons at n of about 1M failed now and then). Both
aim the sampled threshold at 1.5k; aimed at k, as the GPU's was, about half the calls found
fewer than k candidates and selected from the whole array.
"""

from __future__ import annotations

from collections.abc import Iterator

import gpu_emulator
import numpy as np
import ops_twins as twins
import pytest

from ringcomm.ops import _topk_plan
from ringcomm.ops import cuda as gpu
from ringcomm.ops import numpy as ref

N_LARGE = 2**20 + 7


def _nan(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


def _ties(rng: np.random.Generator, n: int) -> np.ndarray:
    """Magnitudes from 17 levels (most entries tie with many others), a few non-finite ones:
    NaNs of different payloads and signs, +-Inf."""
    x = (rng.integers(-8, 9, n) * 0.25).astype(np.float32)
    if n > 16:
        spots = rng.choice(n, 6, replace=False)
        x[spots] = [_nan(0x7FC00000), _nan(0xFFC00001), _nan(0x7FC00001), np.inf, -np.inf,
                    np.inf]
    return x


@pytest.mark.parametrize("k", [1, 7, 1000, 30_000, N_LARGE // 3, N_LARGE - 5])
def test_numpy_breaks_ties_toward_the_lowest_indices(k):
    """At n of about 1M: through the sampled prefilter (k < n/4) and without it."""
    x = _ties(np.random.default_rng(k), N_LARGE)
    idx, val = ref.topk(x, k)
    np.testing.assert_array_equal(idx, twins.lowest_index_topk(x, k))
    np.testing.assert_array_equal(val.view(np.uint32), x[idx].view(np.uint32))
    again, _ = ref.topk(x, k, seed=12345)  # another sample: the same entries
    np.testing.assert_array_equal(again, idx)


def test_numpy_ties_on_small_arrays():
    rng = np.random.default_rng(5)
    for n in (1, 2, 33, 4095, 4096, 10_000):
        x = _ties(rng, n)
        for k in {1, max(1, n // 10), max(1, n // 2), n}:
            np.testing.assert_array_equal(ref.topk(x, k)[0], twins.lowest_index_topk(x, k))


@pytest.fixture(scope="module")
def emulated() -> Iterator[tuple[gpu_emulator.Emulator, gpu_emulator.FakeCupy]]:
    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir(), seed=17)
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator) as fake:
        yield emulator, fake


def _gradients(seed: int, n: int) -> np.ndarray:
    """Gradient-like float32 values: normal with a log-normal spread of scales."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)


def _full_selects(emulated, n: int, ratios: tuple[float, ...], seeds: range) -> tuple[int, int]:
    """(calls that fell back to a select over all n entries, calls), each result compared with
    NumPy's."""
    emulator, fake = emulated
    fallbacks = calls = 0
    for ratio in ratios:
        k = int(np.ceil(ratio * n))
        for seed in seeds:
            x = _gradients(seed, n)
            emulator.launches.clear()
            idx, val = gpu.topk(fake.asarray(x), k)
            want_idx, want_val = ref.topk(x, k)
            np.testing.assert_array_equal(idx, want_idx)
            np.testing.assert_array_equal(val, want_val)
            hist = [launch for launch in emulator.launches if launch.name == "rc::select_hist"]
            assert len(hist) in (3, 6)  # the sample's select, then the candidates' or all
            fallbacks += any(launch.args[3] == n for launch in hist)  # m: entries histogrammed
            calls += 1
    return fallbacks, calls


def test_gpu_prefilter_holds_the_top_k_on_gradients(emulated):
    fallbacks, calls = _full_selects(emulated, 40_000, (0.01, 0.05, 0.1), range(8))
    assert fallbacks == 0, f"{fallbacks} of {calls} calls selected from the whole array"


def test_a_threshold_aimed_at_k_falls_back_half_the_time(emulated, monkeypatch):
    """What the GPU did before: the count above can tell."""
    monkeypatch.setattr(_topk_plan, "prefilter_rank", lambda n, k: k)
    fallbacks, calls = _full_selects(emulated, 40_000, (0.01, 0.05, 0.1), range(8))
    assert fallbacks >= calls // 4, f"only {fallbacks} of {calls} fell back"


def test_gpu_ties_match_numpy(emulated):
    fake = emulated[1]
    for n, k in ((12_000, 100), (12_000, 4000), (50_000, 500)):
        x = _ties(np.random.default_rng(n + k), n)
        idx, val = gpu.topk(fake.asarray(x), k)
        np.testing.assert_array_equal(idx, twins.lowest_index_topk(x, k))
        np.testing.assert_array_equal(idx, ref.topk(x, k)[0])
        np.testing.assert_array_equal(val.view(np.uint32), x[idx].view(np.uint32))
