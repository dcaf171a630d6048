"""NCCL failure handling: polled waits, ncclCommAbort on an error or the timeout, and refusal.

Without a GPU these run on stand-ins of CuPy and NCCL (tests/test_device_standins.py): a
*stuck* GPU never completes its work, as when a peer died under a spinning NCCL kernel, and a
blocking synchronize on it fails the test instead of hanging it. The stand-in communicator
reports scripted asynchronous errors and records ``ncclCommAbort``. What is tested is the
backend's own logic: it polls instead of blocking, gives up at the timeout or on an error,
aborts, raises an error naming the collective and NCCL's words, ends the job when asked to,
and refuses every later call.

With a GPU (marker ``gpu``), the real NCCL at one rank: a wait that cannot complete (a kernel
that spins for seconds holds the stream) must end at the communicator's timeout with
``ncclCommAbort``, and a healthy communicator reports no asynchronous error. An asynchronous
error cannot be provoked at one rank (there is no peer to lose); a job of two processes on two
GPUs, one of which exits, checks that path where two GPUs are visible.
"""

from __future__ import annotations

import gc
import json
import math
import re
import subprocess
import sys
import textwrap
import threading
import time
import types
import weakref
from typing import Any

import numpy as np
import pytest
from test_device_standins import (
    FakeCupy,
    FakeGPU,
    FakeNCCLComm,
    _FakeLib,
    standin_transport,
)

import ringcomm
from ringcomm.backends import _nccl_lib, _nccl_setup, _nccl_wait, nccl
from ringcomm.backends._nccl_wait import NCCLAsyncError, Stall, poll
from ringcomm.backends.nccl import NCCLTransport
from ringcomm.comm.base import Communicator
from ringcomm.ops import _cuda_runtime

TIMEOUT = 0.3  # the stand-in communicators' timeout, in seconds


# ------------------------------------------------------------------------------- poll()
class _Clock:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_poll_returns_when_the_work_is_done():
    clock, polls = _Clock(), iter([False, False, True])
    assert poll(lambda: next(polls), lambda: 0, 10.0, clock=clock, sleep=clock.sleep) is None
    assert len(clock.sleeps) == 2


def test_poll_ends_on_an_asynchronous_error_and_ignores_in_progress():
    clock, codes = _Clock(), iter([0, _nccl_lib.IN_PROGRESS, 0, 6])
    stall = poll(lambda: False, lambda: next(codes), math.inf, clock=clock, sleep=clock.sleep)
    assert stall == Stall(6, clock.now) and len(clock.sleeps) == 3


def test_poll_ends_at_the_timeout_with_short_growing_pauses():
    clock = _Clock()
    stall = poll(lambda: False, lambda: 0, 2.0, clock=clock, sleep=clock.sleep)
    assert stall is not None and stall.code == 0 and stall.elapsed == pytest.approx(2.0)
    assert clock.sleeps[0] == pytest.approx(20e-6)
    assert clock.sleeps == sorted(clock.sleeps[:-1]) + clock.sleeps[-1:]  # growing, then the rest
    assert max(clock.sleeps) <= 1e-3  # a failure is seen within a millisecond
    assert len(clock.sleeps) < 2.0 / 1e-3 + 20  # and a long wait costs no core


def test_poll_sees_work_that_completes_at_the_deadline():
    clock = _Clock()
    assert poll(lambda: clock.now >= 1.0, lambda: 0, 1.0, clock=clock, sleep=clock.sleep) is None


# ------------------------------------------------------------------ the real bindings
def test_the_real_library_binds_abort_and_async_error():
    """libnccl.so.2 loads without a GPU: ncclCommGetAsyncError and ncclCommAbort are bound
    with their prototypes, and answer a null communicator as NCCL does (invalid argument;
    nothing to abort), so the calls reach the library with the right arguments."""
    try:
        lib = _nccl_lib.load()
    except RuntimeError as err:
        pytest.skip(f"no NCCL library: {err}")
    assert "ncclCommAbort" in lib.fn and "ncclCommGetAsyncError" in lib.fn
    null = _nccl_lib.NCCLComm(lib, None, 0, 1)
    assert null.async_error() == 4  # ncclInvalidArgument: "comm argument is NULL"
    null.abort()  # ncclSuccess
    assert "remote process exited" in null.describe(6)


# --------------------------------------------------------------- a transport on stand-ins
@pytest.fixture
def gpu():
    return FakeGPU()


@pytest.fixture
def transport(gpu):
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=2, timeout=TIMEOUT)
    yield t
    gpu.stuck = False
    t.close()


def _refuses_everything(comm: Communicator) -> None:
    """Every call raises the RuntimeError of an aborted communicator, at once."""
    cupy = comm.transport.cupy
    with cupy.cuda.Device(2):
        dx = cupy.zeros(4096, np.float32)
    calls = [lambda: comm.allreduce(np.ones(3, np.float32)),
             lambda: comm.allreduce(dx), lambda: comm.barrier(),
             lambda: comm.broadcast(np.ones(3)), lambda: comm.allgather(np.ones(3)),
             lambda: comm.reduce_scatter(np.ones(4)), lambda: comm.sendrecv(dx, 0, dx, 0),
             lambda: comm.transport.isendrecv(dx, 0, dx, 0),
             lambda: comm.transport.split(0, 0)]
    for call in calls:
        with pytest.raises(RuntimeError, match="aborted after an earlier failure"):
            call()


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_stuck_wait_times_out_aborts_and_the_communicator_refuses_calls(gpu, transport,
                                                                         check):
    comm = Communicator(transport, consistency_check=check)
    comm.barrier()  # healthy: polled, never a blocking synchronize
    assert gpu.blocking_syncs == 0
    gpu.stuck = True
    start = time.monotonic()
    with pytest.raises(ringcomm.CollectiveTimeoutError) as info:
        comm.transport.barrier()  # the transport's own barrier waits for the GPU
    elapsed = time.monotonic() - start
    assert TIMEOUT <= elapsed < TIMEOUT + 2.0
    err = info.value
    assert err.kind == "barrier" and err.timeout == TIMEOUT and err.elapsed >= TIMEOUT
    assert "ncclCommAbort" in str(err) and "rank 0 of 1" in str(err)
    fake = transport._nccl
    assert fake.aborted and fake.calls[-1] == ("abort", 2)  # on the communicator's device
    assert transport.failure is err
    _refuses_everything(comm)
    comm.close()  # quick, and no ncclCommDestroy after the abort
    assert not fake.destroyed


def test_an_asynchronous_error_aborts_and_names_the_collective(gpu, transport):
    comm = Communicator(transport, consistency_check=False)
    fake = transport._nccl
    fake.errors = [0, 0, 6]  # ncclRemoteError on the third poll
    gpu.stuck = True
    transport.operation = "allreduce"
    with pytest.raises(NCCLAsyncError) as info:
        transport.barrier()
    err = info.value
    assert isinstance(err, ringcomm.CollectiveError) and isinstance(err, RuntimeError)
    assert err.code == 6 and err.kind == "allreduce" and err.peer is None
    assert "remote process exited" in err.nccl_error and err.nccl_error in str(err)
    assert "allreduce failed on rank 0 of 1" in str(err) and "(barrier)" in str(err)
    assert fake.polls == 3 and fake.aborted
    _refuses_everything(comm)


def test_an_abort_runs_the_failure_callbacks_once(gpu, transport):
    """What was prepared over the communicator (a Communicator's plans, a two-level
    allreduce's parent) hears of an abort by the watchdog as of a host transport's timeout."""
    calls: list[Exception | None] = []
    transport.on_failure(lambda: calls.append(transport.failure))
    gpu.stuck = True
    with pytest.raises(ringcomm.CollectiveTimeoutError) as info:
        transport.barrier()
    assert calls == [info.value]
    transport.abort(info.value)  # a second abort: nothing more to tell
    assert calls == [info.value]


def test_giving_up_a_communicator_runs_the_failure_callbacks(gpu, transport):
    calls: list[Exception | None] = []
    transport.on_failure(lambda: calls.append(transport.failure))
    error = ringcomm.CollectiveTimeoutError("split timed out", kind="split", timeout=TIMEOUT)
    transport._watch.give_up(error)
    transport._watch.give_up(error)
    assert calls == [error]
    with pytest.raises(RuntimeError, match="held by an NCCL call that never returned"):
        transport.barrier()


def test_a_small_device_allreduce_waits_bounded_before_its_copy_to_the_host(gpu, transport,
                                                                          monkeypatch):
    """The inline path copies a small device array to the host; on a stuck stream that copy
    would wait forever: a bounded wait comes first."""
    cupy = transport.cupy
    monkeypatch.setattr(_cuda_runtime, "_cupy", cupy)
    comm = Communicator(transport)
    with cupy.cuda.Device(2):
        x = cupy.asarray(np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(comm.allreduce(x).get(), np.arange(8))
    gpu.stuck = True
    with pytest.raises(ringcomm.CollectiveTimeoutError, match="allreduce timed out"):
        comm.allreduce(x)
    assert transport._nccl.aborted


def test_close_waits_bounded_and_releases_everything(gpu, transport):
    gpu.stuck = True
    with pytest.raises(ringcomm.CollectiveTimeoutError, match=r"close timed out"):
        transport.close()
    assert transport._nccl.aborted and not transport._nccl.destroyed
    assert transport._watch not in _nccl_wait._LIVE
    transport.close()  # idempotent


def test_a_healthy_close_finalizes_on_the_transports_device(gpu, transport):
    transport.close()
    assert transport._nccl.destroyed and ("destroy", 2) in transport._nccl.calls
    assert gpu.blocking_syncs == 0


def test_abort_on_timeout_ends_the_job_after_aborting(gpu, monkeypatch, capsys):
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), timeout=TIMEOUT,
                          abort_on_timeout=True)
    ended = []

    def end_job(launcher: str) -> None:
        ended.append((launcher, t._nccl.aborted))
        raise SystemExit(1)

    monkeypatch.setattr(_nccl_wait, "end_job", end_job)
    gpu.stuck = True
    with pytest.raises(SystemExit):
        t.barrier()
    assert ended == [("local", True)]  # NCCL was aborted before the job ends
    assert "ringcomm: CollectiveTimeoutError: barrier timed out" in capsys.readouterr().err
    gpu.stuck = False
    t.close()


def test_abort_is_idempotent_and_survives_nccl_refusing(gpu, transport):
    def refuse() -> None:
        raise _nccl_lib.NCCLError("ncclCommAbort failed: NCCL error 3", 3)

    transport._nccl.abort = refuse
    first = ringcomm.CollectiveTimeoutError("first")
    transport.abort(first)
    transport.abort(ringcomm.CollectiveTimeoutError("second"))
    assert transport.failure is first


def test_an_abort_held_by_other_device_work_is_waited_for_one_timeout(gpu, transport,
                                                                      caplog):
    """ncclCommAbort waits for the device's other work (it frees device memory): a kernel that
    never ends must not hold the failing wait for ever. It raises after about two timeouts,
    saying so, and the abort finishes later."""
    release = threading.Event()
    aborted = []

    def held_abort() -> None:
        release.wait(30)
        aborted.append(True)

    transport._nccl.abort = held_abort
    gpu.stuck = True
    start = time.monotonic()
    with pytest.raises(ringcomm.CollectiveTimeoutError, match="barrier timed out"):
        transport.barrier()
    assert time.monotonic() - start < 2 * TIMEOUT + 1.0
    assert "ncclCommAbort has not returned" in caplog.text
    assert transport.failure is not None and not aborted
    release.set()
    for _ in range(1000):
        if aborted:
            break
        time.sleep(0.01)
    assert aborted == [True]


# ------------------------------------------------------------ waits outside the transport
def test_wait_for_stream_is_bounded_where_nccl_is_open(gpu, transport):
    cupy = transport.cupy
    with cupy.cuda.Device(2):
        stream = cupy.cuda.get_current_stream()
    nccl.wait_for_stream(stream, 2)  # healthy: polled
    assert gpu.blocking_syncs == 0
    gpu.stuck = True
    with pytest.raises(ringcomm.CollectiveTimeoutError, match="a wait for the GPU timed out"):
        nccl.wait_for_stream(stream, 2)
    assert transport._nccl.aborted


def test_wait_for_stream_blocks_plainly_where_no_nccl_is_open(gpu, transport):
    cupy = transport.cupy
    stream = cupy.cuda.get_current_stream()  # device 0: no communicator there
    nccl.wait_for_stream(stream, 0)
    assert gpu.blocking_syncs == 1 and transport._nccl.polls == 0


def test_wait_for_stream_aborts_the_communicator_that_failed(gpu, transport):
    other = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=2, timeout=60)
    try:
        other._nccl.errors = [0, 2]  # ncclSystemError
        gpu.stuck = True
        with pytest.raises(NCCLAsyncError, match="NCCL error 2"):
            nccl.wait_for_stream(transport.cupy.cuda.get_current_stream(2), 2)
        assert other._nccl.aborted and not transport._nccl.aborted
    finally:
        gpu.stuck = False
        other.close()


def test_torch_results_wait_on_their_device_and_bounded(gpu, transport, monkeypatch):
    """ringcomm.torch's wait for a CUDA result: on the result's device (not the thread's),
    through the NCCL backend's bounded wait."""
    pytest.importorskip("torch")
    from ringcomm.torch import _tensors

    cupy = transport.cupy
    monkeypatch.setattr(_tensors, "_cupy", lambda: cupy)
    with cupy.cuda.Device(2):
        a = cupy.zeros(8, np.float32)
    seen = []
    real = nccl.wait_for_stream
    monkeypatch.setattr(nccl, "wait_for_stream", lambda s, d, what: (
        seen.append((s.device, d, gpu.current())), real(s, d, what)))
    _tensors.sync_device(a)
    assert seen == [(2, 2, 2)] and gpu.current() == 0
    gpu.stuck = True
    with pytest.raises(ringcomm.CollectiveTimeoutError):
        _tensors.sync_device(a)


# ------------------------------------------------------------------------------ with a GPU
def _real_gpu() -> None:
    if not nccl.usable():
        pytest.skip("needs a CUDA GPU and NCCL")


_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def _hold_current_stream(seconds: float) -> None:
    """Enqueue, on the current (null) stream, work that takes ``seconds`` of wall time."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda._sleep(int(seconds * 2e9))  # cycles, at about 2 GHz or more
            return
    except ImportError:
        pass
    import cupy

    cupy.RawKernel(_SPIN, "spin")((1,), (1,), (np.uint64(seconds * 1e9),))


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_real_nccl_wait_that_cannot_complete_is_aborted_at_the_timeout(monkeypatch):
    """One rank on one GPU (the real NCCL and CUDA events): after a barrier, work that holds
    the stream for seconds makes the bounded wait for the stream (ringcomm.torch's wait for a
    result) outlast the communicator's timeout (0.5 s): it must end then with ncclCommAbort of
    the idle communicator, which afterwards refuses calls, and close() must return. (An
    asynchronous NCCL error needs a peer to lose: see the two-GPU test below.)"""
    _real_gpu()
    import cupy

    # wait_for_stream aborts every communicator open on the device: one left open by an
    # earlier test (ending the job at its timeout) would take part. Such a leak is reported,
    # and kept out of this check.
    gc.collect()
    stale = [_describe(w) for w in list(_nccl_wait._LIVE)]
    monkeypatch.setattr(_nccl_wait, "_LIVE", weakref.WeakSet())
    comm = nccl.NCCLCommunicator(timeout=0.5, abort_on_timeout=False, consistency_check=False)
    try:
        assert comm.transport._nccl.async_error() == 0  # healthy
        comm.barrier()  # NCCL's allreduce, then a polled wait
        _hold_current_stream(4.0)
        start = time.monotonic()
        with pytest.raises(ringcomm.CollectiveTimeoutError, match="ncclCommAbort"):
            nccl.wait_for_stream(cupy.cuda.get_current_stream(), comm.device.id)
        # The wait gives up at the timeout; the abort, which waits for the held stream (it
        # frees device memory), is waited for one more timeout at most.
        assert time.monotonic() - start < 3.0
        assert comm.transport.failure is not None
        with pytest.raises(RuntimeError, match="aborted after an earlier failure"):
            comm.allreduce(cupy.ones(4096, np.float32))
    finally:
        comm.close()
        cupy.cuda.Device().synchronize()  # the held work, then the abort, end
    assert not stale, f"NCCL communicators left open by earlier tests: {stale}"


def _describe(w: _nccl_wait.Watchdog) -> str:
    t = w._t
    return (f"{type(t).__name__} rank {t.rank} of {t.size} on device {w.device} "
            f"({w.launcher}, timeout {t.timeout} s, abort_on_timeout {t.abort_on_timeout})")


_PEER_EXITS = textwrap.dedent("""
    import os, sys, time
    import cupy, numpy as np
    import ringcomm
    from ringcomm.backends.nccl import NCCLAsyncError, NCCLCommunicator

    comm = NCCLCommunicator(timeout=float(sys.argv[1]), abort_on_timeout=False)
    x = cupy.ones(1 << 20, np.float32)
    comm.allreduce(x)
    comm.barrier()
    if comm.rank == 1:
        os._exit(0)  # dies without a word
    time.sleep(1.0)
    start = time.monotonic()
    try:
        for _ in range(3):
            comm.allreduce(x)
            comm.barrier()
    except (ringcomm.CollectiveTimeoutError, NCCLAsyncError) as err:
        print("RAISED", round(time.monotonic() - start, 1), type(err).__name__, err,
              flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(1)
""")


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_real_nccl_peer_that_exits_ends_the_wait(subprocess_env, tmp_path):
    """Two processes on two GPUs, started as torchrun starts them (no MPI: no launcher kills
    the survivor, and the per-call agreement itself goes over NCCL); rank 1 exits after a
    first allreduce. Rank 0's next calls must end with NCCL's asynchronous error or the
    timeout (20 s), never hang. NCCL refuses two ranks on one GPU, so this needs two."""
    _real_gpu()
    pytest.importorskip("torch.distributed")
    import socket

    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (NCCL refuses two ranks on one GPU)")
    script = tmp_path / "peer_exits.py"
    script.write_text(_PEER_EXITS)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(subprocess_env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), "20"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        out = procs[0].communicate(timeout=150)[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert "RAISED" in out, out
    assert float(out.split("RAISED", 1)[1].split()[0]) < 25.0


# ---------------------------------------------------- creation: a peer that never joins
class _Creating:
    """A creation (ncclCommInitRank, ncclCommSplit) that blocks until ``release`` is set, as
    NCCL's bootstrap blocks until every rank has joined; then it returns ``made``."""

    def __init__(self, made: Any, gpu: FakeGPU | None = None) -> None:
        self.made, self.release, self.devices = made, threading.Event(), []
        self.gpu = gpu if gpu is not None else made.gpu
        self.threads: list[int] = []

    def __call__(self) -> Any:
        self.devices.append(self.gpu.current())
        self.threads.append(threading.get_ident())
        self.release.wait(30)
        return self.made


def _named(timeout: float):
    return types.SimpleNamespace(rank=1, size=3, operation=None, world_ranks=range(3),
                                 world_size=3, timeout=timeout)


def test_a_creation_returns_on_its_own_thread_with_the_gpu_current(gpu):
    made = FakeNCCLComm(gpu, 2)
    creating = _Creating(made)
    creating.release.set()
    got = _nccl_wait.bounded_start(creating, lambda: FakeCupy(gpu).cuda.Device(2),
                                   _named(5.0), "init", "ncclCommInitRank", False, "local")
    assert got is made and creating.devices == [2] and not made.aborted
    assert creating.threads and creating.threads != [threading.get_ident()]


def test_a_creation_that_nccl_refuses_raises_its_error(gpu):
    def refuse():
        raise _nccl_lib.NCCLError("ncclCommInitRank failed: invalid usage", 5)

    with pytest.raises(_nccl_lib.NCCLError, match="invalid usage"):
        _nccl_wait.bounded_start(refuse, lambda: FakeCupy(gpu).cuda.Device(0), _named(5.0),
                                 "init", "ncclCommInitRank", True, "local")


def test_a_creation_a_peer_never_joins_times_out_and_a_late_one_is_aborted(gpu):
    made = FakeNCCLComm(gpu, 1)
    creating = _Creating(made)
    start = time.monotonic()
    with pytest.raises(ringcomm.CollectiveTimeoutError) as info:
        _nccl_wait.bounded_start(creating, lambda: FakeCupy(gpu).cuda.Device(1),
                                 _named(TIMEOUT), "init", "ncclCommInitRank", False, "local")
    assert TIMEOUT <= time.monotonic() - start < TIMEOUT + 2.0
    err = info.value
    assert (err.kind, err.peer, err.timeout) == ("init", None, TIMEOUT)
    assert re.match(r"init timed out on rank 1 of 3 after \d+\.\d s waiting for the other "
                    r"ranks \(ncclCommInitRank\)", str(err)), err
    assert "ncclCommInitRank still waits in NCCL" in str(err)
    creating.release.set()  # NCCL completes after all: nobody will use it
    deadline = time.monotonic() + 10
    while not made.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made.aborted and made.calls[-1] == ("abort", 1)


class _SplittingLib(_FakeLib):
    can_split = True


class _SplitBlocks(FakeNCCLComm):
    """A communicator whose ncclCommSplit waits for a peer that never comes."""

    def __init__(self, gpu: FakeGPU, device: int) -> None:
        super().__init__(gpu, device)
        self.creating = _Creating(FakeNCCLComm(gpu, device))

    def split(self, color: int, key: int) -> FakeNCCLComm:
        return self.creating()


@pytest.mark.parametrize("abort", [False, True], ids=["raises", "ends-the-job"])
def test_a_split_a_peer_never_joins_is_bounded(gpu, monkeypatch, capsys, abort):
    """NCCLTransport.split over ncclCommSplit: the timeout error names the split (raised, or
    written before the job ends). ncclCommSplit still runs on the parent communicator, on its
    thread: the parent then refuses every call, and close() frees nothing under it."""
    t = NCCLTransport.__new__(NCCLTransport)
    parent = _SplitBlocks(gpu, 2)
    t._attach(_nccl_setup._LocalRendezvous(), FakeCupy(gpu), _SplittingLib(), 2, parent,
              TIMEOUT, abort)
    ended = []

    def end_job(launcher: str) -> None:
        ended.append(launcher)
        raise SystemExit(1)

    monkeypatch.setattr(_nccl_wait, "end_job", end_job)
    try:
        with pytest.raises(SystemExit if abort else ringcomm.CollectiveTimeoutError):
            t.split(0, 0)
        assert parent.creating.devices == [2]
        if abort:
            assert ended == ["local"]
            assert re.search(r"ringcomm: CollectiveTimeoutError: split timed out on rank 0 of 1 "
                             r"after \d+\.\d s waiting for the other ranks \(ncclCommSplit\)",
                             capsys.readouterr().err)
        else:
            with pytest.raises(RuntimeError, match="held by an NCCL call that never returned"):
                t.barrier()
            t.close()
            assert not parent.destroyed and not parent.aborted
    finally:
        parent.creating.release.set()
        t.close()


class _InitLib(_FakeLib):
    """A library without ncclCommSplit whose ncclCommInitRank waits for ``creating``."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.aborted: list[Any] = []
        self.fn = {"ncclCommAbort": lambda handle: self.aborted.append(handle) or 0}
        self.creating = _Creating("handle", gpu)

    def unique_id(self) -> bytes:
        return bytes(_nccl_lib.UNIQUE_ID_BYTES)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> Any:
        return self.creating()


def test_a_split_by_a_fresh_communicator_a_peer_never_joins_is_bounded(gpu):
    """Before NCCL 2.18 a split makes a new communicator (ncclCommInitRank over the group):
    bounded alike, on the GPU of the transport; the parent, which no call holds, stays usable;
    the communicator NCCL makes after the timeout is aborted."""
    lib = _InitLib(gpu)
    t = NCCLTransport.__new__(NCCLTransport)
    t._attach(_nccl_setup._LocalRendezvous(), FakeCupy(gpu), lib, 3, FakeNCCLComm(gpu, 3),
              TIMEOUT, False)
    try:
        with pytest.raises(ringcomm.CollectiveTimeoutError, match=r"split timed out on rank "
                           r"0 of 1 after \d+\.\d s .*\(ncclCommInitRank\)") as info:
            t.split(0, 0)
        assert (info.value.kind, lib.creating.devices) == ("split", [3])
        t.barrier()  # the parent goes on
        lib.creating.release.set()
        deadline = time.monotonic() + 10
        while not lib.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lib.aborted == ["handle"]
    finally:
        lib.creating.release.set()
        t.close()


def test_init_a_peer_never_joins_is_bounded(gpu, monkeypatch):
    """NCCLTransport(): ncclCommInitRank on the chosen GPU, bounded by the timeout; the
    rendezvous is closed on the way out."""
    rdv = _nccl_setup._LocalRendezvous()
    closed = []
    monkeypatch.setattr(rdv, "close", lambda: closed.append(True))
    lib = _InitLib(gpu)
    setup = types.SimpleNamespace(cupy=FakeCupy(gpu), lib=lib, device=1)
    monkeypatch.setattr(_nccl_setup, "connect", lambda mpi_comm, timeout: rdv)
    monkeypatch.setattr(sys.modules[NCCLTransport.__module__], "_checked_setup",
                        lambda rdv, device: (setup, bytes(_nccl_lib.UNIQUE_ID_BYTES)))
    try:
        with pytest.raises(ringcomm.CollectiveTimeoutError, match=r"init timed out on rank 0 "
                           r"of 1 after \d+\.\d s .*\(ncclCommInitRank\)"):
            NCCLTransport(timeout=TIMEOUT, abort_on_timeout=False)
        assert lib.creating.devices == [1] and closed == [True]
    finally:
        lib.creating.release.set()


_NEVER_JOINED = textwrap.dedent("""
    import json, time, types
    import cupy
    import ringcomm
    from ringcomm.backends import _nccl_lib, _nccl_wait

    lib = _nccl_lib.load()
    uid = lib.unique_id()
    named = types.SimpleNamespace(rank=0, size=2, operation=None, world_ranks=range(2),
                                  world_size=2, timeout=2.0)
    start = time.monotonic()
    try:
        _nccl_wait.bounded_start(lambda: _nccl_lib.NCCLComm.create(lib, 2, uid, 0),
                                 lambda: cupy.cuda.Device(0), named, "init",
                                 "ncclCommInitRank", False, "local")
        print(json.dumps({"error": "made"}), flush=True)
    except ringcomm.CollectiveTimeoutError as err:
        print(json.dumps({"kind": err.kind, "waited": time.monotonic() - start,
                          "message": str(err)}), flush=True)
""")


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_real_nccl_init_that_a_peer_never_joins_ends_at_the_timeout(subprocess_env, tmp_path):
    """The real ncclCommInitRank, rank 0 of 2, whose rank 1 never comes (it died after the
    unique id was shared): the creation ends at the timeout (2 s) with the error, instead of
    waiting in NCCL's bootstrap for ever. In a process of its own: the creation's thread stays
    blocked in NCCL there."""
    _real_gpu()
    script = tmp_path / "never_joined.py"
    script.write_text(_NEVER_JOINED)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=90, env=subprocess_env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, proc.stdout + proc.stderr
    row = rows[0]
    assert row.get("kind") == "init" and 2.0 <= row["waited"] < 6.0, row
    assert "ncclCommInitRank" in row["message"], row


def test_the_stand_in_cupy_is_not_left_installed():
    """Sanity of these tests: no stand-in stays installed as ringcomm's CuPy."""
    assert not isinstance(_cuda_runtime._cupy, FakeCupy)
    assert _nccl_wait.poll is poll
