"""Horovod's timeline under mpiexec: rank 0 writes it, and a real allreduce shows its phases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402
from torch_helpers import hvd  # noqa: E402

from ringcomm.core import trace  # noqa: E402
from ringcomm.torch.horovod import timeline  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="module")
def h():
    return hvd()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    """A timeline file per rank (only rank 0's is written)."""
    return tmp_path / "timeline.json"


@pytest.fixture(autouse=True)
def _stopped(h):
    yield
    timeline.stop_timeline()


def load(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return json.load(f)


def row_labels(events: list[dict[str, Any]], name: str) -> list[str]:
    """The labels of the spans on ``name``'s row, checking that each "B" has its "E"."""
    tids = [e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
            and e["args"]["name"] == name]
    assert len(tids) == 1, f"no single row named {name!r}"
    open_spans: list[str] = []
    labels = []
    for e in events:
        if e.get("tid") != tids[0] or e["ph"] not in "BE":
            continue
        if e["ph"] == "B":
            labels.append(e["name"])
            open_spans.append(e["name"])
        else:
            assert open_spans, "an E without its B"
            open_spans.pop()
    assert not open_spans
    return labels


def test_start_and_stop_write_a_file_on_rank_0(path):
    timeline.start_timeline(str(path), mark_cycles=True)
    tl = timeline.active()
    if RANK != 0:
        assert tl is None and trace.get_tracer() is None
        timeline.stop_timeline()
        assert not path.exists()
        return
    assert tl is not None and tl.mark_cycles
    tl.negotiate_start("allreduce.test_allreduce", "allreduce")
    tl.mark_cycle()
    tl.negotiate_end("allreduce.test_allreduce")
    timeline.stop_timeline()
    assert timeline.active() is None and trace.get_tracer() is None
    text = path.read_text()
    for needle in ("allreduce.test_allreduce", "start_time_since_epoch_in_micros",
                   "NEGOTIATE_ALLREDUCE", "CYCLE_START"):
        assert needle in text
    assert row_labels(json.loads(text), "allreduce.test_allreduce") == ["NEGOTIATE_ALLREDUCE"]


def test_restarting_keeps_one_file_and_a_new_file_stops_the_old(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    timeline.start_timeline(str(first))
    running = timeline.active()
    timeline.start_timeline(str(first), mark_cycles=True)  # the same file: it goes on
    assert timeline.active() is running
    if running is not None:
        assert running.mark_cycles
        running.start("allreduce.kept", "ALLREDUCE")
        running.end("allreduce.kept")
    timeline.start_timeline(str(second))
    if RANK == 0:
        assert running is not None and running.closed and timeline.active() is not running
        assert row_labels(load(first), "allreduce.kept") == ["ALLREDUCE"]
    timeline.stop_timeline()
    timeline.stop_timeline()  # nothing runs: nothing to do
    if RANK == 0:
        assert load(second)[0]["ph"] == "M"


@pytest.mark.parametrize("native, phases", [
    (False, ["RING_REDUCE_SCATTER", "RING_ALLGATHER"]),
    (True, ["MPI_ALLREDUCE"]),
])
def test_a_real_allreduce_shows_its_phases(comm, path, native, phases):
    """400 KB, larger than the inline slot of the agreement message (up to 64 KiB where
    every rank shares one node): the ring's two phases, or MPI's own allreduce where it takes
    arrays of that size (through the shared segment where every rank shares one node)."""
    saved = comm.transport.native_allreduce_bytes
    comm.transport.native_allreduce_bytes = 1 << 20 if native else 0
    comm._allreduce.plans.clear()  # a prepared repeat of an earlier test keeps its old path
    try:
        timeline.start_timeline(str(path))
        tl = timeline.active()
        x = np.full(100_000, RANK + 1, np.float32)
        if tl is not None:
            tl.start("allreduce.grad", "ALLREDUCE")
            with tl.executing(["allreduce.grad"]):
                y = comm.allreduce(x)
            tl.end("allreduce.grad")
        else:
            y = comm.allreduce(x)
        np.testing.assert_array_equal(y, np.full(100_000, comm.size * (comm.size + 1) / 2))
        timeline.stop_timeline()
    finally:
        comm.transport.native_allreduce_bytes = saved
        comm._allreduce.plans.clear()
    if RANK == 0:
        labels = row_labels(load(path), "allreduce.grad")
        if comm.size == 1:
            assert labels == ["ALLREDUCE"]  # one rank: nothing travels
        else:
            if native and comm.transport._shared:  # one node: through its shared segment
                phases = ["SHM_ALLREDUCE"]
            assert labels == ["ALLREDUCE", *phases]


def test_a_missing_directory_is_named_on_rank_0(tmp_path):
    missing = tmp_path / "missing" / "timeline.json"
    if RANK == 0:
        with pytest.raises(FileNotFoundError, match="missing"):
            timeline.start_timeline(str(missing))
    else:
        timeline.start_timeline(str(missing))  # other ranks write nothing
    assert timeline.active() is None
