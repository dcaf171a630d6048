"""Top-k: the GPU (ringcomm/ops/_cuda_topk.py, on the CPU emulator and on a GPU) and NumPy select
the same entries, ties included, the GPU's sampled prefilter spares it the full select, and the
host never waits for the GPU.

Ties at the k-th largest magnitude go to the lowest indices on both sides (NumPy's argpartition
used to break them arbitrarily, so exact comparisons at n of about 1M failed now and then). Both
aim the sampled threshold at 1.5k; aimed at k, as the GPU's was, about half the calls found
fewer than k candidates and selected from the whole array. Which of those branches a call takes
is decided on the GPU (select_scan's plan): the tests read the plan the emulated kernels wrote,
force every branch, and check that no step of a call reads a device value on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import gpu_emulator
import numpy as np
import ops_twins as twins
import pytest

from ringcomm.ops import _cuda_runtime as rt
from ringcomm.ops import _cuda_source, _cuda_topk, _topk_plan
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


@pytest.fixture
def emulated() -> Iterator[tuple[gpu_emulator.Emulator, gpu_emulator.FakeCupy]]:
    """The emulator, installed for one test (so that the GPU tests below find CuPy's own)."""
    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir(), seed=17)
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator) as fake:
        yield emulator, fake


@pytest.fixture
def at_once() -> Iterator[tuple[gpu_emulator.Emulator, gpu_emulator.FakeCupy]]:
    """The top-k kernels on an emulator whose launches run 4 blocks at once, each on an OS
    thread of its own (cuda_emulation.h's RC_EMU_CONCURRENT): a tile looking back, or the last
    block of a histogram pass, meets blocks that are still running, as on a GPU. Installed for
    one test, as ``emulated`` (the library is built once and kept on disk): the GPU tests below
    must find CuPy's own."""
    try:
        emulator = gpu_emulator.build_kernels(
            gpu_emulator.cache_dir(), ["topk.cu"],
            list(_cuda_source.name_expressions("topk.cu")), seed=23, workers=4)
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator) as fake:
        yield emulator, fake


_SCAN_MODE, _SCAN_PLAN = 6, 10  # select_scan's arguments: mode, and the plan it writes
_COMPACT_PLAN = 8  # select_compact's argument: the plan it writes


@contextlib.contextmanager
def decided_plans(emulator: gpu_emulator.Emulator) -> Iterator[list[np.ndarray]]:
    """Collect the plans select_scan or select_compact decide on the (emulated) device, as
    int64[4]: candidates the exact selection goes on with (-1: the whole array), ka, kb, and
    the rows ja | jb << 32."""
    plans: list[np.ndarray] = []
    launch = emulator.launch

    def recording(name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        launch(name, grid, block, args)
        if name == "rc::select_scan" and int(args[_SCAN_MODE]):
            plans.append(np.array(args[_SCAN_PLAN], np.int64))
        if name == "rc::select_compact":
            plans.append(np.array(args[_COMPACT_PLAN], np.int64))

    emulator.launch = recording  # type: ignore[method-assign]
    try:
        yield plans
    finally:
        del emulator.launch


def _gradients(seed: int, n: int) -> np.ndarray:
    """Gradient-like float32 values: normal with a log-normal spread of scales."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)


def _same_as_numpy(fake: gpu_emulator.FakeCupy, x: np.ndarray, k: int, **kw: Any) -> None:
    idx, val = gpu.topk(fake.asarray(x), k, **kw)
    want_idx, want_val = ref.topk(x, k, **kw)
    np.testing.assert_array_equal(idx.get(), want_idx)
    np.testing.assert_array_equal(val.get().view(np.uint32), want_val.view(np.uint32))


def _full_selects(emulated, n: int, ratios: tuple[float, ...], seeds: range) -> tuple[int, int]:
    """(calls that fell back to a select over all n entries, calls), each result compared with
    NumPy's."""
    emulator, fake = emulated
    fallbacks = calls = 0
    for ratio in ratios:
        k = int(np.ceil(ratio * n))
        for seed in seeds:
            with decided_plans(emulator) as plans:
                _same_as_numpy(fake, _gradients(seed, n), k)
            assert len(plans) == 1
            fallbacks += int(plans[0][0] < 0)
            calls += 1
    return fallbacks, calls


@pytest.fixture(params=["two passes", "one pass"])
def compaction(request, monkeypatch) -> str:
    """How the exact path compacts its candidates: a counting pass and a writing pass, or one
    pass (select_compact, ops/_cuda_topk.py SINGLE_PASS)."""
    monkeypatch.setattr(_cuda_topk, "SINGLE_PASS", request.param == "one pass")
    return request.param


def test_gpu_prefilter_holds_the_top_k_on_gradients(emulated, compaction):
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


# --------------------------------------------------------- the branches the device decides
N_BRANCH, K_BRANCH = 40_000, 400
_STRIDE = _topk_plan.sample_plan(N_BRANCH, K_BRANCH, 0)[1]  # the sample: x[0::_STRIDE]


def _branch_data(case: str) -> np.ndarray:
    x = _gradients(0, N_BRANCH)
    if case == "all equal":  # every entry reaches any threshold
        x = np.where(np.arange(N_BRANCH) % 2 == 0, 0.5, -0.5).astype(np.float32)
    if case == "44 reach 100":  # the sample's 2nd largest magnitude
        x = (_gradients(1, N_BRANCH) * 1e-3).astype(np.float32)
        x[np.arange(42) * _STRIDE] = 100.0
        x[[1, 2]] = [np.nan, -np.inf]  # not sampled: 44 entries reach 100
    return x


BRANCHES = {
    # case: (data, candidates used?, patch)
    "candidates": ("gradients", True, None),
    "fewer than k reach": ("gradients", False, ("prefilter_rank", lambda n, k: max(1, k // 8))),
    "more than the room": ("gradients", False, ("candidate_room", lambda n, k: k)),
    "all reach": ("all equal", False, None),
    "exactly k reach": ("44 reach 100", True, ("prefilter_rank", lambda n, k: 44)),
}


@pytest.mark.parametrize("fused_pick", [True, False])
@pytest.mark.parametrize("case", list(BRANCHES))
def test_each_branch_matches_numpy(emulated, monkeypatch, compaction, case, fused_pick):
    """The exact path takes the branch the data calls for, decided on the device, and gives
    NumPy's selection on every one, each radix digit picked by select_hist's last block (the
    default) or by select_pick; the host enqueues the same launches on all of them."""
    monkeypatch.setattr(_cuda_topk, "FUSED_PICK", fused_pick)
    emulator, fake = emulated
    data, use, patch = BRANCHES[case]
    if patch is not None:
        module = _cuda_topk if patch[0] == "candidate_room" else _topk_plan
        monkeypatch.setattr(module, patch[0], patch[1])
    x = _branch_data(data)
    k = 44 if case == "exactly k reach" else K_BRANCH
    emulator.launches.clear()
    with decided_plans(emulator) as plans:
        _same_as_numpy(fake, x, k)
    assert len(plans) == 1
    reached = int(plans[0][0])
    assert (reached >= 0) == use, f"plan {plans[0]}"
    if case == "exactly k reach":
        assert reached == k
    names = [launch.name for launch in emulator.launches]
    assert names == _exact_sampled_launches(compaction)


_CANDIDATES = {"two passes": ["rc::select_count", "rc::select_scan", "rc::select_write"],
               "one pass": ["rc::select_compact"]}


def _exact_sampled_launches(compaction: str) -> list[str]:
    """The launches of an exact top-k that samples, whichever branch the device takes: three
    radix passes over the sample (each digit picked by select_hist's last block, or with
    FUSED_PICK off by a select_pick launch), the candidates compacted, three passes over them,
    the write."""
    select = (["rc::select_hist"] if _cuda_topk.FUSED_PICK
              else ["rc::select_hist", "rc::select_pick"]) * 3
    return [*select, "rc::sample_limits", *_CANDIDATES[compaction],
            *select, "rc::select_count", "rc::select_scan", "rc::select_write"]


@pytest.mark.parametrize("case", ["small", "candidates", "more than the room", "all reach",
                                  "one pass", "dgc"])
def test_digits_picked_in_select_hist_match_numpy(emulated, monkeypatch, case):
    """With FUSED_PICK the last block of each select_hist pass picks the digit (select_pick's
    work): NumPy's selection on every path (which each pass's pick decides, so the counter of
    finished blocks was left zero for the next pass), and no select_pick launch."""
    emulator, fake = emulated
    monkeypatch.setattr(_cuda_topk, "FUSED_PICK", True)
    monkeypatch.setattr(_cuda_topk, "SINGLE_PASS", case == "one pass")
    if case == "more than the room":
        monkeypatch.setattr(_cuda_topk, "candidate_room", lambda n, k: k)
    x = _branch_data("all equal" if case == "all reach" else "gradients")
    x = x[:3000] if case == "small" else x
    emulator.launches.clear()
    for seed in (1, 2):
        _same_as_numpy(fake, x, K_BRANCH, approximate=case == "dgc", seed=seed)
    names = [launch.name for launch in emulator.launches]
    assert "rc::select_pick" not in names
    passes = 3 if case in ("small", "dgc") else 6
    assert names.count("rc::select_hist") == 2 * passes


@contextlib.contextmanager
def recorded_compaction() -> Iterator[dict[str, Any]]:
    """What the exact path's first compaction (select_compact, or select_write after a count)
    wrote, through ringcomm's own launches, on the emulator or a GPU: its candidate buffers,
    filled with a sentinel just before it runs, the plan decided for them, and select_compact's
    limits, tile states and tile counter. Read them after the call."""
    seen: dict[str, Any] = {}
    launch = rt.launch

    def recording(name: str, blocks: int, args: tuple[Any, ...], threads: int = rt.BLOCK) -> None:
        if name in ("rc::select_compact", "rc::select_write") and "idx" not in seen:
            seen["idx"], seen["val"] = args[-2], args[-1]
            seen["idx"].fill(-7)
            seen["val"].fill(np.nan)
        if name == "rc::select_compact":
            seen.update(lims=args[2], states=args[5], next_tile=args[6], plan=args[8])
        if name == "rc::select_scan" and int(args[_SCAN_MODE]):
            seen["plan"] = args[_SCAN_PLAN]
        launch(name, blocks, args, threads)

    rt.launch = recording
    try:
        yield seen
    finally:
        rt.launch = launch


def _host(a: Any) -> np.ndarray:
    return np.asarray(a.get())


def poison_empty(monkeypatch, xp: Any) -> None:
    """Make ``xp.empty`` (the emulator's CuPy, or CuPy) fill what it returns with 0xA5 bytes: a
    buffer a kernel failed to write then holds no earlier call's right answer."""
    empty = xp.empty
    if getattr(empty, "poisons", False):
        return

    def poisoned(*args: Any, **kw: Any) -> Any:
        out = empty(*args, **kw)
        if out.size:
            out.reshape(-1).view(np.uint8).fill(0xA5)
        return out

    poisoned.poisons = True  # type: ignore[attr-defined]
    monkeypatch.setattr(xp, "empty", poisoned)


def _compacted(monkeypatch, dx: Any, x: np.ndarray, k: int, one_pass: bool,
               want: tuple[np.ndarray, np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(plan, candidate indices, candidate value bits) of one exact top-k of ``dx`` (a device
    copy of ``x``), the call's result checked against NumPy's (``want``, when computed
    already); with one pass, its tile states checked against the counts of x's tiles."""
    monkeypatch.setattr(_cuda_topk, "SINGLE_PASS", one_pass)
    poison_empty(monkeypatch, rt.cp())
    with recorded_compaction() as seen:
        idx, val = gpu.topk(dx, k)
    want_idx, want_val = ref.topk(x, k) if want is None else want
    np.testing.assert_array_equal(_host(idx), want_idx)
    np.testing.assert_array_equal(_host(val).view(np.uint32), want_val.view(np.uint32))
    plan = _host(seen["plan"])
    m = int(plan[0])
    assert m >= k, f"plan {plan}: the candidates were not used"
    cand_idx, cand_val = _host(seen["idx"])[:m], _host(seen["val"])[:m].view(np.uint32)
    assert np.all(np.diff(cand_idx) > 0), "candidates out of index order (or a gap)"
    if one_pass:
        _check_tile_states(x, int(_host(seen["lims"])[0]), _host(seen["states"]),
                           int(_host(seen["next_tile"])[0]))
    return plan, cand_idx, cand_val


def _one_pass_repeats_two(monkeypatch, dx: Any, x: np.ndarray, k: int, repeats: int) -> None:
    """The two passes once, then the one pass ``repeats`` times: the same plan and candidates
    each time."""
    want = ref.topk(x, k)
    two = _compacted(monkeypatch, dx, x, k, False, want)
    for _ in range(repeats):
        one = _compacted(monkeypatch, dx, x, k, True, want)
        for a, b in zip(two, one, strict=True):
            np.testing.assert_array_equal(a, b)


def _tile_counts(x: np.ndarray, lim: int) -> np.ndarray:
    """Keys at or above ``lim`` in each tile of x."""
    hit = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)) >= lim
    tiles = -(-x.size // _cuda_topk._TILE)
    padded = np.zeros(tiles * _cuda_topk._TILE, bool)
    padded[: x.size] = hit
    return padded.reshape(tiles, -1).sum(axis=1).astype(np.uint64)


def _check_tile_states(x: np.ndarray, lim: int, states: np.ndarray, next_tile: int) -> None:
    """Every tile published its prefix (or, with prefixes 0, every tile after the first its
    own count), and every tile was taken once."""
    counts = _tile_counts(x, lim)
    assert next_tile == counts.size
    prefix = np.uint64(2 << 32) | np.cumsum(counts)
    if _cuda_topk._LOOK_BACK_PREFIXES:
        np.testing.assert_array_equal(states, prefix)
    else:
        np.testing.assert_array_equal(states[0], prefix[0])
        np.testing.assert_array_equal(states[1:], np.uint64(1 << 32) | counts[1:])


def _tight_keys(n: int) -> tuple[np.ndarray, int]:
    """Keys in two first-pass bins, the upper one holding exactly k keys spread over every
    block (one in 97) across several later digits: a count lost or doubled anywhere changes
    the digit picked or what is still needed."""
    x = np.ones(n, np.float32)
    upper = np.arange(0, n, 97)
    x[upper] = 2.0 + (np.arange(upper.size) % 5).astype(np.float32)
    return x, int(upper.size)


def _select_states(xp: Any, monkeypatch, x: np.ndarray, k: int, fused: bool,
                   repeats: int) -> list[np.ndarray]:
    """The radix-select states (uint32[8]) of k-1, k, k+1 and 1 over x, each pass's digit
    picked by select_pick or by select_hist's last block; the histogram and the counter of
    finished blocks are zero after each selection."""
    monkeypatch.setattr(_cuda_topk, "FUSED_PICK", fused)
    poison_empty(monkeypatch, xp)
    dx = xp.asarray(x)
    states = []
    for _ in range(repeats):
        scratch = _cuda_topk._Scratch()
        for rank in (k - 1, k, k + 1, 1):
            states.append(_host(_cuda_topk._select(scratch, dx, 0, 1, x.size, rank)))
            assert not _host(scratch.hist).any() and int(_host(scratch.done)[0]) == 0
    return states


def test_select_hist_picks_the_digits_select_pick_picks(emulated, monkeypatch):
    x, k = _tight_keys(40_000)
    apart, fused = (_select_states(emulated[1], monkeypatch, x, k, f, 1) for f in (False, True))
    for a, b in zip(apart, fused, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("prefixes", [1, 0])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_one_pass_writes_the_two_passes_candidates(emulated, monkeypatch, prefixes, ratio):
    """select_compact over 74 tiles (the look-back reads 32 at a time) writes the candidates and
    the plan that the counting and writing passes write, in index order, with no gap, and leaves
    each tile's prefix published; with ``prefixes`` 0 (no tile but the first publishes its
    prefix) every look-back adds counts across 32-tile windows back to tile 0."""
    fake = emulated[1]
    monkeypatch.setattr(_cuda_topk, "_LOOK_BACK_PREFIXES", prefixes)
    x = _gradients(3, 74 * _cuda_topk._TILE - 5)
    k = int(np.ceil(ratio * x.size))
    dx = fake.asarray(x)
    two, one = (_compacted(monkeypatch, dx, x, k, one_pass) for one_pass in (False, True))
    for a, b in zip(two, one, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("prefixes", [1, 0])
def test_one_pass_with_blocks_at_once_writes_the_two_passes_candidates(at_once, monkeypatch,
                                                                       prefixes):
    """With 4 blocks running at once, tiles look back at tiles that have published nothing
    yet, or only their count: the same candidates, plan and tile states as the two passes, call
    after call (a look-back that did not wait for them gave a wrong result every call)."""
    fake = at_once[1]
    monkeypatch.setattr(_cuda_topk, "_LOOK_BACK_PREFIXES", prefixes)
    x = _gradients(8, 74 * _cuda_topk._TILE - 5)
    dx = fake.asarray(x)
    for k in (300, 30_000):
        _one_pass_repeats_two(monkeypatch, dx, x, k, 2)


def test_fused_pick_with_blocks_at_once_picks_select_pick_s_digits(at_once, monkeypatch):
    """With 4 blocks running at once, select_hist's last block picks each digit while the
    others may still be adding: the states select_pick leaves, selection after selection."""
    x, k = _tight_keys(100_000)
    apart = _select_states(at_once[1], monkeypatch, x, k, False, 1)
    fused = _select_states(at_once[1], monkeypatch, x, k, True, 3)
    for i, state in enumerate(fused):
        np.testing.assert_array_equal(state, apart[i % len(apart)])


@pytest.mark.parametrize("trial", range(4))
def test_look_back_reads_any_mix_of_published_states(emulated, trial):
    """The tiles before the first block runs hold a random mix of published counts and
    prefixes (as on a GPU, where a tile may look back while those before it are still
    running): every later tile writes its entries where the two passes would, the entries of
    the earlier tiles are left alone, the room cuts the writes, and the last tile's plan
    counts every tile."""
    fake = emulated[1]
    rng = np.random.default_rng(trial)
    tiles, first = 70, int(rng.integers(1, 60))
    n = tiles * _cuda_topk._TILE - 100
    x = _gradients(7 + trial, n)
    keys = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    lim = int(np.sort(keys)[-n // 50])
    counts = _tile_counts(x, lim)
    inclusive = np.cumsum(counts)
    total = int(inclusive[-1])
    states = np.where(rng.random(tiles) < 0.5, np.uint64(2 << 32) | inclusive,
                      np.uint64(1 << 32) | counts).astype(np.uint64)
    states[first:] = 0
    room = total + 3 if trial % 2 else int(inclusive[first + 5])
    k = total // 2
    cand_idx = fake.asarray(np.full(room, -7, np.int32))
    cand_val = fake.asarray(np.full(room, np.nan, np.float32))
    plan = fake.asarray(np.zeros(4, np.int64))
    next_tile = fake.asarray(np.array([first, 0], np.uint32))
    rt.launch("rc::select_compact", tiles - first,
              (fake.asarray(x), np.int64(n), fake.asarray(np.full(11, lim, np.uint32)),
               np.int64(room), np.int64(k), fake.asarray(states), next_tile, np.int32(1),
               plan, cand_idx, cand_val), threads=_cuda_topk._THREADS)
    selected = np.flatnonzero(keys >= lim)
    start, end = int(inclusive[first - 1]), min(room, total)
    got = _host(cand_idx)
    assert np.all(got[:start] == -7), "an earlier tile's entries were written"
    np.testing.assert_array_equal(got[start:end], selected[start:end])
    np.testing.assert_array_equal(_host(cand_val)[start:end].view(np.uint32),
                                  x[selected[start:end]].view(np.uint32))
    used = k <= total <= room and total < n
    np.testing.assert_array_equal(_host(plan)[:3], [total if used else -1,
                                                    total if used else 0, 0])


@pytest.mark.parametrize("data", ["gradients", "all equal", "44 reach 100"])
@pytest.mark.parametrize("k", [1, 60, 3000, 7000])
def test_dgc_plans_match_numpy(emulated, data, k):
    """DGC's halving and its count of non-finite entries, decided on the device."""
    emulator, fake = emulated
    x = _branch_data(data)
    with decided_plans(emulator) as plans:
        _same_as_numpy(fake, x, k, approximate=True, seed=k)
    assert len(plans) == 1


class _NoHostRead(gpu_emulator.DeviceArray):
    """A device array whose values the host may not read: what a real GPU would have to wait
    for (a copy to the host, a conversion to a Python number, a truth value)."""

    def _refuse(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("the host read a device value (a wait for the GPU)")

    get = item = tolist = __int__ = __float__ = __index__ = __bool__ = _refuse


@pytest.fixture
def no_host_reads(emulated, monkeypatch):
    """Make every array the emulated CuPy creates refuse host reads."""
    monkeypatch.setattr(gpu_emulator, "_dev", lambda x: x.view(_NoHostRead))
    return emulated


@pytest.mark.parametrize("case", ["small", "candidates", "all reach", "fewer than k reach",
                                  "dgc"])
def test_topk_never_waits_for_the_device(no_host_reads, monkeypatch, compaction, case):
    fake = no_host_reads[1]
    n = 3000 if case == "small" else N_BRANCH
    x = _branch_data("all equal" if case == "all reach" else "gradients")[:n]
    if case == "fewer than k reach":
        monkeypatch.setattr(_topk_plan, "prefilter_rank", lambda n, k: 1)
    idx, val = gpu.topk(fake.asarray(x), K_BRANCH, approximate=case == "dgc", seed=1)
    want_idx, want_val = ref.topk(x, K_BRANCH, approximate=case == "dgc", seed=1)
    np.testing.assert_array_equal(idx.view(np.ndarray), want_idx)
    np.testing.assert_array_equal(val.view(np.ndarray), want_val)
    with pytest.raises(AssertionError, match="the host read"):  # the one function that does
        gpu.sample_threshold(fake.asarray(np.abs(x)), K_BRANCH, 1)


def test_one_memset_per_call(emulated, monkeypatch, compaction):
    """A call zeroes one buffer: the histogram (and select_compact's tile states with it). The
    radix state needs none (the first pass ignores it), sample_limits zeroes the totals, and
    the candidates' selection reuses the histogram the sample's selection left zeroed."""
    fake = emulated[1]
    zeroed = []
    zeros = fake.zeros
    monkeypatch.setattr(fake, "zeros", lambda *a, **kw: zeroed.append(a) or zeros(*a, **kw))
    for approximate in (False, True):
        zeroed.clear()
        _same_as_numpy(fake, _gradients(5, N_BRANCH), K_BRANCH, approximate=approximate)
        assert len(zeroed) == 1


# ------------------------------------------------------------- select_hist, both ways
def _hist(xp: Any, x: np.ndarray, *, off: int = 0, stride: int = 1, aggregate: bool,
          prefix: int = 0, mask: int = 0, shift: int = 20, bits: int = 11,
          cand: np.ndarray | None = None) -> np.ndarray:
    """One select_hist pass over x[off::stride] (or the candidates, when given) on the device
    of ``xp`` (the emulator's CuPy, or CuPy); the histogram it adds up."""
    fake = xp
    m = len(range(off, x.size, stride))
    hist = fake.zeros(2048, np.uint32)
    state = fake.zeros(8, np.uint32)
    state[0], state[1] = prefix, mask
    dx = fake.asarray(x)
    plan = None
    dc = None
    if cand is not None:
        plan = fake.asarray(np.array([cand.size, 0, 0, 0], np.int64))
        dc = fake.asarray(cand)
    vec = int(stride == 1 and off == 0) | (2 if cand is not None else 0)
    rt.launch("rc::select_hist", 5,
              (dx, np.int64(off), np.int64(stride), np.int64(m), rt.NULL if dc is None else dc,
               rt.NULL if plan is None else plan, state, np.int32(shift), np.int32(bits),
               np.int32(mask == 0), hist, np.int32(vec), np.int32(aggregate), np.int64(1),
               rt.NULL))
    return fake.asnumpy(hist) if hasattr(fake, "asnumpy") else hist.get()


def _bincount(x: np.ndarray, prefix: int, mask: int, shift: int, bits: int) -> np.ndarray:
    keys = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    keys = keys[(keys & np.uint32(mask)) == prefix]
    out = np.zeros(2048, np.int64)
    out[: 1 << bits] = np.bincount((keys >> np.uint32(shift)) & np.uint32((1 << bits) - 1),
                                   minlength=1 << bits)
    return out


@pytest.mark.parametrize("aggregate", [True, False])
@pytest.mark.parametrize("data", ["gradients", "zeros", "uniform bits"])
def test_select_hist_counts_every_key_once(emulated, aggregate, data):
    """Warp-aggregated atomics (lanes of one digit add once) and plain ones give the same
    histogram: np.bincount's, over vectorised, strided and candidate entries, a first pass and
    a later one that counts only the keys matching the decided bits."""
    _check_hist(emulated[1], aggregate, data)


def _check_hist(xp: Any, aggregate: bool, data: str) -> None:
    rng = np.random.default_rng(11)
    n = 9_001
    if data == "gradients":
        x = _gradients(6, n)
    elif data == "zeros":
        x = np.zeros(n, np.float32)
        x[rng.choice(n, 50, replace=False)] = 1.0
    else:
        x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(_hist(xp, x, aggregate=aggregate),
                                  _bincount(x, 0, 0, 20, 11))
    np.testing.assert_array_equal(_hist(xp, x, off=3, stride=7, aggregate=aggregate),
                                  _bincount(x[3::7], 0, 0, 20, 11))
    np.testing.assert_array_equal(_hist(xp, x[:100], cand=x, aggregate=aggregate),
                                  _bincount(x, 0, 0, 20, 11))
    top = int(np.bincount((x.view(np.uint32) & 0x7FFFFFFF) >> 20).argmax()) << 20
    np.testing.assert_array_equal(
        _hist(xp, x, aggregate=aggregate, prefix=top, mask=0x7FF00000, shift=10, bits=10),
        _bincount(x, top, 0x7FF00000, 10, 10))


# ------------------------------------------------------------------------------ on a GPU
@pytest.fixture(scope="module")
def cupy_gpu() -> Any:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA GPU")
    except Exception as err:  # no driver
        pytest.skip(f"no CUDA GPU ({err})")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("fused_pick", [False, True])
@pytest.mark.parametrize("case", list(BRANCHES))
def test_each_branch_matches_numpy_on_the_gpu(cupy_gpu, monkeypatch, compaction, case,
                                              fused_pick):
    monkeypatch.setattr(_cuda_topk, "FUSED_PICK", fused_pick)
    data, _, patch = BRANCHES[case]
    if patch is not None:
        module = _cuda_topk if patch[0] == "candidate_room" else _topk_plan
        monkeypatch.setattr(module, patch[0], patch[1])
    x = _branch_data(data)
    k = 44 if case == "exactly k reach" else K_BRANCH
    for approximate in (False, True):
        idx, val = gpu.topk(cupy_gpu.asarray(x), k, approximate=approximate, seed=2)
        want_idx, want_val = ref.topk(x, k, approximate=approximate, seed=2)
        np.testing.assert_array_equal(cupy_gpu.asnumpy(idx), want_idx)
        np.testing.assert_array_equal(cupy_gpu.asnumpy(val).view(np.uint32),
                                      want_val.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("prefixes", [1, 0])
def test_one_pass_on_the_gpu_writes_what_two_passes_write(cupy_gpu, monkeypatch, prefixes):
    """On a GPU the tiles of select_compact run at once and look back at tiles still running:
    at 16 Mi entries (4096 tiles), under 32 tiles, and with the selected entries only in the
    last tiles, each call repeated, the same candidates (no gap: the buffers hold a sentinel
    before each call) and plan as the two passes, and every tile's state as its counts say,
    also when every look-back walks to tile 0."""
    monkeypatch.setattr(_cuda_topk, "_LOOK_BACK_PREFIXES", prefixes)
    late = _gradients(5, 1 << 22) * np.float32(1e-3)
    late[-3 * _cuda_topk._TILE:] *= np.float32(1e6)  # the top 1% all in the last 3 tiles
    cases = [(_gradients(4, 1 << 24), (0.001, 0.01, 0.1)),
             (_gradients(6, 20 * _cuda_topk._TILE + 77), (0.01, 0.1)),
             (late, (0.001, 0.002))]
    for x, ratios in cases:
        dx = cupy_gpu.asarray(x)
        for ratio in ratios:
            _one_pass_repeats_two(monkeypatch, dx, x, int(np.ceil(ratio * x.size)), 4)


@pytest.mark.gpu
def test_select_hist_picks_the_digits_select_pick_picks_on_the_gpu(cupy_gpu, monkeypatch):
    """A full wave of blocks adds to the histogram at once before the last picks: 64 Mi keys
    whose upper bin holds exactly k, 50 times, the same states as select_pick's."""
    x, k = _tight_keys(1 << 26)
    want = _select_states(cupy_gpu, monkeypatch, x, k, False, 1)
    fused = _select_states(cupy_gpu, monkeypatch, x, k, True, 50)
    for i, state in enumerate(fused):
        np.testing.assert_array_equal(state, want[i % len(want)])


@pytest.mark.gpu
@pytest.mark.parametrize("aggregate", [True, False])
@pytest.mark.parametrize("data", ["gradients", "zeros", "uniform bits"])
def test_select_hist_counts_every_key_once_on_the_gpu(cupy_gpu, aggregate, data):
    _check_hist(cupy_gpu, aggregate, data)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", [False, True])
def test_topk_returns_before_the_gpu_is_done(cupy_gpu, approximate):
    """The host enqueues a whole top-k without waiting: queued behind copies that keep the GPU
    busy for tens of milliseconds, the call returns while they still run."""
    x = cupy_gpu.asarray(_gradients(9, 1 << 20))
    gpu.topk(x, 10_000, approximate=approximate)  # compile and load first
    big = cupy_gpu.empty(1 << 28, np.float32)  # 1 GiB, copied 50 times
    other = cupy_gpu.empty_like(big)
    stream = cupy_gpu.cuda.get_current_stream()
    for _ in range(50):
        other.data.copy_from_device_async(big.data, big.nbytes, stream)
    busy = stream.record()
    idx, _ = gpu.topk(x, 10_000, approximate=approximate)
    still_busy = not busy.done
    stream.synchronize()
    assert still_busy, "top-k waited for the GPU"
    assert idx.size == 10_000
