"""Horovod's timeline: what every named operation went through, as a Chrome trace.

``HOROVOD_TIMELINE=/path/timeline.json`` at ``hvd.init()``, or ``hvd.start_timeline(path)`` /
``hvd.stop_timeline()`` at any time, record a JSON file in the Trace Event Format that Perfetto
(ui.perfetto.dev) and chrome://tracing open. As in Horovod, only rank 0 writes it; negotiation
ends when every rank has submitted an operation, so rank 0's rows show the job's waits.

The file holds one process (``ringcomm rank 0``) with one row per operation name
(``allreduce.fc1.weight``, ``broadcast.noname.3``, ...), on which each operation shows:

- ``NEGOTIATE_<KIND>``: from its submission until every rank has submitted it;
- the activities the coordinator marks (``QUEUE``: ready until it starts; then the operation
  itself, ``ALLREDUCE`` for instance);
- nested in those, the phases the algorithms mark with :func:`ringcomm.core.trace.span` while
  the operation runs: ``RING_REDUCE_SCATTER``, ``RING_ALLGATHER``, ``MPI_ALLREDUCE`` (MPI's own,
  for mid-sized dense host arrays), ``SHM_ALLREDUCE`` (the same through the shared segment of
  ranks on one node), ``COMPRESS``, ``DECOMPRESS``.

``HOROVOD_TIMELINE_MARK_CYCLES=1`` (or ``mark_cycles=True``) adds a ``CYCLE_START`` mark across
all rows for every negotiation cycle. Timestamps are microseconds since the timeline started;
the first event's ``start_time_since_epoch_in_micros`` gives that start in wall-clock time.
Events are buffered and written in batches (at least once a second while they come); until the
timeline stops the file is an unterminated JSON array, which both viewers accept, and once it
stops (``stop_timeline``, or at the interpreter's exit) it is complete JSON.

Small dense allreduces (up to ``comm.inline_bytes``) travel inside the communicator's
agreement message, not through the ring, so they show no ring phases.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from ringcomm.core import trace
from ringcomm.core.log import get_logger
from ringcomm.torch.horovod import _basics

__all__ = ["ENV_MARK_CYCLES", "ENV_TIMELINE", "Timeline", "active", "env_problem",
           "start_from_env", "start_timeline", "stop_timeline"]

#: The timeline file to write from ``hvd.init()`` on (Horovod's variable; "DYNAMIC": none yet).
ENV_TIMELINE = "HOROVOD_TIMELINE"
#: Mark negotiation cycles in the timeline started from the environment ("1": yes).
ENV_MARK_CYCLES = "HOROVOD_TIMELINE_MARK_CYCLES"

_FLUSH_EVENTS = 4096  # buffered events that trigger a write
_FLUSH_SECONDS = 1.0  # ... as does this much time since the last write
_NEGOTIATE, _ACTIVITY, _SPAN = 0, 1, 2  # what opened an entry, hence what closes it

_log = get_logger("ringcomm.timeline")


class Timeline:
    """A timeline file being written: one row per operation name, spans nested per row.

    Every method may be called from any thread. Each row's spans stay properly nested in the
    file: closing a span that is not the row's innermost closes the ones inside it and reopens
    them, so every "B" event has its "E" on the same row.

    Args:
        path: the file to write (replaced if it exists).
        rank: this process's rank, the trace's process id.
        mark_cycles: record :meth:`mark_cycle` calls.

    Raises:
        FileNotFoundError: ``path``'s directory does not exist.
        OSError: the file cannot be created.

    Example::

        tl = Timeline("/tmp/timeline.json", rank=0)
        tl.negotiate_start("allreduce.w", "allreduce")
        tl.negotiate_end("allreduce.w")
        tl.start("allreduce.w", "ALLREDUCE")
        with tl.executing(["allreduce.w"]):
            comm.allreduce(x)  # RING_REDUCE_SCATTER, RING_ALLGATHER nested on the row
        tl.end("allreduce.w")
        tl.close()
    """

    def __init__(self, path: str, rank: int, mark_cycles: bool = False) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.rank = int(rank)
        self.mark_cycles = bool(mark_cycles)
        self._file: TextIO | None = _create(self.path)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._rows: dict[str, int] = {}
        self._open: dict[str, list[tuple[str, int, str]]] = {}  # name -> (label, kind, args)
        self._buffer: list[str] = []
        self._flushed = time.monotonic()
        self._t0 = time.perf_counter_ns()
        start = {"name": f"ringcomm rank {self.rank}",
                 "start_time_since_epoch_in_micros": time.time_ns() // 1000}
        self._file.write("[\n" + _meta("process_name", self.rank, None, start))
        self._emit(_meta("process_sort_index", self.rank, None, {"sort_index": self.rank}))
        self._tracer = _Tracer(self)
        trace.set_tracer(self._tracer)

    @property
    def closed(self) -> bool:
        """Whether the timeline has been closed (it records nothing more)."""
        return self._file is None

    # ------------------------------------------------------------------ the coordinator's calls
    def negotiate_start(self, name: str, kind: str) -> None:
        """Operation ``name`` was submitted on this rank: open ``NEGOTIATE_<KIND>`` on its row.

        A second call while ``name`` negotiates does nothing (the first submission counts).
        """
        with self._lock:
            if self._file is None or any(e[1] == _NEGOTIATE for e in self._open.get(name, ())):
                return
            self._begin(name, "NEGOTIATE_" + kind.upper(), _NEGOTIATE, "")

    def negotiate_end(self, name: str) -> None:
        """Every rank has submitted ``name``: close its negotiation (if one is open)."""
        with self._lock:
            self._close(name, lambda e: e[1] == _NEGOTIATE)

    def start(self, name: str, activity: str, args: dict[str, Any] | None = None) -> None:
        """Open ``activity`` (``"QUEUE"``, ``"ALLREDUCE"``, ...) on ``name``'s row.

        Args:
            name: the operation's name.
            activity: the span's label.
            args: shown with the span (JSON-encoded; values that JSON lacks as strings).
        """
        encoded = json.dumps(args, default=str) if args else ""
        with self._lock:
            if self._file is not None:
                self._begin(name, activity, _ACTIVITY, encoded)

    def end(self, name: str) -> None:
        """Close the innermost activity that :meth:`start` opened on ``name``'s row."""
        with self._lock:
            self._close(name, lambda e: e[1] == _ACTIVITY)

    @contextlib.contextmanager
    def executing(self, names: list[str]) -> Iterator[None]:
        """While inside, record the trace spans of this thread on the rows of ``names``.

        Args:
            names: the operations being run (several when fused).
        """
        local = self._local
        previous = getattr(local, "names", ())
        local.names = tuple(names)
        try:
            yield
        finally:
            local.names = previous

    def mark_cycle(self) -> None:
        """Mark the start of a negotiation cycle across all rows (only with ``mark_cycles``)."""
        if not self.mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._emit(f'{{"ph": "i", "name": "CYCLE_START", "s": "g", "pid": {self.rank}, '
                           f'"tid": 0, "ts": {self._now()}}}')

    def close(self) -> None:
        """End every open span, write what is buffered, complete the JSON and close the file.

        Calling it again does nothing.
        """
        if trace.get_tracer() is self._tracer:
            trace.set_tracer(None)
        with self._lock:
            if self._file is None:
                return
            ts = self._now()
            for name, entries in self._open.items():
                for _ in entries:
                    self._emit(self._event("E", name, ts=ts))
            self._open.clear()
            self._flush()
            if self._file is not None:
                try:
                    self._file.write("\n]\n")
                    self._file.close()
                except OSError as err:
                    _log.warning("timeline %s could not be completed: %s", self.path, err)
                self._file = None

    # ------------------------------------------------------------------ the trace's spans
    def _span_begin(self, label: str) -> None:
        """A trace span starts on this thread: open it on the rows this thread executes."""
        names = getattr(self._local, "names", None)
        if not names:
            return
        with self._lock:
            if self._file is not None:
                ts = self._now()  # one instant on every row of a fused operation
                for name in names:
                    self._begin(name, label, _SPAN, "", ts)

    def _span_end(self, label: str) -> None:
        """A trace span ends on this thread: close it on the rows this thread executes."""
        names = getattr(self._local, "names", None)
        if not names:
            return
        with self._lock:
            ts = self._now()
            for name in names:
                self._close(name, lambda e: e[1] == _SPAN and e[0] == label, ts)

    # ------------------------------------------------------------------ events
    def _now(self) -> str:
        return f"{(time.perf_counter_ns() - self._t0) / 1000:.3f}"

    def _row(self, name: str) -> int:
        tid = self._rows.get(name)
        if tid is None:
            tid = self._rows[name] = len(self._rows) + 1
            self._emit(_meta("thread_name", self.rank, tid, {"name": name}))
            self._emit(_meta("thread_sort_index", self.rank, tid, {"sort_index": tid}))
        return tid

    def _event(self, ph: str, name: str, label: str = "", args: str = "",
               ts: str | None = None) -> str:
        tid = self._row(name)
        text = f'{{"ph": "{ph}", "pid": {self.rank}, "tid": {tid}, "ts": {ts or self._now()}'
        if label:
            text += f', "name": {json.dumps(label)}'
        if args:
            text += f', "args": {args}'
        return text + "}"

    def _begin(self, name: str, label: str, kind: int, args: str,
               ts: str | None = None) -> None:
        self._open.setdefault(name, []).append((label, kind, args))
        self._emit(self._event("B", name, label, args, ts))

    def _close(self, name: str, which: Any, ts: str | None = None) -> None:
        """Close the innermost entry of ``name``'s row that ``which`` accepts; the entries
        inside it are closed first and reopened after, keeping the row nested."""
        entries = self._open.get(name)
        if self._file is None or not entries:
            return
        for i in range(len(entries) - 1, -1, -1):
            if which(entries[i]):
                break
        else:
            return
        ts = ts or self._now()
        inner = entries[i + 1:]
        for _ in range(len(entries) - i):
            self._emit(self._event("E", name, ts=ts))
        del entries[i:]
        for label, kind, args in inner:
            self._begin(name, label, kind, args, ts)

    def _emit(self, event: str) -> None:
        self._buffer.append(event)
        if len(self._buffer) >= _FLUSH_EVENTS or time.monotonic() - self._flushed > _FLUSH_SECONDS:
            self._flush()

    def _flush(self) -> None:
        if self._file is None or not self._buffer:
            return
        text = "".join(",\n" + e for e in self._buffer)
        self._buffer.clear()
        self._flushed = time.monotonic()
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as err:  # tracing must not break the job: stop recording instead
            _log.warning("timeline %s: writing failed, recording stops: %s", self.path, err)
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class _Tracer:
    """What a Timeline gives :func:`ringcomm.core.trace.set_tracer` (its own ``end`` ends an
    activity, not a span)."""

    __slots__ = ("begin", "end")

    def __init__(self, timeline: Timeline) -> None:
        self.begin, self.end = timeline._span_begin, timeline._span_end


def _missing_directory(path: str) -> FileNotFoundError | None:
    """The error of a timeline file ``path`` whose directory does not exist, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        return None
    return FileNotFoundError(f"timeline file {path!r}: directory {folder!r} does not exist")


def _create(path: str) -> TextIO:
    missing = _missing_directory(path)
    if missing is not None:
        raise missing
    return open(path, "w", encoding="utf-8")  # closed by Timeline.close


def _meta(what: str, pid: int, tid: int | None, args: dict[str, Any]) -> str:
    thread = "" if tid is None else f', "tid": {tid}'
    return f'{{"ph": "M", "name": "{what}", "pid": {pid}{thread}, "args": {json.dumps(args)}}}'


# ---------------------------------------------------------------------- the running timeline
_ACTIVE: Timeline | None = None
_LOCK = threading.Lock()
_AT_EXIT = False


def active() -> Timeline | None:
    """The running timeline of this process, or None (always None on ranks other than 0)."""
    return _ACTIVE


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a timeline into ``file_path`` (``hvd.start_timeline``).

    Only rank 0 writes a file; every rank may call this. A timeline already running into the
    same file goes on (with ``mark_cycles`` updated); one running into another file is stopped
    first, as in Horovod.

    Args:
        file_path: the JSON file to write (replaced if it exists).
        mark_cycles: mark every negotiation cycle (``CYCLE_START``).

    Raises:
        ValueError: ``hvd.init()`` has not been called.
        FileNotFoundError: the file's directory does not exist (on rank 0).

    Example::

        hvd.start_timeline("/tmp/timeline.json")
        hvd.allreduce(torch.ones(3), name="x")
        hvd.stop_timeline()  # open /tmp/timeline.json in ui.perfetto.dev
    """
    rank = _basics.rank()
    if rank == 0:
        _start(file_path, rank, mark_cycles)


def stop_timeline() -> None:
    """Stop the running timeline and complete its file (``hvd.stop_timeline``); without one,
    do nothing.

    Raises:
        ValueError: no timeline runs and ``hvd.init()`` has not been called (Horovod's error).
    """
    global _ACTIVE
    with _LOCK:
        timeline, _ACTIVE = _ACTIVE, None
    if timeline is not None:
        timeline.close()
    else:
        _basics.rank()


def start_from_env(rank: int) -> None:
    """Start the timeline ``HOROVOD_TIMELINE`` names, on rank 0 (called by ``hvd.init()``).

    Unset, empty or ``DYNAMIC`` (Horovod's value for "started later by start_timeline") start
    nothing. ``HOROVOD_TIMELINE_MARK_CYCLES`` set to 1 (or true, yes, on) marks the cycles.

    Args:
        rank: this process's rank.

    Raises:
        FileNotFoundError: the file's directory does not exist (on rank 0).
    """
    path = _env_path(rank)
    if path is None:
        return
    mark = os.environ.get(ENV_MARK_CYCLES, "").strip().lower() in ("1", "true", "yes", "on")
    _start(path, rank, mark)


def env_problem(rank: int) -> FileNotFoundError | None:
    """What would stop :func:`start_from_env` on ``rank``: the directory of the file
    ``HOROVOD_TIMELINE`` names missing on rank 0 (``hvd.init()`` raises it on every rank, where
    it would otherwise fail on rank 0 alone and leave the others waiting for it)."""
    path = _env_path(rank)
    missing = None if path is None else _missing_directory(path)
    return None if missing is None else FileNotFoundError(f"{ENV_TIMELINE}: {missing}")


def _env_path(rank: int) -> str | None:
    """The file ``HOROVOD_TIMELINE`` names for ``rank`` to write: rank 0's, unless unset,
    empty or ``DYNAMIC``; None otherwise."""
    path = os.environ.get(ENV_TIMELINE, "").strip()
    if rank != 0 or not path or path.upper() == "DYNAMIC":
        return None
    return path


def _start(file_path: str, rank: int, mark_cycles: bool) -> None:
    global _ACTIVE, _AT_EXIT
    path = os.path.abspath(os.fspath(file_path))
    with _LOCK:
        old = _ACTIVE
        if old is not None and old.path == path and not old.closed:
            old.mark_cycles = bool(mark_cycles)
            return
        if old is not None:
            old.close()
            _ACTIVE = None
        _ACTIVE = Timeline(path, rank, mark_cycles)
        if not _AT_EXIT:  # a job that never stops its timeline still leaves complete JSON
            atexit.register(_stop_at_exit)
            _AT_EXIT = True


def _stop_at_exit() -> None:
    timeline = _ACTIVE
    if timeline is not None:
        timeline.close()
