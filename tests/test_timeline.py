"""The trace spans and Horovod's timeline in one process (the ranks as threads)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ringcomm.algorithms import ring, sparse  # noqa: E402
from ringcomm.algorithms.compressed_ring import allreduce as compressed_allreduce  # noqa: E402
from ringcomm.backends.threads import run_ranks  # noqa: E402
from ringcomm.codecs.int8 import Int8  # noqa: E402
from ringcomm.codecs.topk import TopK  # noqa: E402
from ringcomm.core import trace  # noqa: E402
from ringcomm.core.types import ReduceOp  # noqa: E402
from ringcomm.torch.horovod import timeline  # noqa: E402
from ringcomm.torch.horovod.timeline import Timeline  # noqa: E402

RING_PHASES = ["RING_REDUCE_SCATTER", "RING_ALLGATHER"]


class Recorder:
    """A tracer that keeps (thread, event, label) triples."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str]] = []

    def begin(self, label: str) -> None:
        self.calls.append((threading.get_ident(), "begin", label))

    def end(self, label: str) -> None:
        self.calls.append((threading.get_ident(), "end", label))


@pytest.fixture(autouse=True)
def _no_tracer_left():
    yield
    left = trace.get_tracer()
    trace.set_tracer(None)
    assert left is None, "a test left a tracer set"


def load(path: Path) -> list[dict[str, Any]]:
    """The events of a closed timeline, after checking that json.load reads the file."""
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list)
    return events


def rows(events: list[dict[str, Any]]) -> dict[str, list[tuple[int, str]]]:
    """Each named row's spans as (depth, label) in order; asserts that every "B" has its "E"
    on the same row, properly nested, with timestamps that never go back."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    stacks: dict[tuple[int, int], list[str]] = {}
    last: dict[tuple[int, int], float] = {}
    spans: dict[str, list[tuple[int, str]]] = {}
    for e in events:
        if e["ph"] not in "BE":
            continue
        row = (e["pid"], e["tid"])
        assert row in names, f"row {row} has no thread_name"
        assert e["ts"] >= last.get(row, 0.0), f"time goes back on {names[row]}"
        last[row] = e["ts"]
        stack = stacks.setdefault(row, [])
        if e["ph"] == "B":
            spans.setdefault(names[row], []).append((len(stack), e["name"]))
            stack.append(e["name"])
        else:
            assert stack, f"an E without its B on {names[row]}"
            stack.pop()
    assert all(not s for s in stacks.values()), f"spans left open: {stacks}"
    return spans


def labels(spans: list[tuple[int, str]]) -> list[str]:
    return [label for _, label in spans]


def allreduce_on_threads(n: int, traced: Any, fn: Any = None, length: int = 1000) -> None:
    """Run an allreduce on ``n`` thread ranks; rank 0 runs it inside ``traced()``."""
    fn = fn or (lambda t, x: ring.allreduce(t, x, x, ReduceOp.SUM, segment_bytes=512))

    def rank(t: Any) -> None:
        x = np.ones(length, np.float32)
        if t.rank == 0:
            with traced():
                fn(t, x)
        else:
            fn(t, x)

    run_ranks(n, rank)


# ---------------------------------------------------------------------- trace


def test_span_without_tracer_is_one_shared_noop():
    assert trace.get_tracer() is None
    off = trace.span("RING_ALLGATHER")
    assert trace.span("COMPRESS") is off
    with off as value:
        assert value is None


def test_span_calls_the_tracer_on_its_thread():
    recorder = Recorder()
    trace.set_tracer(recorder)
    try:
        with trace.span("A"), trace.span("B"):
            pass
    finally:
        trace.set_tracer(None)
    me = threading.get_ident()
    assert recorder.calls == [(me, "begin", "A"), (me, "begin", "B"), (me, "end", "B"),
                              (me, "end", "A")]


def test_span_ends_even_when_the_body_raises():
    recorder = Recorder()
    trace.set_tracer(recorder)
    try:
        with pytest.raises(RuntimeError), trace.span("A"):
            raise RuntimeError("boom")
    finally:
        trace.set_tracer(None)
    assert [c[1:] for c in recorder.calls] == [("begin", "A"), ("end", "A")]


@pytest.mark.parametrize("n", [2, 3])
def test_ring_marks_its_two_phases_once_per_call(n):
    recorder = Recorder()
    trace.set_tracer(recorder)
    try:
        allreduce_on_threads(n, lambda: trace.span("CALL"), length=5000)
    finally:
        trace.set_tracer(None)
    per_thread: dict[int, list[tuple[str, str]]] = {}
    for ident, what, label in recorder.calls:
        per_thread.setdefault(ident, []).append((what, label))
    assert len(per_thread) == n
    # Several segments per chunk (segment_bytes=512), still one span per phase.
    expected = [("begin", "RING_REDUCE_SCATTER"), ("end", "RING_REDUCE_SCATTER"),
                ("begin", "RING_ALLGATHER"), ("end", "RING_ALLGATHER")]
    for calls in per_thread.values():
        assert [c for c in calls if c[1] != "CALL"] == expected


def test_reduce_scatter_marks_only_its_phase():
    recorder = Recorder()
    trace.set_tracer(recorder)
    try:
        run_ranks(2, lambda t: ring.reduce_scatter(t, np.ones(100, np.float32), ReduceOp.SUM))
    finally:
        trace.set_tracer(None)
    assert {c[2] for c in recorder.calls} == {"RING_REDUCE_SCATTER"}


# ---------------------------------------------------------------------- Timeline


def test_timeline_writes_valid_json_with_named_rows(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    tl.negotiate_start("allreduce.w", "allreduce")
    tl.negotiate_start("broadcast.b", "broadcast")
    tl.negotiate_end("allreduce.w")
    tl.start("allreduce.w", "QUEUE")
    tl.end("allreduce.w")
    tl.start("allreduce.w", "ALLREDUCE", {"dtype": "float32", "shape": [3, 4]})
    tl.end("allreduce.w")
    tl.negotiate_end("broadcast.b")
    tl.close()
    events = load(path)
    meta = events[0]
    assert meta["ph"] == "M" and "start_time_since_epoch_in_micros" in meta["args"]
    spans = rows(events)
    assert spans == {"allreduce.w": [(0, "NEGOTIATE_ALLREDUCE"), (0, "QUEUE"), (0, "ALLREDUCE")],
                     "broadcast.b": [(0, "NEGOTIATE_BROADCAST")]}
    allreduce = next(e for e in events if e.get("name") == "ALLREDUCE")
    assert allreduce["args"] == {"dtype": "float32", "shape": [3, 4]}


def test_ring_phases_nest_inside_executing(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    names = ["allreduce.a", "allreduce.b"]  # fused: the phases go on both rows
    for name in names:
        tl.start(name, "ALLREDUCE")
    allreduce_on_threads(3, lambda: tl.executing(names))
    for name in names:
        tl.end(name)
    tl.close()
    spans = rows(load(path))
    assert set(spans) == set(names)  # the other ranks' threads recorded nothing
    for name in names:
        assert spans[name] == [(0, "ALLREDUCE"), (1, "RING_REDUCE_SCATTER"),
                               (1, "RING_ALLGATHER")]


def test_compressed_rings_show_their_phases(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    int8 = Int8(block_size=64)
    topk = TopK(ratio=0.1)

    def run(kind: str, fn: Any) -> None:
        allreduce_on_threads(2, lambda: tl.executing([kind]), fn)

    def out(x: np.ndarray) -> np.ndarray:
        return np.empty_like(x)

    run("int8", lambda t, x: compressed_allreduce(t, x, out(x), ReduceOp.SUM, int8, None, 1))
    run("topk.ring",
        lambda t, x: sparse.ring_allreduce(t, x, out(x), ReduceOp.SUM, topk, None, 1))
    run("topk.allgather",
        lambda t, x: sparse.allgather_allreduce(t, x, out(x), ReduceOp.SUM, topk, None, 1))
    tl.close()
    spans = rows(load(path))
    assert labels(spans["int8"]) == RING_PHASES
    assert labels(spans["topk.ring"]) == RING_PHASES
    assert labels(spans["topk.allgather"]) == ["COMPRESS", "DECOMPRESS"]


def test_without_a_timeline_nothing_is_recorded(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    assert trace.get_tracer() is not None  # a running timeline receives the spans ...
    tl.close()
    assert trace.get_tracer() is None  # ... and stops receiving them when closed
    size = path.stat().st_size
    with tl.executing(["allreduce.x"]):
        allreduce_on_threads(2, lambda: tl.executing(["allreduce.x"]))
    tl.start("allreduce.x", "ALLREDUCE")
    tl.negotiate_start("allreduce.x", "allreduce")
    tl.mark_cycle()
    tl.close()  # a second close does nothing
    assert path.stat().st_size == size
    assert rows(load(path)) == {}


def test_spans_outside_executing_are_not_recorded(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    allreduce_on_threads(2, lambda: trace.span("CALL"))
    tl.close()
    assert rows(load(path)) == {}


def test_negotiation_counts_the_first_submission_and_ignores_strays(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    tl.negotiate_end("allreduce.never_started")  # e.g. submitted before the timeline started
    tl.end("allreduce.never_started")
    tl.negotiate_start("allreduce.x", "allreduce")
    tl.negotiate_start("allreduce.x", "allreduce")
    tl.negotiate_end("allreduce.x")
    tl.negotiate_end("allreduce.x")
    tl.close()
    assert rows(load(path)) == {"allreduce.x": [(0, "NEGOTIATE_ALLREDUCE")]}


def test_closing_an_outer_span_keeps_the_row_nested(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    tl.start("allreduce.x", "ALLREDUCE")
    with tl.executing(["allreduce.x"]), trace.span("RING_ALLGATHER"):
        # The next operation under this name is submitted while this one still runs.
        tl.negotiate_start("allreduce.x", "allreduce")
    tl.end("allreduce.x")
    tl.negotiate_end("allreduce.x")
    tl.close()
    # NEGOTIATE was open inside RING_ALLGATHER, then inside ALLREDUCE, then alone: each
    # closing of an outer span ended it and opened it again one level up.
    assert rows(load(path))["allreduce.x"] == [
        (0, "ALLREDUCE"), (1, "RING_ALLGATHER"), (2, "NEGOTIATE_ALLREDUCE"),
        (1, "NEGOTIATE_ALLREDUCE"), (0, "NEGOTIATE_ALLREDUCE")]


def test_close_ends_what_is_still_open(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    tl.negotiate_start("allreduce.x", "allreduce")
    tl.start("allgather.y", "ALLGATHER")
    tl.start("allgather.y", "MEMCPY_IN_FUSION_BUFFER")
    tl.close()
    assert rows(load(path)) == {"allreduce.x": [(0, "NEGOTIATE_ALLREDUCE")],
                                "allgather.y": [(0, "ALLGATHER"),
                                                (1, "MEMCPY_IN_FUSION_BUFFER")]}


@pytest.mark.parametrize("mark", [False, True])
def test_cycles_are_marked_only_when_asked(tmp_path, mark):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0, mark_cycles=mark)
    tl.mark_cycle()
    tl.mark_cycle()
    tl.close()
    marks = [e for e in load(path) if e["ph"] == "i"]
    assert len(marks) == (2 if mark else 0)
    assert all(e["name"] == "CYCLE_START" and e["s"] == "g" for e in marks)


def test_two_threads_write_one_valid_file(tmp_path):
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    steps = 300
    barrier = threading.Barrier(2)

    def worker(k: int) -> None:
        barrier.wait()
        for i in range(steps):
            name = f"allreduce.t{k}.{i % 3}"
            tl.negotiate_start(name, "allreduce")
            tl.negotiate_end(name)
            tl.start(name, "ALLREDUCE")
            with tl.executing([name]), trace.span("RING_REDUCE_SCATTER"):
                pass
            tl.end(name)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    tl.close()
    spans = rows(load(path))
    assert len(spans) == 6
    for row in spans.values():
        assert len(row) == 3 * (steps // 3)  # three spans per operation
        assert labels(row)[:3] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "RING_REDUCE_SCATTER"]


def test_events_reach_the_file_before_close(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "_FLUSH_EVENTS", 8)
    path = tmp_path / "timeline.json"
    tl = Timeline(str(path), rank=0)
    for i in range(20):
        tl.start(f"allreduce.{i}", "ALLREDUCE")
        tl.end(f"allreduce.{i}")
    # An unterminated array until the end, as chrome://tracing and Perfetto accept.
    partial = json.loads(path.read_text() + "\n]")
    assert len(partial) > 8
    tl.close()
    assert len(rows(load(path))) == 20


def test_a_missing_directory_is_named(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "timeline.json"
    with pytest.raises(FileNotFoundError, match="no/such/dir"):
        Timeline(str(path), rank=0)
    assert trace.get_tracer() is None


# ---------------------------------------------------------------------- the environment


@pytest.fixture
def stopped():
    yield
    timeline._stop_at_exit()
    timeline._ACTIVE = None


def test_start_from_env_writes_on_rank_0_only(tmp_path, monkeypatch, stopped):
    path = tmp_path / "env.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    timeline.start_from_env(1)
    assert timeline.active() is None and not path.exists()
    timeline.start_from_env(0)
    tl = timeline.active()
    assert tl is not None and tl.mark_cycles and tl.path == str(path)
    tl.mark_cycle()
    timeline.stop_timeline()
    assert timeline.active() is None and trace.get_tracer() is None
    assert [e["name"] for e in load(path) if e["ph"] == "i"] == ["CYCLE_START"]


@pytest.mark.parametrize("value", ["", "DYNAMIC", "dynamic"])
def test_start_from_env_without_a_file_starts_nothing(monkeypatch, stopped, value):
    monkeypatch.setenv("HOROVOD_TIMELINE", value)
    timeline.start_from_env(0)
    assert timeline.active() is None


def test_start_from_env_names_a_missing_directory(tmp_path, monkeypatch, stopped):
    monkeypatch.setenv("HOROVOD_TIMELINE", str(tmp_path / "missing" / "t.json"))
    with pytest.raises(FileNotFoundError, match="missing"):
        timeline.start_from_env(0)
    assert timeline.active() is None
