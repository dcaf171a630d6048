"""bench/kernels_perf.py's pieces that need no GPU, run on the CPU emulator: the loopback ring
rank that does a ring rank's kernel work alone, the count of launches per call, which the
GPU check reports next to each timing, the per-kernel breakdown, and bench/kernels_compare.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gpu_emulator
import numpy as np
import pytest

from ringcomm.ops import cuda as gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def perf() -> Any:
    spec = importlib.util.spec_from_file_location("kernels_perf", ROOT / "bench/kernels_perf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels_perf"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def emulated() -> Iterator[tuple[gpu_emulator.Emulator, gpu_emulator.FakeCupy]]:
    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir())
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.installed(emulator) as fake:
        yield emulator, fake


def test_work_counts_the_launches_of_a_call(perf, emulated):
    emulator, fake = emulated
    x = fake.asarray(np.random.default_rng(1).standard_normal(20_000).astype(np.float32))
    work = perf.Work(fake)
    emulator.launches.clear()
    counted = work.count(lambda: gpu.topk(x, 100))
    assert counted == {"launches": len(emulator.launches)}  # no pool hook, no busy probe
    # 2 selections of 3 passes (each digit picked by the histogram's last block),
    # sample_limits, the candidates compacted in one pass, then the final count/scan/write
    assert counted["launches"] == 11


def test_the_loopback_ring_rows_run(perf, emulated):
    """Every ring row runs on one rank of 4, its messages looped back (the layout here: one
    segment per chunk, 3 reduce-scatter and 3 allgather exchanges)."""
    fake = emulated[1]
    rows = perf.ring_rows(fake, 4 * 4096 * 2 + 5, 4, 0.01)
    assert [name.split(" n=")[0] for name, _, _ in rows] == [
        "ring int8 +feedback", "ring int8", "ring fp16 avg of fp16", "ring int8 +feedback",
        "ring int8", "ring fp16 avg of fp16", "ring topk +feedback"]
    assert [name.endswith(" host segments") for name, _, _ in rows] == [0, 0, 0, 1, 1, 1, 0]
    work = perf.Work(fake)
    launches = {}
    for name, nbytes, run in rows:
        assert nbytes > 0
        run(0)
        launches[name.split(" n=")[0]] = work.count(lambda run=run: run(1))["launches"]
    # int8 with feedback: compensate + encode first, compensate + hop at each of the 3 hops,
    # the owner's decode, a decode per allgather step (3); without feedback no compensation.
    assert launches["ring int8 +feedback"] == 2 + 6 + 1 + 3
    assert launches["ring int8"] == 1 + 3 + 1 + 3
    # A larger array: four segments a chunk on the device, 8 KiB segments (the host's rule
    # with these segment_bytes) 32 a chunk.
    rows = perf.ring_rows(fake, 4 * 4096 * 64, 4, 0.01, segment_bytes=8192)
    counts = {name: work.count(lambda run=run: run(1))["launches"] for name, _, run in rows}
    device, host = counts["ring int8 n=4"], counts["ring int8 n=4 host segments"]
    assert device == 4 * (1 + 3 + 1 + 3)
    assert host > 4 * device
    assert launches["ring topk +feedback"] > launches["ring int8 +feedback"]


def test_the_loopback_returns_what_was_sent(perf):
    t = perf.Loopback(3)
    send, recv = np.arange(10, dtype=np.float32), np.zeros(8, np.float32)
    t.isendrecv(send, 1, recv, 2).wait()
    np.testing.assert_array_equal(recv, np.arange(8))


def test_every_row_runs(perf, emulated):
    """Each benchmarked operation (on the emulator, at a small size) runs, and the counted ones
    report their launches."""
    fake = emulated[1]
    args = perf.parse_args(["-n", "20000", "--rotate", "1", "--ranks", "2"])
    rows = perf._kernels(fake, args, perf._inputs(fake, args), perf._shaped(fake, 20000))
    names = [name for name, *_ in rows]
    assert len(names) == len(set(names))
    work = perf.Work(fake)
    for name, nbytes, run, counted in rows:
        assert nbytes > 0, name
        run(0)
        if counted:
            assert work.count(lambda run=run: run(1))["launches"] >= 2, name


def test_the_topk_rows_say_where_their_time_goes(perf, emulated):
    """The top-k rows are followed by one row per kernel they launch (launch count and summed
    time of one call) and one for the call's time beyond its kernels."""
    fake = emulated[1]
    args = perf.parse_args(["-n", "20000", "--rotate", "1", "--ranks", "2"])
    rows = perf._kernels(fake, args, perf._inputs(fake, args), perf._shaped(fake, 20000))
    name, _, run, _ = next(r for r in rows if r[0].startswith("topk exact k="))
    run(0)
    parts = perf._breakdown_rows(fake, name, run)
    kernels = {r["kernel"].split(" / ")[1].rsplit(" x", 1)[0]: int(r["kernel"].rsplit("x", 1)[1])
               for r in parts[:-2]}
    work = perf.Work(fake).count(lambda: run(0))
    assert sum(kernels.values()) == work["launches"]
    assert kernels["rc::select_hist"] >= 3 and "rc::select_pick" not in kernels  # FUSED_PICK
    assert kernels["rc::select_compact"] == 1  # SINGLE_PASS
    assert parts[-2]["kernel"].endswith("beyond its kernels (host, copies)")
    assert parts[-1]["kernel"].endswith("host enqueue") and parts[-1]["us"] > 0
    assert all(r["us"] >= 0 for r in parts[:-2]) and all(r["bytes"] is None for r in parts)


def test_kernel_runs_compare_version_by_version(tmp_path):
    """bench/kernels_compare.py: per kernel the median over a version's runs, the launch counts
    dropped from the names, and each later version over the first."""
    spec = importlib.util.spec_from_file_location("kernels_compare",
                                                  ROOT / "bench/kernels_compare.py")
    assert spec is not None and spec.loader is not None
    kernels_compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels_compare)

    def run(path: str, rows: dict[str, float]) -> str:
        (tmp_path / path).write_text(json.dumps({"results": [
            {"kernel": k, "us": v} for k, v in rows.items()]}))
        return str(tmp_path / path)

    a = [run("a1.json", {"copy": 10.0, "topk [19 launches, 2 allocs]": 100.0}),
         run("a2.json", {"copy": 12.0, "topk [19 launches, 3 allocs]": 300.0}),
         run("a3.json", {"copy": 11.0, "topk [19 launches, 2 allocs]": 200.0})]
    b = [run("b1.json", {"copy": 11.0, "topk [18 launches, 2 allocs]": 100.0, "new": 5.0})]
    out = kernels_compare.table([("a", a), ("b", b)], "T").splitlines()
    assert out[2] == "| kernel | a (us) | b (us) | b / a |"
    assert "| copy | 11.0 | 11.0 | 1.00 |" in out
    assert "| topk | 200.0 | 100.0 | 0.50 |" in out
    assert "| new | - | 5.0 | - |" in out
