"""What the GPU paths reuse between calls, and where the host waits for the GPU, checked without
a GPU: on the stand-ins of tests/test_device_standins.py (CuPy, NCCL) and on the CPU emulator
(tests/gpu_emulator.py).

- The NCCL transport's ring exchanges take their CUDA events from a pool instead of making two
  per exchange, and every wait still waits for its own exchange's recording; device scratch
  handed out on another stream than the last call's is ordered after that call's work.
- The MPI backend's device staging waits for the stream once where MPI reads or writes what
  queued GPU work touches (a staged send, a CUDA-aware buffer), and not for staged receives.
- The compressed ring keeps its buffers between calls (no allocation per call), reads a float32
  input in place when there is no residual, and divides 16-bit averages in one pass, with the
  results of a fresh transport and of the NumPy path.
- On device arrays the rings cut a chunk into at most ring.DEVICE_SEGMENTS segments (launches
  per call bounded per step, not per segment), with the bits of the host's finer layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from test_device_standins import FakeCupy, FakeGPU, FakeStream, on_new_thread, standin_transport

import ringcomm
from ringcomm.algorithms import compressed_ring as cring
from ringcomm.algorithms import ring
from ringcomm.backends import _nccl_setup, staging
from ringcomm.backends.threads import run_ranks
from ringcomm.core.types import ReduceOp
from ringcomm.ops import _cuda_runtime

DEVICE = 1


@pytest.fixture
def gpu(monkeypatch) -> FakeGPU:
    """A stand-in GPU, its CuPy installed as ringcomm's."""
    gpu = FakeGPU(count=2)
    monkeypatch.setattr(_cuda_runtime, "_cupy", FakeCupy(gpu))
    return gpu


@pytest.fixture
def nccl(gpu) -> Iterator[Any]:
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=DEVICE)
    yield t
    t.close()


# ------------------------------------------------------------------- NCCL: events, scratch
def _ring_of_exchanges(t: Any, count: int) -> list[Any]:
    """``count`` exchanges with itself, two in flight as in the ring; the posted transfers."""
    cupy = t.cupy
    with cupy.cuda.Device(DEVICE):
        send = cupy.asarray(np.arange(64, dtype=np.float32))
        recv = [cupy.empty(64, np.float32) for _ in range(2)]
    posted = [t.isendrecv(send, 0, recv[0], 0)]
    for i in range(1, count):
        posted.append(t.isendrecv(send, 0, recv[i % 2], 0))
        posted[i - 1].wait()
    posted[-1].wait()
    np.testing.assert_array_equal(recv[0].get(), np.arange(64))
    return posted


def test_ring_exchanges_reuse_their_events(nccl):
    cuda = nccl.cupy.cuda
    _ring_of_exchanges(nccl, 3)
    made = cuda.events_made
    _ring_of_exchanges(nccl, 40)
    assert cuda.events_made == made, "an exchange made new CUDA events"
    assert made <= 4  # the "ready" event, and a "done" event per transfer in flight


def test_every_wait_waits_for_its_own_exchange(nccl):
    """With events reused, the current stream's wait for a transfer captures the recording that
    transfer made on the transfer stream (cudaStreamWaitEvent takes the recording current at
    the call), and the transfer stream's wait for the current stream the recording made just
    before it: no two exchanges in flight share a recording."""
    cupy = nccl.cupy
    p2p = nccl._p2p_stream
    with cupy.cuda.Device(DEVICE):
        current = cupy.cuda.get_current_stream()
        x = cupy.asarray(np.arange(8, dtype=np.float32))
    made: list[tuple[Any, int]] = []  # each transfer's event and its recording

    def post() -> Any:
        transfer = nccl.isendrecv(x, 0, x, 0)
        event = transfer._event
        made.append((event, event.recordings))
        assert p2p.waits[-1][2] is current  # the transfer stream waits for this stream
        assert p2p.waits[-1][1] == p2p.waits[-1][0].recordings  # its latest recording
        return transfer

    pending = [post()]
    for _ in range(29):
        pending.append(post())
        pending.pop(0).wait()
    pending.pop().wait()
    waits = [(event, recording) for event, recording, stream in current.waits]
    assert waits == made
    assert all(stream is p2p for _, _, stream in current.waits)
    assert len({id(e) for e, _ in made}) <= 3  # reused


def test_a_transfer_gives_its_event_back_once(nccl):
    with nccl.cupy.cuda.Device(DEVICE):
        x = nccl.cupy.asarray(np.ones(8, np.float32))
    transfer = nccl.isendrecv(x, 0, x, 0)
    transfer.wait()
    idle = list(nccl._events._idle)
    transfer.wait()  # nothing more: the event may already serve another exchange
    assert nccl._events._idle == idle


def test_device_scratch_on_another_stream_waits_for_the_last_one(nccl):
    cuda = nccl.cupy.cuda
    with cuda.Device(DEVICE):
        like = nccl.cupy.empty(4, np.float32)
        first = cuda.get_current_stream()
        side = cuda.Stream()
    a = nccl.scratch("k", like, 16, np.float32)
    assert not first.waits  # nothing before it
    with side:
        b = nccl.scratch("k", like, 16, np.float32)
        nccl.scratch("j", like, 16, np.float32)  # the same stream again: no new wait
    assert a.data.ptr == b.data.ptr  # the same buffer, reused
    assert [(s, r) for _, r, s in side.waits] == [(first, 1)]
    nccl.scratch("k", like, 16, np.float32)  # back on the first stream: after the side's work
    assert [s for _, _, s in first.waits] == [side]
    nccl.scratch("h", np.zeros(3), 3, np.float64)  # host scratch: no stream to order
    assert len(first.waits) == 1


def test_the_per_thread_stream_of_another_thread_is_another_stream(nccl, gpu):
    """cudaStreamPerThread is one handle (2) for a different stream on every thread."""
    with nccl.cupy.cuda.Device(DEVICE):
        like = nccl.cupy.empty(4, np.float32)
    mine = FakeStream(gpu, ptr=2, device=DEVICE)
    theirs = FakeStream(gpu, ptr=2, device=DEVICE)
    with mine:
        nccl.scratch("k", like, 4, np.float32)

    def other() -> None:
        with theirs:
            nccl.scratch("k", like, 4, np.float32)

    on_new_thread(other)
    assert [s for _, _, s in theirs.waits] == [mine]


def test_close_drops_the_pooled_events(gpu):
    t = standin_transport(gpu, _nccl_setup._LocalRendezvous(), device=DEVICE)
    _ring_of_exchanges(t, 4)
    assert t._events._idle
    t.close()
    assert not t._events._idle and t._scratch_stream is None


# ------------------------------------------------------------------ MPI: device staging
class _Req:
    pass


class _FakeMPIComm:
    """The mpi4py calls DeviceStaging makes; messages go nowhere, a receive writes 7s (so the
    copy to the device shows), a broadcast the root's own bytes."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def Get_rank(self) -> int:
        return self.rank

    @staticmethod
    def _fill(buf: Any) -> None:
        target = buf[0] if isinstance(buf, list) else buf
        if type(target) is np.ndarray:  # a pinned host buffer (not a device array)
            target.view(np.uint8)[...] = 7

    def Irecv(self, buf: Any, source: int, tag: int) -> _Req:
        self._fill(buf)
        return _Req()

    def Isend(self, buf: Any, dest: int, tag: int) -> _Req:
        return _Req()

    def Ibcast(self, buf: Any, root: int) -> _Req:
        if self.rank != root:
            self._fill(buf)
        return _Req()

    def Iallgatherv(self, send: Any, recv: Any) -> _Req:
        self._fill(recv[0])
        return _Req()

    def Ibarrier(self) -> _Req:
        return _Req()

    def Bcast(self, buf: Any, root: int) -> None:
        pass

    def Allgatherv(self, send: Any, recv: Any) -> None:
        pass


class _FakeMPI:
    BYTE = "byte"


def _staging(direct: bool) -> staging.DeviceStaging:
    return staging.DeviceStaging(_FakeMPI, direct, wait=lambda reqs, peer, what: None)


def _syncs(gpu: FakeGPU, step: Any) -> int:
    before = gpu.blocking_syncs
    step()
    return gpu.blocking_syncs - before


@pytest.mark.parametrize("direct", [False, True])
def test_staging_waits_only_where_mpi_touches_queued_work(gpu, direct):
    cupy = _cuda_runtime._cupy
    st = _staging(direct)
    comm = _FakeMPIComm()
    dev = cupy.asarray(np.arange(6, dtype=np.float32))
    out = cupy.zeros(6, np.float32)
    host = np.arange(6, dtype=np.float32)
    rows = cupy.zeros(12, np.float32)
    staged = 0 if direct else 1  # a staged send's download; CUDA-aware: any device buffer
    expected = {
        "send and receive": (lambda: st.isendrecv(comm, 1, dev, 0, out, 0).wait(), 1),
        "receive only": (lambda: st.isendrecv(comm, 1, None, 0, out, 0).wait(), 1 - staged),
        "host send": (lambda: st.isendrecv(comm, 1, host, 0, out, 0).wait(), 1 - staged),
        "host only": (lambda: st.isendrecv(comm, 1, host, 0, host.copy(), 0).wait(), 0),
        "broadcast root": (lambda: st.broadcast(comm, dev, 0), 1),
        "broadcast other": (lambda: st.broadcast(_FakeMPIComm(1), out, 0), 1 - staged),
        "allgatherv": (lambda: st.allgatherv(comm, dev, [6, 6], [0, 6], rows), 1),
        "allgatherv host": (lambda: st.allgatherv(comm, host, [6, 6], [0, 6], rows),
                            1 - staged),
    }
    got = {name: _syncs(gpu, step) for name, (step, _) in expected.items()}
    assert got == {name: want for name, (_, want) in expected.items()}
    if not direct:  # what MPI received reached the device, without a wait
        out[...] = 0
        st.broadcast(_FakeMPIComm(1), out, 0)
        assert (out.get().view(np.uint8) == 7).all()


# --------------------------------------------------------------- the compressed ring
def _emulated() -> Any:
    import gpu_emulator

    try:
        return gpu_emulator, gpu_emulator.build(gpu_emulator.cache_dir())
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")


@pytest.fixture
def emulated() -> Iterator[tuple[Any, Any]]:
    """The emulated CuPy, its launches serialized (the emulator runs one kernel at a time,
    and the ranks here are threads)."""
    module, emulator = _emulated()
    with module.one_launch_at_a_time(emulator), module.installed(emulator) as fake:
        yield emulator, fake


COMPRESSORS = [ringcomm.Int8(block_size=64), ringcomm.Int8(block_size=100, stochastic=True),
               ringcomm.FP16(), ringcomm.BF16()]
N = 3001


def _run(transports: list[Any], put: Any, xs: list[np.ndarray], comp: Any, op: ReduceOp,
         out_dtype: Any, feedback: bool,
         segment_bytes: int = 4096) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """One compressed allreduce on the thread ranks of ``transports`` (reused between runs);
    every rank's (result, residual) on the host."""

    def rank(t: Any) -> tuple[np.ndarray, np.ndarray | None]:
        x = put(xs[t.rank])
        out = put(np.zeros(x.size, out_dtype))
        residual = put(np.zeros(x.size, np.float32)) if feedback else None
        cring.allreduce(t, x, out, op, comp, residual, 11, segment_bytes=segment_bytes)
        host = np.array(out, copy=True).view(np.ndarray)
        return host, None if residual is None else np.array(residual).view(np.ndarray)

    return run_ranks(len(transports), lambda t: rank(transports[t.rank]))


def _transports(n: int) -> list[Any]:
    """Thread transports that outlive one run (their scratch is kept between runs)."""
    return run_ranks(n, lambda t: t)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
@pytest.mark.parametrize("kind", ["host", "emulated"])
def test_kept_buffers_give_what_fresh_ones_give(request, comp, kind):
    """A transport that ran bigger and different calls before gives every rank the result and
    residual of a fresh transport, and allocates nothing more on its repeated calls."""
    if kind == "emulated":
        fake = request.getfixturevalue("emulated")[1]
        put, space = fake.asarray, fake
    else:
        put, space = np.asarray, None
    rng = np.random.default_rng(3)
    old = _transports(3)
    for n, feedback in ((5 * N, True), (N // 2, False)):  # leave other data in the buffers
        _run(old, put, [rng.standard_normal(n).astype(np.float32) for _ in range(3)], comp,
             ReduceOp.SUM, np.float32, feedback)
    for op, dtype, feedback in ((ReduceOp.AVG, np.float16, True), (ReduceOp.SUM, np.float32,
                                                                      False)):
        xs = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
        want = _run(_transports(3), put, xs, comp, op, dtype, feedback)
        got = _run(old, put, xs, comp, op, dtype, feedback)
        for (g, gr), (w, wr) in zip(got, want, strict=True):
            np.testing.assert_array_equal(g.view(np.uint16 if dtype == np.float16 else
                                                 np.uint32), w.view(g.dtype.str.replace(
                                                     "f", "u")))
            if wr is not None:
                np.testing.assert_array_equal(gr, wr)
    if space is not None:  # repeated calls allocate no device buffer of the ring's
        made = []
        empty = space.empty
        space.empty = lambda *a, **kw: made.append(a) or empty(*a, **kw)
        try:
            xs = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
            arrays = [(put(x), put(np.zeros(N, np.float32))) for x in xs]
            made.clear()
            run_ranks(3, lambda t: cring.allreduce(old[t.rank], *arrays[t.rank], ReduceOp.SUM,
                                                   comp, None, 11, segment_bytes=4096))
        finally:
            del space.empty
        assert made == []


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
def test_device_ring_matches_numpy_and_launches_less(emulated, comp):
    """Device and host rings give the same bits; without a residual the float32 input is read
    in place (no copy per segment), and a 16-bit average is divided in one pass."""
    emulator, fake = emulated
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(2)]
    for op, dtype in ((ReduceOp.SUM, np.float32), (ReduceOp.AVG, np.float16)):
        want = _run(_transports(2), np.asarray, xs, comp, op, dtype, False)
        emulator.launches.clear()
        got = _run(_transports(2), fake.asarray, xs, comp, op, dtype, False)
        for (g, _), (w, _) in zip(got, want, strict=True):
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
        names = [launch.name for launch in emulator.launches]
        assert not [n for n in names if "compensate" in n]
        own = names.count("rc::divide_kernel<float, float>")  # the owner's segments
        if op is ReduceOp.SUM:
            assert own == 0 and not [n for n in names if "copy_kernel" in n]
        else:  # the owner divides, then rounds into out; the other segments in one pass
            assert own > 0
            assert names.count("rc::copy_kernel<rc::half_t, float>") == own
            assert names.count("rc::divide_kernel<float, rc::half_t>") == own  # n - 1 = 1


def test_device_segments_are_few_whatever_segment_bytes_says(monkeypatch, emulated):
    fake = emulated[1]
    dev, host = fake.zeros(40_000, np.float32), np.zeros(40_000, np.float32)
    assert ring.segment_elems(host, 2, 1024, 4) == 256  # the host's rule, unchanged
    assert ring.segment_elems(dev, 2, 1024, 4) == 5000  # a chunk of 20_000 in 4
    assert ring.segment_elems(dev, 2, 1 << 20, 4) == 1 << 18  # never below segment_bytes
    monkeypatch.setattr(ring, "DEVICE_SEGMENT_BYTES", 8192)
    assert ring.segment_elems(dev, 2, 1024, 4) == 2048  # at most DEVICE_SEGMENT_BYTES
    assert ring.segment_elems(dev, 2, 1024, 2) == 4096
    assert ring.segment_elems(dev, 2, 1024, 4, 1) == 2048  # a backend's one: still capped
    monkeypatch.setattr(ring, "DEVICE_SEGMENT_BYTES", 16 << 20)
    assert ring.segment_elems(dev, 2, 1024, 4, 1) == 20_000  # the whole chunk
    assert ring.segment_elems(host, 2, 1024, 4, 1) == 256  # host arrays: the host's rule
    monkeypatch.setattr(ring, "DEVICE_SEGMENTS", 0)
    assert ring.segment_elems(dev, 2, 1024, 4) == 256  # off: the host's rule


def _dense(transports: list[Any], put: Any, xs: list[np.ndarray], op: ReduceOp) -> list[Any]:
    def rank(t: Any) -> np.ndarray:
        x = put(xs[t.rank])
        out = put(np.zeros_like(xs[t.rank]))
        ring.allreduce(t, x, out, op, segment_bytes=256)
        return np.array(out, copy=True).view(np.ndarray)

    return run_ranks(len(transports), lambda t: rank(transports[t.rank]))


@pytest.mark.parametrize("comp", [None, *COMPRESSORS], ids=repr)
def test_device_rings_launch_per_step_not_per_segment(emulated, comp):
    """With 256-byte segments the host's ring cuts each chunk into dozens of segments; the
    device's into at most DEVICE_SEGMENTS, with the same bits (results and residuals: int8
    blocks, stochastic rounding and casts do not depend on where segments end)."""
    emulator, fake = emulated
    rng = np.random.default_rng(8)
    n, size = 3, 3 * N
    host_layout = ring.RingLayout.build(size, n, 0, 64, getattr(comp, "align", 1))
    assert host_layout.nseg > 5 * ring.DEVICE_SEGMENTS
    for op, dtype in ((ReduceOp.SUM, np.float32), (ReduceOp.AVG, np.float16)):
        xs = [rng.standard_normal(size).astype(dtype) for _ in range(n)]
        if comp is None:
            want = _dense(_transports(n), np.asarray, xs, op)
            emulator.launches.clear()
            got = _dense(_transports(n), fake.asarray, xs, op)
            pairs = zip(got, want, strict=True)
        else:
            xs = [x.astype(np.float32) for x in xs]
            want = _run(_transports(n), np.asarray, xs, comp, op, dtype, True, 256)
            emulator.launches.clear()
            got = _run(_transports(n), fake.asarray, xs, comp, op, dtype, True, 256)
            pairs = ((g, w) for gs, ws in zip(got, want, strict=True)
                     for g, w in zip(gs, ws, strict=True))
        for g, w in pairs:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
        steps = 2 * (n - 1)  # each rank's reduce-scatter and allgather steps
        per_rank = len(emulator.launches) / n  # 8-70 here; 94-423 a segment of 64 elements
        assert per_rank <= 5 * steps * max(1, ring.DEVICE_SEGMENTS), per_rank


def test_mpi_device_scratch_on_another_stream_waits_for_the_last_one(gpu):
    """The MPI backend's scratch follows the same rule as the NCCL transport's: a call on
    another stream than the last one's is ordered after that call's queued work."""
    from mpi4py import MPI

    from ringcomm.backends.mpi import MPITransport

    t = MPITransport(MPI.COMM_SELF, device=DEVICE)
    try:
        cupy = _cuda_runtime.cp()
        cuda = cupy.cuda
        with cuda.Device(DEVICE):
            like = cupy.empty(4, np.float32)
            first = cuda.get_current_stream()
            side = cuda.Stream()
            a = t.scratch("k", like, 16, np.float32)
            assert not first.waits
            with side:
                b = t.scratch("k", like, 16, np.float32)
                t.scratch("j", like, 16, np.float32)  # the same stream again: no new wait
            assert a.data.ptr == b.data.ptr
            assert [s for _, _, s in side.waits] == [first]
            t.scratch("k", like, 16, np.float32)
            assert [s for _, _, s in first.waits] == [side]
    finally:
        t.close()
