"""A Transport over a torch.distributed gloo group, for jobs started by torchrun.

torchrun starts plain processes, each its own one-process MPI world (and MPICH's singletons
cannot connect to each other), so under torchrun the ring's point-to-point messages, the
agreement allgather and the broadcasts travel over a gloo group of torch.distributed instead
(tags 7 and 11 of its point-to-point messages are ringcomm's: a group given to it should carry
no other messages with those tags).
The ring, compression and error feedback are ringcomm's own, as on every backend, except for
dense float sums and averages, which run as gloo's own allreduce (see ``native_allreduce``).
The ring's messages carry host arrays: device arrays are staged through host memory (gloo's
own allreduce takes them as they are, and stages them itself).

:class:`TorchDistTransport` implements the Transport; :class:`TorchDistCommunicator` is the
Communicator over it. :class:`ProcessGroupTransport` is the same Transport over a gloo group
that torch.distributed does not hold, made over a store by its members alone (the
"ringcomm" torch.distributed backend's groups of some of the job's ranks, under torchrun).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import math
import os
import pickle
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ringcomm import ops as _ops
from ringcomm.backends.gloo_held import hold, pause_at_exit
from ringcomm.backends.staging import PinnedCopies
from ringcomm.comm.base import Communicator
from ringcomm.comm.settings import agree_byte_limit
from ringcomm.comm.transport import (
    TransportBase,
    adopt_ranks,
    agree_split,
    check_timeout,
    timeout_error,
    write_fatal,
)
from ringcomm.core import trace
from ringcomm.core.log import get_logger
from ringcomm.core.types import RING, Array, CollectiveTimeoutError, ReduceOp

__all__ = ["ProcessGroupTransport", "TorchDistCommunicator", "TorchDistTransport"]

_RING_TAG = 7
_P2P_TAG = 11
# torch renamed all_gather_into_tensor (deprecated in newer releases) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# The key in torch.distributed's store from which each split of a TorchDistTransport draws the
# serial number that names its groups' prefix.
_SPLIT_SERIAL_KEY = "ringcomm-split-serial"
# torch.distributed exports the other options types, but not this one.
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions
# What "forever" is for gloo, which takes a finite duration (ten years).
_FOREVER = datetime.timedelta(days=3650)
_LOG = get_logger("gloo")
# Dense float32/float64 sums and averages larger than the inline slot run as gloo's own
# allreduce: over gloo, ringcomm's ring pays a torch send and receive per segment, and gloo's
# allreduce was 1.08-1.24x faster from 256 KiB to 64 MiB and no slower beyond the noise below
# (2 ranks on 2 cores, median of 30 alternating calls; bench/results/gloo_native/, made with
# bench/gloo_transport_perf.py). gloo's allreduce forms each element's sum once and hands it
# to every rank, so every rank gets the same bits (tests/mpi/test_gloo_native.py holds it to
# that). 16-bit floats take the ring, which sums them in float32; MIN, MAX and PROD too
# (NumPy's NaN rules, which gloo's do not follow).
NATIVE_BYTES_ENV = "RINGCOMM_GLOO_ALLREDUCE_BYTES"
_NATIVE_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64"))
_NATIVE_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG})
# Every gloo group the transports made, destroyed at exit (see TorchDistTransport.close).
_MADE: list[Any] = []


@atexit.register
def _destroy_at_exit() -> None:
    """Destroy the groups the transports made, newest first, while the interpreter is whole:
    left to its teardown, a gloo group whose threads are destroyed in the wrong order, or with
    a wait still posted, ends the process (std::terminate) after the job's work is done.
    Nothing to do where torch.distributed's default group, and every group with it, is gone."""
    while _MADE:
        group = _MADE.pop()
        if not dist.is_initialized():
            continue
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError, KeyError) as err:  # destroyed by the user already
            _LOG.debug("group not destroyed at exit: %s", err)


def _duration(seconds: float) -> datetime.timedelta:
    return _FOREVER if math.isinf(seconds) else datetime.timedelta(seconds=seconds)


class _Pair:
    """A send and a receive posted together; ``wait()`` completes both within the group's
    timeout."""

    __slots__ = ("_after", "_peer", "_t", "_what", "_works")

    def __init__(self, t: TorchDistTransport, works: list[Any], peer: int, what: str,
                 after: Any = None) -> None:
        self._t, self._works, self._peer, self._what = t, works, peer, what
        self._after = after

    def wait(self) -> None:
        for work in self._works:
            self._t.bounded(self._what, self._peer, work.wait)
        if self._after is not None:
            self._after()


def _host(x: Array) -> np.ndarray:
    return x if type(x) is np.ndarray else _ops.get(x).to_host(x)


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of contiguous ``a``, as a 1-d uint8 view."""
    return a.reshape(-1).view(np.uint8)


def _bytes(a: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over the memory of contiguous ``a``, to hand to gloo (held until gloo
    lets go of it: gloo_held): gloo only moves the bytes, and some dtypes (bfloat16 from
    ml_dtypes) have no torch twin that from_numpy would accept."""
    t = torch.from_numpy(_flat_bytes(a))
    hold(t)
    return t


# gather(out, in): every rank's tensor ``in`` into ``out``, in the group's order.
_Gather = Callable[[torch.Tensor, torch.Tensor], None]


def _gather_rows(gather: _Gather, size: int, mine: np.ndarray, width: int) -> np.ndarray:
    """Every rank's bytes ``mine`` (at most ``width`` of them), one row of ``width`` bytes per
    rank in the group's order, padded with zeros: gloo has no allgatherv."""
    rows = np.zeros((size, width), dtype=np.uint8)
    padded = np.zeros(width, dtype=np.uint8)
    padded[: mine.size] = mine
    gather(_bytes(rows), _bytes(padded))
    return rows


def _gather_objects(gather: _Gather, size: int, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in the group's order: pickled, the lengths gathered, then the
    bytes padded to the longest (torch's all_gather_object would hand gloo tensors of its own,
    which gloo_held could not hold)."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    lengths = _gather_rows(gather, size, _flat_bytes(np.array([data.size], dtype=np.int64)), 8)
    lengths = lengths.view(np.int64).reshape(-1)
    rows = _gather_rows(gather, size, data, int(lengths.max()))
    return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, lengths, strict=True)]


def _default_stream(t: torch.Tensor) -> Any:
    """For a CUDA tensor, its device's default stream made current; nothing otherwise."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream(t.device))


def _place(hosts: list[str], rank: int) -> tuple[int, int]:
    """``rank``'s local rank and local size among ``hosts``, every rank's host name."""
    return hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])


def _staged(recv: Array) -> tuple[np.ndarray, Any]:
    """Where to receive into ``recv`` on the host, and what copies it over once received."""
    if type(recv) is np.ndarray:
        return recv, None
    host = np.empty(recv.shape, recv.dtype)
    return host, functools.partial(_ops.get(recv).copy_from_host, recv, host)


def _staged_exchange(copies: PinnedCopies, send: Array | None, recv: Array | None
                     ) -> tuple[np.ndarray | None, np.ndarray | None, Callable[[], None]]:
    """What gloo sends and receives into for a ring exchange where a device array takes part
    (host arrays as they are, device arrays through pinned host buffers of the pool), and
    what to do once both messages completed: the received bytes' copy to the device is queued
    on the current stream (the reduction that reads them follows it there, without the host
    waiting), and both buffers go back to the pool. A send's copy to the host is waited for
    here, before gloo reads it."""
    done: list[Callable[[], None]] = []
    if recv is not None and type(recv) is not np.ndarray:
        pinned_recv = copies.take(recv.nbytes)
        done.append(functools.partial(copies.upload, pinned_recv, recv))
        recv = pinned_recv[: recv.nbytes]
    if send is not None and type(send) is not np.ndarray:
        pinned_send = copies.download(send)
        copies.synchronize()
        done.append(functools.partial(copies.release, pinned_send))
        send = pinned_send[: send.nbytes]

    def after() -> None:
        for step in done:
            step()

    return send, recv, after


def _new_job_group(seconds: float) -> Any:
    """A gloo group of every rank of torch.distributed's default group, made within
    ``seconds`` (its creation waits for every rank over the group's store)."""
    start = time.monotonic()
    try:
        return dist.new_group(backend="gloo", timeout=_duration(seconds))
    except Exception as err:  # torch's DistStoreError or RuntimeError, by version
        if "timeout" not in str(err).lower():
            raise
        elapsed = time.monotonic() - start
        raise CollectiveTimeoutError(
            f"ringcomm's start-up timed out on rank {dist.get_rank()} of "
            f"{dist.get_world_size()} after {elapsed:.1f} s making its gloo group, which waits "
            "for every rank of torch.distributed's default group: some did not come (exited, "
            f"stopped, or in another call). The timeout is {seconds:g} s (ringcomm.init's); "
            f"torch said: {err}", kind="start-up", elapsed=elapsed, timeout=seconds) from err


class TorchDistTransport(TransportBase):
    """The Transport over a gloo process group of torch.distributed (torchrun jobs).

    Args:
        group: the gloo process group to run on; a new one over the default group's ranks
            when None (so that ringcomm's messages never match the application's), made by
            every process of the job and left to torch.distributed by ``close()``.
        timeout: seconds a wait for the other ranks may last, in the group made here (a
            given ``group`` keeps its own); ``DEFAULT_TIMEOUT_S`` when None.
        abort_on_timeout: on a timeout, end this process (exit status 1; torchrun then ends
            the job's other processes), or raise CollectiveTimeoutError (False).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``timeout`` is not a positive number.
    """

    backend = "gloo"
    starts_native_allreduce = True
    #: One ring segment a chunk of device arrays (up to the ring's segment cap): every
    #: message goes through pinned host memory, the host waiting for its copy, so more
    #: segments add waits and overlap nothing. A ResNet-18 step with the Int8 hook over gloo,
    #: 2 ranks on an H200: 41.7 ms with 1, 46.9 with 4 (bench/results/gpu/).
    device_segments: int | None = 1

    def __init__(self, group: Any = None, *, timeout: float | None = None,
                 abort_on_timeout: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group() (torchrun sets its environment)")
        seconds = check_timeout(timeout)
        made_here = group is None
        if made_here:
            group = _new_job_group(seconds)
        # From the group's host names, not the launcher's variables: Lightning's launcher
        # sets no local size, and a guess could differ between the ranks of one node.
        hosts = _gather_objects(functools.partial(_all_gather, group=group),
                                dist.get_world_size(group), socket.gethostname())
        self._setup(group, *_place(hosts, dist.get_rank(group)), seconds,
                    bool(abort_on_timeout), made_here=made_here)
        #: Dense float sums and averages up to this many bytes run as gloo's own allreduce
        #: (all of them by default, -1); the same on every rank.
        self.native_allreduce_bytes = agree_byte_limit(self, NATIVE_BYTES_ENV, -1)

    def _setup(self, group: Any, local_rank: int, local_size: int,
               timeout: float, abort_on_timeout: bool, *, made_here: bool) -> None:
        """Adopt torch.distributed's ``group``, ranked as the group ranks its members;
        ``made_here``: whether it is destroyed at exit (a group the caller gave stays theirs).
        Messages name their peers by global rank (``src``/``dst``, which every supported torch
        takes)."""
        members = [dist.get_global_rank(group, g) for g in range(dist.get_world_size(group))]
        if made_here:
            _MADE.append(group)
        self._adopt(group, dist.get_rank(group), members, local_rank, local_size, timeout,
                    abort_on_timeout)

    def _adopt(self, group: Any, rank: int, peers: list[int], local_rank: int,
               local_size: int, timeout: float, abort_on_timeout: bool) -> None:
        """Run on ``group`` as ``rank`` of ``len(peers)``: ``peers`` name each rank as the
        group's messages do."""
        self._group = group
        self.native_allreduce_bytes = -1
        self._copies: PinnedCopies | None = None
        pause_at_exit()  # for the tensors PyTorch's own calls hand this process's gloo groups
        self._peers = peers
        self.timeout, self.abort_on_timeout = timeout, abort_on_timeout
        super().__init__(rank, len(peers), local_rank=local_rank, local_size=local_size)

    def bounded(self, what: str, peer: int | None, fn: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        """Run the gloo operation ``fn(*args, **kwargs)``; gloo's timeout becomes a
        CollectiveTimeoutError naming the collective, the step and the peer."""
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as err:
            error = self._timeout(err, what, peer, start)
            if error is None:
                self._check_group(what, err)
                raise
        except ValueError as err:  # torch's refusal of a group it no longer holds
            self._check_group(what, err)
            raise
        raise error

    def _check_group(self, what: str, err: Exception) -> None:
        """Raise a RuntimeError that says so where ``err`` came of torch.distributed no
        longer holding this transport's group (``destroy_process_group()`` destroyed it with
        the default group); return otherwise. Some of torch's calls still run on such a group
        (the object lives on here), others refuse it with a message naming neither ringcomm
        nor what to do."""
        if self._group is None:  # a group of ringcomm's own (ProcessGroupTransport)
            return
        try:
            dist.get_process_group_ranks(self._group)
            return
        except (KeyError, ValueError, RuntimeError):
            pass
        raise RuntimeError(
            f"{what} on rank {self.rank} of {self.size}: this communicator ran over a gloo "
            "group of torch.distributed's, which torch.distributed no longer holds "
            "(destroy_process_group() destroyed it with the default group). Make a new "
            "communicator once the group is up again: ringcomm.init(), or hvd.init() (which "
            f"starts again over a new default group); torch said: {err}") from err

    def _timeout(self, err: RuntimeError, what: str, peer: int | None, start: float,
                 kind: str | None = None) -> CollectiveTimeoutError | None:
        """Where ``err`` is gloo's timeout of the operation begun at ``start`` (of collective
        ``kind``; the transport's current one when None): ringcomm's error for it, logged, or
        the process ended if ``abort_on_timeout``; None for any other error."""
        if "timed out" not in str(err).lower():
            return None
        error = timeout_error(self, what, peer, time.monotonic() - start, self.timeout,
                              kind=kind)
        _LOG.error("%s", error)
        if self.abort_on_timeout:
            write_fatal(error, "Ending this process (exit status 1).")
            os._exit(1)
        self.fail(error)  # what gloo still has on the way would meet a later call
        return error

    # ------------------------------------------------------------------ native allreduce
    def _reduces_natively(self, dtype: np.dtype, nbytes: int, op: ReduceOp) -> bool:
        """Whether gloo's own allreduce takes an array of ``dtype``, ``nbytes`` and ``op``."""
        limit = self.native_allreduce_bytes
        return (op in _NATIVE_OPS and dtype in _NATIVE_DTYPES and dtype.isnative
                and (limit < 0 or nbytes <= limit))

    def native_allreduce(self, x: Array, out: Array, op: ReduceOp) -> bool:
        """gloo's own allreduce of flat ``x`` into ``out`` (which may be ``x``) for dense
        float32/float64 sums and averages (up to ``native_allreduce_bytes``), host and device
        arrays alike; False otherwise (the ring runs). Every rank decides alike: the size,
        dtype and op were agreed, and the limit is the same everywhere; and whatever the
        array's kind or the caller (``start_native_allreduce`` on another rank), such a call
        is gloo's allreduce on every rank."""
        if not self._reduces_natively(np.dtype(x.dtype), x.nbytes, op):
            return False
        if type(x) is np.ndarray:
            self._native(x, out, op is ReduceOp.AVG)
        else:
            self._native_device(x, out, op is ReduceOp.AVG)
        return True

    def prepare_native_allreduce(self, dtype: np.dtype, nbytes: int, op: ReduceOp
                                 ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """``native_allreduce`` for repeats of one call (dtype, size, op)."""
        if not self._reduces_natively(dtype, nbytes, op):
            return None
        return functools.partial(self._native, average=op is ReduceOp.AVG)

    def _native(self, x: np.ndarray, out: np.ndarray, average: bool) -> None:
        """Sum ``x`` into ``out`` with gloo's allreduce (in place on ``out``), then divide by
        the size for an average, as the ring does."""
        if out is not x and not np.may_share_memory(x, out):
            np.copyto(out, x)
        tensor = torch.from_numpy(out.reshape(-1))
        hold(tensor)
        with trace.span("GLOO_ALLREDUCE"):
            self.bounded("allreduce", None, self._all_reduce, tensor)
        if average:
            _ops.get(out).divide(out, self.size, out)
        self.count_native(x.nbytes)

    def _native_device(self, x: Any, out: Any, average: bool) -> None:
        """``_native`` for device arrays: gloo copies the CUDA tensor through pinned host
        memory itself, after the work queued on torch's current stream (which the DLPack
        exchange orders after CuPy's); the result is complete when this returns, for
        whichever stream reads it, as on the ring's staged path."""
        if out is not x:
            _ops.get(out).copy(out, x)
        tensor = torch.from_dlpack(out)
        hold(tensor)
        with trace.span("GLOO_ALLREDUCE"):
            # wait() orders torch's current stream after gloo's copy back
            self.bounded("allreduce", None, self._all_reduce, tensor)
        if average:
            tensor.div_(self.size)
        torch.cuda.current_stream(tensor.device).synchronize()
        self.count_native(x.nbytes)

    def takes_native_start(self, x: Array, op: ReduceOp) -> bool:
        """Whether ``start_native_allreduce`` starts ``x`` (dtype, op, size limit)."""
        return self._reduces_natively(np.dtype(x.dtype), x.nbytes, op)

    def finished_allreduce(self, x: Array) -> torch.futures.Future:
        """A Future completed with ``x`` as a tensor (sharing its memory; CUDA-aware for a
        CUDA array), as ``start_native_allreduce``'s completes."""
        tensor = _result_tensor(x)
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[tensor.device] if tensor.is_cuda else None)
        result.set_result(tensor)
        return result

    def start_native_allreduce(self, x: Array, op: ReduceOp) -> torch.futures.Future | None:
        """gloo's own allreduce of ``x`` in place (host, or device: gloo copies a CUDA tensor
        through pinned host memory on a stream of its own, after the work queued on the
        current stream, and back), started on gloo's threads. The returned Future completes
        with the reduced tensor (divided by the size for an average), sharing ``x``'s memory,
        or with the allreduce's error (CollectiveTimeoutError for gloo's timeout); for a CUDA
        tensor it is CUDA-aware (``wait()`` orders the current stream after the result).
        None where ``native_allreduce`` would not take the call (dtype, op, size limit)."""
        dtype = np.dtype(x.dtype)
        if not self._reduces_natively(dtype, x.nbytes, op):
            return None
        tensor = _result_tensor(x)
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()  # gloo's requirement
        hold(flat)
        self.count_native(x.nbytes)
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[flat.device] if flat.is_cuda else None)
        work = self._start_all_reduce(flat)
        # A tensor that cannot share x's memory (negative strides) is a copy: the result goes
        # back into x too.
        into = x if _negative_strides(x) else None
        work.get_future().add_done_callback(functools.partial(
            self._native_done, result, tensor, flat, op is ReduceOp.AVG, time.monotonic(),
            into))
        return result

    def _native_done(self, result: torch.futures.Future, tensor: torch.Tensor,
                     flat: torch.Tensor, average: bool, start: float, into: np.ndarray | None,
                     done: torch.futures.Future) -> None:
        """Complete ``result`` as gloo completed ``done``, on gloo's thread (or on the one that
        started it, where gloo finished first). A CUDA tensor's average, copy and completion
        go on the device's default stream, which gloo makes wait for its copies back before it
        completes its work, wherever this runs (``done`` itself is not CUDA-aware: DDP's own
        allreduce over gloo relies on the same ordering)."""
        try:
            with _default_stream(flat):
                try:
                    done.value()
                except RuntimeError as err:
                    error = self._timeout(err, "allreduce", None, start, kind="allreduce")
                    if error is None:
                        raise
                    raise error from err
                if average:
                    flat.div_(self.size)
                if flat is not tensor:
                    tensor.copy_(flat)
                if into is not None:
                    into[...] = tensor.numpy()
                result.set_result(tensor)
        except Exception as err:  # handed to whoever waits on the result
            result.set_exception(err)

    # ------------------------------------------------------------------------ primitives
    def isendrecv(self, send: Array | None, dest: int, recv: Array | None, source: int, *,
                  channel: int = RING) -> _Pair:
        if dest == source == self.rank and send is not None and recv is not None:
            return self._to_self(send, recv)
        tag = _RING_TAG if channel == RING else _P2P_TAG
        works: list[Any] = []
        after = None
        if _ops.is_device_array(send) or _ops.is_device_array(recv):
            send, recv, after = _staged_exchange(self._pinned(), send, recv)
        if recv is not None:
            works.append(self._irecv(_bytes(recv), source, tag))
        if send is not None:
            works.append(self._isend(_bytes(send), dest, tag))
        return _Pair(self, works, source if recv is not None else dest,
                     "ring exchange" if channel == RING else "sendrecv", after)

    def _pinned(self) -> PinnedCopies:
        """The pinned host buffers device arrays' messages go through (made with the first
        one: it needs CuPy)."""
        if self._copies is None:
            self._copies = PinnedCopies()
        return self._copies

    def _to_self(self, send: Array, recv: Array) -> _Pair:
        # gloo connects no pair from a rank to itself (MPI does): the message is a copy.
        host_recv, after = _staged(recv)
        data = _flat_bytes(_host(send))
        _flat_bytes(host_recv)[: data.size] = data
        return _Pair(self, [], self.rank, "", after)

    def allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.bounded("allgather", None, self._gather, _bytes(recv), _bytes(send))

    def allgatherv(self, x: Array, counts: list[int], out: Array) -> None:
        # Rows padded to the longest, then the padding dropped.
        item = x.dtype.itemsize
        rows = self.bounded("allgatherv", None, _gather_rows, self._gather, self.size,
                            _flat_bytes(_host(x)), max(counts) * item)
        flat = np.concatenate([rows[r][: counts[r] * item] for r in range(self.size)])
        _ops.get(out).copy_from_host(out, flat.view(out.dtype))

    def broadcast(self, x: Array, root: int) -> None:
        host = _host(x)
        self.bounded("broadcast", root, self._broadcast, _bytes(host), root)
        if host is not x:
            _ops.get(x).copy_from_host(x, host)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.bounded("allgather of objects", None, _gather_objects, self._gather,
                            self.size, obj)

    def barrier(self) -> None:
        self.bounded("barrier", None, self._barrier)

    # ------------------------------------------- the group's operations (peers: our ranks)
    def _isend(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.isend(t, dst=self._peers[peer], group=self._group, tag=tag)

    def _irecv(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.irecv(t, src=self._peers[peer], group=self._group, tag=tag)

    def _gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        _all_gather(out, t, group=self._group)

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        dist.broadcast(t, src=self._peers[root], group=self._group)

    def _all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self._group)

    def _start_all_reduce(self, t: torch.Tensor) -> Any:
        return dist.all_reduce(t, group=self._group, async_op=True)

    def _barrier(self) -> None:
        dist.barrier(group=self._group)

    def split(self, color: int, key: int) -> TorchDistTransport:
        """A transport over the ranks that pass the same ``color``, ordered by (key, rank):
        a gloo group of theirs made over torch.distributed's store, under a prefix that no
        other split of the job takes (a serial number that this transport's rank 0 draws from
        the store), so whatever groups torch holds on each rank.

        Collective over this transport; each new gloo group is made by its members only.
        torch's ``new_group(use_local_synchronization=True)`` would name the group after the
        number of groups each process holds, which differs between ranks where an earlier
        group left some of them out (``new_group([0])`` counts on rank 0 only), and its
        members would then wait for each other under different names until the timeout.

        Raises:
            InvalidTypeError, InvalidArgumentError: color or key is invalid on some rank (as
                ``check_split`` says; raised on every rank).
        """
        store = dist.distributed_c10d._get_default_store()
        serial = store.add(_SPLIT_SERIAL_KEY, 1) if self.rank == 0 else 0
        everyone = agree_split(self, color, key, (socket.gethostname(), serial))
        return _split_over(self, dist.PrefixStore(f"ringcomm-split-{everyone[0][3]}", store),
                           everyone)

    def close(self) -> None:
        """Release the scratch buffers; a gloo group made here is destroyed at exit (or with
        torch.distributed's default group), not now; the groups that splits make go with
        their transports."""
        self.release_scratch()


class ProcessGroupTransport(TorchDistTransport):
    """The Transport over a gloo process group that torch.distributed does not hold: one made
    over a store by its members alone (``torch.distributed.ProcessGroupGloo(store, rank,
    size, timeout)``), as the "ringcomm" torch.distributed backend makes for a group of some
    of the job's ranks, whose members alone reach its first collective. Its ranks are the
    group's own; its messages, collectives and dense float sums are those of
    TorchDistTransport, called on the group object itself.

    Args:
        group: the gloo process group (its own timeout bounds its waits).
        store: the store the group was made over (a prefix of it of its own), from which
            ``split`` makes its groups, under prefixes of their own.
        timeout, abort_on_timeout: as for TorchDistTransport (``timeout``: what a timeout's
            message says; ``group``'s own timeout ends the wait).
        hosts: every rank's host name, in the group's order, where the caller has them (a
            split's agreement); gathered over the group when None.
        native_allreduce_bytes: the limit of gloo's own allreduce, agreed already (by the
            transport a split came from); agreed over the group when None.
    """

    def __init__(self, group: Any, store: Any, *, timeout: float | None = None,
                 abort_on_timeout: bool = True, hosts: list[str] | None = None,
                 native_allreduce_bytes: int | None = None) -> None:
        self._pg, self._store, self._splits = group, store, 0
        rank, size = group.rank(), group.size()
        if hosts is None:
            hosts = _gather_objects(self._gather, size, socket.gethostname())
        # Named by the group's own ranks: peers are this transport's ranks.
        self._adopt(None, rank, list(range(size)), *_place(hosts, rank),
                    check_timeout(timeout), bool(abort_on_timeout))
        self.native_allreduce_bytes = (agree_byte_limit(self, NATIVE_BYTES_ENV, -1)
                                       if native_allreduce_bytes is None
                                       else native_allreduce_bytes)

    def _isend(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return self._pg.send([t], peer, tag)

    def _irecv(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return self._pg.recv([t], peer, tag)

    def _gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        self._pg._allgather_base(out, t, _AllgatherOptions()).wait()

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._pg.broadcast([t], opts).wait()

    def _all_reduce(self, t: torch.Tensor) -> None:
        self._start_all_reduce(t).wait()

    def _start_all_reduce(self, t: torch.Tensor) -> Any:
        return self._pg.allreduce([t], dist.AllreduceOptions())

    def _barrier(self) -> None:
        self._pg.barrier(dist.BarrierOptions()).wait()

    def split(self, color: int, key: int) -> TorchDistTransport:
        """A transport over the ranks that pass the same ``color``, ordered by (key, rank):
        a new gloo group of theirs over the store, under a prefix that names this split
        (counted alike on every rank: splitting is collective) and the color.

        Raises:
            InvalidTypeError, InvalidArgumentError: color or key is invalid on some rank (as
                ``check_split`` says; raised on every rank).
        """
        everyone = agree_split(self, color, key, (socket.gethostname(),))
        self._splits += 1
        return _split_over(self, dist.PrefixStore(f"ringcomm-split-{self._splits}", self._store),
                           everyone)


def _split_over(parent: TorchDistTransport, store: Any,
                everyone: list[tuple[Any, ...]]) -> ProcessGroupTransport:
    """The transport over the ranks of ``parent`` that gave this rank's color in
    ``everyone`` (agree_split's rows: color, key, host name, ...), ordered by (key, rank): a
    gloo group of theirs over ``store`` (a prefix of it named after the color), which no other
    split may use. Their host names and ``parent``'s agreed limits come with it."""
    color = everyone[parent.rank][0]
    order = [r for _, r in sorted((k, r) for r, (c, k, *_) in enumerate(everyone)
                                  if c == color)]
    prefixed = dist.PrefixStore(f"{color}", store)
    group = dist.ProcessGroupGloo(prefixed, order.index(parent.rank), len(order),
                                  _duration(parent.timeout))
    sub = ProcessGroupTransport(group, prefixed, timeout=parent.timeout,
                                abort_on_timeout=parent.abort_on_timeout,
                                hosts=[everyone[r][2] for r in order],
                                native_allreduce_bytes=parent.native_allreduce_bytes)
    return adopt_ranks(sub, parent, order)


class TorchDistCommunicator(Communicator):
    """Collectives over a gloo group of torch.distributed (torchrun jobs).

    Args:
        group: the gloo process group to run on; a new one over the default group's ranks
            when None (so that ringcomm's messages never match the application's).
        consistency_check: as for :func:`ringcomm.init`.
        segment_bytes: ring segment size; the measured default when None.
        inline_bytes: see ``ringcomm.init``.
        timeout, abort_on_timeout: see TorchDistTransport.
        options: the Communicator's own (``algorithm``, ``topology``, ``startup_error``).

    Raises:
        RuntimeError: torch.distributed is not initialized.

    Example::

        dist.init_process_group("gloo")             # torchrun's environment
        comm = TorchDistCommunicator()
        total = comm.allreduce(np.ones(4, np.float32))
    """

    def __init__(self, group: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None,
                 timeout: float | None = None, abort_on_timeout: bool = True,
                 **options: Any) -> None:
        super().__init__(TorchDistTransport(group, timeout=timeout,
                                            abort_on_timeout=abort_on_timeout),
                         consistency_check=consistency_check,
                         segment_bytes=segment_bytes, inline_bytes=inline_bytes, **options)


def _result_tensor(x: Array) -> torch.Tensor:
    """``x`` as the tensor a started allreduce completes with: sharing its memory, but a
    contiguous copy of a NumPy array of negative strides, which no tensor can have (and
    which ``allreduce`` takes: refused here, after the ranks agreed on the call, it failed on
    that rank alone and left the others in gloo's allreduce)."""
    if type(x) is not np.ndarray:
        return torch.from_dlpack(x)
    return torch.from_numpy(np.ascontiguousarray(x) if _negative_strides(x) else x)


def _negative_strides(x: Array) -> bool:
    """Whether ``x`` is a NumPy array with a negative stride (no tensor can share it)."""
    return type(x) is np.ndarray and min(x.strides, default=0) < 0
