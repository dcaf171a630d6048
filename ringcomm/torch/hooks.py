"""DDP communication hook: DDP's gradient buckets averaged by ringcomm's ring, maybe compressed.

The bucket buffer reaches the ring as a zero-copy view (``.numpy()`` on CPU, DLPack on CUDA)
and the average is written back into it, so no copy of the gradients is made. Compression starts
at ``state.start_iter`` (dense before, as PowerSGD's warm-up) and skips buckets smaller than
``state.min_compress_bytes``. Error feedback is kept per bucket and follows the parameters when
DDP rebuilds its buckets after the first iteration. The compressor learns the shapes of the
bucket's gradients (``with_shapes``), which PowerSGD needs: it compresses each matrix apart and
sends 1-D gradients dense, all in the same call.

A CUDA bucket is reduced in the background with the communicator's device current, after the
work that the stream running backward (which may be a side stream) had queued when the hook
was called. Over gloo, an uncompressed float32/float64 bucket reduced in the background (or
one that ``compression="auto"`` has chosen to send uncompressed) is handed whole to gloo's own
allreduce (``Communicator.start_allreduce``: agreed like any call, then started on gloo's
threads, as DDP's own allreduce runs; gloo copies a CUDA bucket through pinned host memory on
a stream of its own), and the hook's future completes when gloo's does, so that several
buckets are in flight at once. Where the backend moves host arrays only
otherwise (an MPI without CUDA support, or ``host_staging=True``), an uncompressed CUDA bucket
is copied whole to pinned host memory on a side stream, reduced there, and copied back (see
:mod:`ringcomm.torch._staging`), so the GPU goes on with backward meanwhile; a compressed one
keeps its codecs on the GPU, on the same side stream.

Under ``compression="auto"`` the hook tries the Auto's candidates a whole iteration each and
keeps the one whose iterations were shortest (:mod:`ringcomm.torch._iteration_trials`): a
bucket's allreduce overlaps backward, so what a candidate costs is what it adds to the
iteration, not its call's length.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ringcomm import ops as _ops
from ringcomm.algorithms.auto import Auto, Compression
from ringcomm.algorithms.hierarchical import check_compressor
from ringcomm.algorithms.powersgd import LowRankMemory, PowerSGD
from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.comm._mismatch import HOOK_CALLER
from ringcomm.comm._twolevel import check_algorithm
from ringcomm.comm.base import Communicator
from ringcomm.core import trace
from ringcomm.core.types import ArgumentMismatchError, CommStats
from ringcomm.torch._engine import Handle, engine_for
from ringcomm.torch._errors import collective_error
from ringcomm.torch._futures import failing_for_cpp
from ringcomm.torch._iteration_trials import IterationTrials
from ringcomm.torch._residuals import (
    Layout,
    ResidualLayouts,
    check_grad_scaler,
    keep_write_back_rounding,
    rescaling,
)
from ringcomm.torch._staging import STAGED_DTYPES, HostStaging
from ringcomm.torch._tensors import Operand, from_array
from ringcomm.torch.compression import ring_of
from ringcomm.torch.horovod import _basics, _lifecycle

__all__ = ["RingcommState", "ringcomm_hook"]

#: What a bucket's compression differing between ranks says of their RingcommStates.
_STATES_DIFFER = (
    "ringcomm's DDP hook sends a bucket as the rank's RingcommState says (its compression, "
    "start_iter, min_compress_bytes, error_feedback and algorithm), so the states differ "
    "between the ranks: make them with the same arguments on every rank")

#: Dtypes of the buckets the backend's own allreduce takes as they are (gloo's native sums).
_STARTED_DTYPES = frozenset({torch.float32, torch.float64})


class RingcommState:
    """State of :func:`ringcomm_hook`: the communicator, the compressor and its residuals.

    Args:
        comm: the communicator; the one of ``ringcomm.torch.init()`` when None (started here
            if need be, as ``ringcomm.init()`` chooses: MPI under mpiexec; under torchrun
            NCCL where every rank has a GPU, else MPI over its processes, else gloo), over
            the whole job.
            For a DDP model over a sub-group (``process_group=``), pass a communicator of
            that group's ranks (its ``communicator`` on the "ringcomm" backend): the hook
            averages over ``comm``'s ranks, as PyTorch's ``allreduce_hook`` over the group
            its state names (WORLD for None). ``register_ddp_hook`` refuses a communicator
            whose size differs from the model's group, or whose processes are others.
        compression: a ringcomm compressor, ``"auto"`` (``ringcomm.Auto()``: whichever of
            none, bf16 and int8 makes the training iteration shortest, each tried on every
            compressed bucket of whole iterations from ``start_iter`` on, each in turn one
            untimed and 3 timed iterations, then chosen for all of them by every rank alike; see
            :mod:`ringcomm.torch._iteration_trials`; an ``Auto`` with fixed figures and no
            trials chooses per bucket from its model) or ``hvd.Compression.<name>``; None
            sends float32.
        error_feedback: keep what compression drops, per bucket, and add it to the next step.
        start_iter: iterations reduced uncompressed before compression starts (a warm-up, and
            DDP's bucket rebuild after iteration 0 happens before it).
        min_compress_bytes: buckets smaller than this go uncompressed (latency dominates them).
        overlap: run the allreduce on ringcomm's background thread, so that backward goes on
            computing the next buckets meanwhile (True), or inside the hook (False). None: in
            the background for CUDA buckets only. On CPU the ring needs the cores backward is
            using (MPI waits by polling), and running it inline measured faster
            (bench/results/ddp_perf_n*.md); over gloo, where an uncompressed bucket in the
            background goes to gloo's threads, the two measured alike
            (bench/results/ddp_perf_gloo_n2.md).
        algorithm: the allreduce algorithm of every bucket: "flat", "hierarchical" (within
            each node, across nodes, within each node) or "auto"; None: the communicator's
            (``comm.algorithm``).
        host_staging: for CUDA buckets where the backend moves host arrays only (gloo, an MPI
            without CUDA support): copy the bucket whole to pinned host memory on a side
            stream and reduce it there, compressed ones with the host codecs (True), or let
            the backend move it piece by piece (False). None: uncompressed float32/float64
            buckets in the background to gloo's own allreduce over gloo (which stages them
            itself), other uncompressed ones whole, compressed ones piece by piece (their
            codecs run on the GPU). Ignored on backends that move device arrays (NCCL, a
            CUDA-aware MPI). Over gloo an uncompressed float32/float64 bucket moved by the
            backend (False) is gloo's allreduce too, as in the background. ``overlap`` and
            ``host_staging`` pick what a CUDA bucket is agreed on (the device array, or its
            host copy): give every rank the same ones; a bucket staged whole on one rank and
            handed over as it is on another raises ArgumentMismatchError on every rank.
        grad_scaler: the ``torch.amp.GradScaler`` the training loop scales its loss with, or
            None. The gradients DDP hands over are in the units of the loss scale, and so are
            the residuals error feedback keeps; where the scaler grows or backs off its scale
            between iterations, the residuals are rescaled by the same factor at the next
            iteration's first bucket (one ``get_scale()`` an iteration, which waits for the
            GPU), so that they add to the gradients in the units they are in. Without it, a
            scale that doubles turns what was held back into half its mass. A scale that
            fell (after a step the scaler skipped) drops them: that step's gradients are not
            applied later.

    One state per DDP model: the state counts its model's iterations and keeps the
    compressor's own state (PowerSGD's Q) by bucket index, so that two models sharing one
    would count each other's iterations and warm-start from each other's Q
    (:func:`~ringcomm.torch.register_ddp_hook` refuses a state it gave another model).
    Several states may share one communicator (the states that ``register_ddp_hook`` makes
    do): ``stats`` counts this state's calls and bytes, ``comm.stats`` the communicator's
    (every state's on it, and any other call).

    Raises:
        ValueError: ``start_iter`` or ``min_compress_bytes`` negative, an unknown
            ``algorithm``, or a compressor the hierarchical allreduce cannot run (PowerSGD)
            where ``algorithm`` (else ``comm.algorithm``) is "hierarchical".
        TypeError: ``compression`` is not a compressor.

    Example::

        state = RingcommState(compression=ringcomm.Int8(), start_iter=10)
        ddp_model.register_comm_hook(state, ringcomm_hook)
    """

    __slots__ = ("_bound", "_bucket_params", "_caller", "_engine", "_model", "_residuals",
                 "_scale", "_spans", "_staging", "_ticked", "_trials", "algorithm", "comm",
                 "compression", "error_feedback", "feedback", "grad_scaler", "host_staging",
                 "iter", "min_compress_bytes", "overlap", "start_iter", "stats")

    def __init__(self, comm: Communicator | None = None, compression: Any = None,
                 error_feedback: bool = True, start_iter: int = 2,
                 min_compress_bytes: int = 64 * 1024, overlap: bool | None = None,
                 algorithm: str | None = None, host_staging: bool | None = None,
                 grad_scaler: Any = None) -> None:
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        if not isinstance(min_compress_bytes, int) or min_compress_bytes < 0:
            raise ValueError(f"min_compress_bytes must be an integer >= 0, got "
                             f"{min_compress_bytes!r}")
        self.compression = _own_memory(ring_of(compression))
        self.algorithm = None if algorithm is None else check_algorithm(algorithm)
        if comm is None:
            _lifecycle.init()
            comm = _basics.communicator()
        self.comm = comm
        if (self.algorithm or comm.algorithm) == "hierarchical" and comm.size > 1:
            # Refused here, not at the first compressed bucket, start_iter steps into training.
            check_compressor(None if isinstance(self.compression, Auto) else self.compression)
        self.error_feedback = bool(error_feedback)
        self.feedback = ErrorFeedback()
        self.start_iter = start_iter
        self.min_compress_bytes = min_compress_bytes
        self.overlap = None if overlap is None else bool(overlap)
        self.host_staging = None if host_staging is None else bool(host_staging)
        self._staging = HostStaging()
        self.iter = 0
        self._engine = engine_for(comm)
        #: What this state's hook put on the wire: its calls and bytes (the communicator's
        #: ``stats`` counts every call on it, other states' too).
        self.stats = CommStats()
        # Its own caller name, "ringcomm-hook-k" for the k-th state on the communicator (the
        # same on every rank that makes its states in one order): two models trained on two
        # threads over one communicator have buckets of different callers, so where they
        # pair in different orders on different ranks every rank raises
        # ArgumentMismatchError instead of averaging one model's gradients with the other's.
        self._caller = self._engine.new_caller(HOOK_CALLER)
        self._residuals = ResidualLayouts(self.feedback)
        self._bucket_params: dict[int, tuple[tuple[int, ...], Layout]] = {}
        self._bound: dict[int, tuple[tuple[Any, ...], Compression]] = {}
        self._spans = False  # the communicator checked against the job, at the first bucket
        # compression="auto" (an Auto that tries in the job) over several ranks: its
        # candidates tried a whole iteration each (ringcomm.torch._iteration_trials), from the
        # first that compresses. One rank's allreduce is a copy: nothing to try.
        auto = self.compression if isinstance(self.compression, Auto) else None
        self._trials = (IterationTrials(auto, start_iter)
                        if auto is not None and auto.rounds > 0 and comm.size > 1 else None)
        self._ticked = -1  # the iteration whose first bucket the trials have seen
        check_grad_scaler(grad_scaler)
        self.grad_scaler = grad_scaler
        self._scale: float | None = None  # the loss scale the residuals are in
        # The model register_ddp_hook gave this state to (a weak reference), or None: one
        # state per model, as its buckets are known by their index.
        self._model: Any = None

    def __reduce__(self) -> Any:
        raise TypeError(
            "a RingcommState cannot be saved: it holds a communicator and the threads that run "
            "its collectives. Save the model and the optimizer; a resumed job makes a new state "
            "(what error feedback held back at the checkpoint, at most a step's compression "
            "error per parameter, is not carried over)")

    def check_spans_job(self) -> None:
        """Refuse a one-process communicator in a job of several (a state made before
        torch.distributed was up, say at the top of a script that Lightning's launcher runs
        in its main process first): each rank would train its own model, without an error.

        The group compared is the DDP model's own where register_ddp_hook registered the
        hook (a model over a one-process sub-group takes a one-process communicator), else
        torch.distributed's default group.

        Raises:
            RuntimeError: ``comm`` has one process and the group several.
        """
        if self._spans:
            return
        model = self._model() if self._model is not None else None
        if model is not None:
            world = model.process_group.size()
        else:
            world = dist.get_world_size() if dist.is_initialized() else 1
        if self.comm.size == 1 and world > 1:
            raise RuntimeError(
                f"RingcommState's communicator has 1 process but torch.distributed's group has "
                f"{world}: it was made before the processes were connected. Make the state "
                "once torch.distributed is initialized (ringcomm.init() then spans its group), "
                "e.g. with ringcomm.torch.register_ddp_hook or, under Lightning, "
                "ringcomm.torch.lightning.RingcommDDPStrategy")
        self._spans = True

    def compresses(self, buffer: torch.Tensor) -> bool:
        """Whether the bucket ``buffer`` is sent compressed at the current iteration."""
        return (self.compression is not None and self.iter >= self.start_iter
                and buffer.is_floating_point()
                and buffer.numel() * buffer.element_size() >= self.min_compress_bytes)

    def through_host(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is a CUDA bucket that the backend moves through host memory."""
        return buffer.device.type == "cuda" and not self.comm.transport.moves_device_arrays

    def starts(self, buffer: torch.Tensor, compression: Compression | None,
               overlap: bool) -> bool:
        """Whether the bucket ``buffer`` may go whole to the backend's own allreduce on threads
        of the backend's own (``Communicator.start_allreduce``): float32/float64 buckets
        reduced in the background, uncompressed or under ``compression="auto"`` (started
        once it has chosen to send them uncompressed), on a backend that starts such an
        allreduce for them as they are (gloo: CUDA buckets where ``host_staging`` is None, and
        CPU ones)."""
        if (not (compression is None or isinstance(compression, Auto)) or not overlap
                or buffer.dtype not in _STARTED_DTYPES
                or not self.comm.transport.starts_native_allreduce):
            return False
        return buffer.device.type != "cuda" or self.host_staging is None

    def stages(self, buffer: torch.Tensor, compressed: bool) -> bool:
        """Whether the bucket ``buffer`` goes whole through pinned host memory (see
        ``host_staging``)."""
        if buffer.dtype not in STAGED_DTYPES or not self.through_host(buffer):
            return False
        return not compressed if self.host_staging is None else self.host_staging

    def residual(self, param: torch.Tensor) -> torch.Tensor | None:
        """What error feedback holds back for ``param`` (flat float32), or None.

        Example::

            held = sum(float(state.residual(p).abs().sum()) for p in model.parameters()
                       if state.residual(p) is not None)
        """
        piece = self._residuals.piece(id(param))
        return None if piece is None else from_array(piece)

    def layout(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> Layout:
        """Which parameters the bucket holds, at which offsets (cached per bucket index)."""
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        cached = self._bucket_params.get(bucket.index())
        if cached is not None and cached[0] == ids:
            return cached[1]
        base, item = buffer.data_ptr(), buffer.element_size()
        layout = tuple((id(p), (g.data_ptr() - base) // item, g.numel())
                       for p, g in zip(params, bucket.gradients(), strict=True))
        for p in params:  # a parameter's id may name another once it is gone
            self._residuals.watch(id(p), p)
        self._bucket_params[bucket.index()] = (ids, layout)
        return layout

    def _counted(self, task: Callable[[], Any]) -> Callable[[], Any]:
        """``task``, counting in ``stats`` what the communicator counts while it runs (the
        engine runs one communicator's tasks one at a time, so that is the task's own)."""
        def run() -> Any:
            stats = self.comm.stats
            calls, sent, received = stats.calls, stats.bytes_sent, stats.bytes_received
            try:
                return task()
            finally:
                self.stats.calls += stats.calls - calls
                self.stats.add(stats.bytes_sent - sent, stats.bytes_received - received)
        return run

    @property
    def auto_choice(self) -> str | None:
        """What ``compression="auto"`` chose for the buckets it compresses (a candidate's
        name, "none" for uncompressed) once its trial iterations are over; None before, and
        where ``compression`` is not an Auto that tries in the job."""
        return None if self._trials is None else self._trials.choice

    def iteration_starts(self) -> None:
        """Tell the trials of ``compression="auto"`` that a bucket of iteration ``iter`` is
        handed over now; they act at each iteration's first one (on the engine, after the
        calls queued before it: the same point of every rank's calls). There, too, the
        residuals follow a loss scale that changed (``grad_scaler``)."""
        if self._ticked == self.iter:
            return
        if self.grad_scaler is not None:
            self._follow_scale()
        if self._trials is None:
            self._ticked = self.iter
            return
        now = time.perf_counter()
        self._ticked = it = self.iter
        trials = self._trials
        self._engine.run(self._counted(lambda: trials.iteration(it, self.comm, now)),
                         self._caller)

    def _follow_scale(self) -> None:
        """Rescale every residual by new scale / old where the grad scaler's scale changed
        since the last iteration (on the engine, before this iteration's calls)."""
        assert self.grad_scaler is not None
        scale = float(self.grad_scaler.get_scale())
        factor, self._scale = rescaling(self._scale, scale), scale
        if factor is not None:
            self._engine.run(lambda: self._residuals.scale(factor), self._caller)

    def compressor(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> Compression:
        """The compressor for the bucket: ``compression`` told the shapes of its gradients, in
        buffer order (gaps between them as 1-D pieces); cached per bucket index. Under
        ``compression="auto"``, the candidate of the iteration's trial, then the one chosen."""
        assert self.compression is not None
        if self._trials is not None:
            return self._trials.compression()
        shapes = _bucket_shapes(bucket, buffer)
        cached = self._bound.get(bucket.index())
        if cached is not None and cached[0] == shapes:
            return cached[1]
        bound = self.compression.with_shapes(shapes)
        self._bound[bucket.index()] = (shapes, bound)
        return bound


def _own_memory(compression: Compression | None) -> Compression | None:
    """``compression``, with a memory of its own where it keeps one (PowerSGD's Q, keyed by
    bucket index): one compressor given to the states of two models would otherwise warm-start
    each model's buckets from the other's Q."""
    if isinstance(compression, PowerSGD):
        own = compression.with_shapes(compression.shapes)
        own.memory = LowRankMemory()
        return own
    return compression


def _bucket_shapes(bucket: dist.GradBucket, buffer: torch.Tensor) -> tuple[Any, ...]:
    base, item = buffer.data_ptr(), buffer.element_size()
    placed = sorted(((g.data_ptr() - base) // item, tuple(g.shape), g.numel())
                    for g in bucket.gradients())
    shapes: list[tuple[int, ...]] = []
    at = 0
    for offset, shape, numel in placed:
        if offset > at:
            shapes.append((offset - at,))
        shapes.append(shape)
        at = offset + numel
    if buffer.numel() > at:
        shapes.append((buffer.numel() - at,))
    return tuple(shapes)


def _allreduce(state: RingcommState, array: Any, buffer: torch.Tensor,
               compression: Compression | None, layout: Layout | None,
               name: str | None) -> None:
    """Average ``array`` (the bucket's, or its host copy) in place over every rank."""
    feedback = _feedback(state, array, layout, name)
    held = _hold_idle(state.feedback, array, layout, name) if feedback is not None else []
    try:
        state.comm.allreduce(array, out=array, op="avg", compression=compression,
                             feedback=feedback, name=name, algorithm=state.algorithm)
    except (ValueError, TypeError) as err:
        error = collective_error(state.comm, err, "allreduce", buffer)
        if _compressions_differ(err):
            error = type(error)(f"{error}. {_STATES_DIFFER}")
        raise error from err
    finally:
        if held:
            residual = state.feedback.take(name, array.reshape(-1))  # type: ignore[arg-type]
            for off, piece in held:
                residual[off: off + piece.size] += piece


def _compressions_differ(err: Exception) -> bool:
    """Whether ``err`` says that the ranks sent a bucket with different compressions (not
    only under different bucket names: buckets handed over in different orders)."""
    if not isinstance(err, ArgumentMismatchError):
        return False
    values = err.differences.get("compression/name", ())
    return len({re.sub(r"\|ddp\.bucket\d+", "", str(v)) for v in values}) > 1


def _hold_idle(feedback: ErrorFeedback, array: Any, layout: Layout | None,
               name: str | None) -> list[tuple[int, Any]]:
    """Take out of the bucket's residual, for this call, the pieces of the tensors whose
    gradient is all zero on this rank, and return them (offset, piece) to be put back after it.

    DDP fills the gradient of a parameter this rank did not use with zeros
    (``find_unused_parameters=True``) and, where no rank used it, drops its share of the
    result: a residual sent there would be lost. So what a rank holds for a tensor waits for a
    step whose gradient there is not all zero (a used tensor whose gradient is all zero waits
    too, and loses nothing)."""
    if layout is None or name is None or not feedback.holds(name):
        return []
    flat = array.reshape(-1)
    spans = [(off, n) for _, off, n in layout if n]
    if not spans:
        return []
    # Most gradients start with a nonzero: one gather of the first elements rules them out.
    firsts = _ops.get(flat).to_host(flat[[off for off, _ in spans]])
    idle = [(off, n) for (off, n), first in zip(spans, firsts, strict=True)
            if first == 0 and not bool(flat[off: off + n].any())]
    if not idle:
        return []
    residual = feedback.take(name, flat)
    held = []
    for off, n in idle:
        piece = residual[off: off + n]
        if bool(piece.any()):
            held.append((off, piece.copy()))
            piece[...] = 0
    return held


def _feedback(state: RingcommState, array: Any, layout: Layout | None,
              name: str | None) -> ErrorFeedback | None:
    """The error feedback of a bucket's call (None where it keeps none), its residual first
    made to match the bucket's ``layout`` (here, on the thread that runs the collectives, so
    no allreduce is using the residuals while they move)."""
    if layout is None or name is None:
        return None
    state._residuals.align(name, layout, array.reshape(-1))
    return state.feedback


def _reduce(state: RingcommState, buffer: torch.Tensor, compression: Compression | None,
            layout: Layout | None, name: str | None) -> torch.Tensor:
    operand = Operand(buffer)  # a view; a widened copy for bfloat16 buckets
    _allreduce(state, operand.array, buffer, compression, layout, name)
    operand.write_back()
    if layout is not None:  # error feedback kept
        keep_write_back_rounding(state.feedback, name, operand, "avg", state.comm.rank,
                                 state.comm.size)
    return buffer


def _reduce_on_side(state: RingcommState, buffer: torch.Tensor, ready: Any,
                    compression: Compression | None, layout: Layout | None,
                    name: str | None) -> torch.Tensor:
    """The bucket on the GPU, its work on the side stream after ``ready``."""
    with state._staging.side(buffer.device, ready) as stream:
        _reduce(state, buffer, compression, layout, name)
        stream.synchronize()  # the result complete before the future is (a widened write-back)
    return buffer


def _reduce_staged(state: RingcommState, buffer: torch.Tensor, ready: Any, index: int,
                   compression: Compression | None, layout: Layout | None,
                   name: str | None) -> torch.Tensor:
    """The bucket through its pinned host copy: download after ``ready``, reduce, upload."""
    with trace.span("HOOK_DOWNLOAD"):
        host = state._staging.download(index, buffer, ready)
    _allreduce(state, host.numpy(), buffer, compression, layout, name)
    with trace.span("HOOK_UPLOAD"):
        state._staging.upload(host, buffer)
    return buffer


def _reduce_started(state: RingcommState, buffer: torch.Tensor, ready: Any,
                    compression: Compression | None, layout: Layout | None, name: str | None,
                    fallback: Callable[[], torch.Tensor]) -> torch.Tensor | torch.futures.Future:
    """The bucket handed whole to the backend's own allreduce, which runs it on threads of its
    own (gloo's: a CUDA bucket goes through pinned host memory on gloo's streams, after
    ``ready``): its pending result. Where the backend starts nothing for it (a bucket of the
    inline size, one above RINGCOMM_GLOO_ALLREDUCE_BYTES, one the two-level allreduce takes,
    or one ``compression="auto"`` compresses or is still trying), ``fallback`` reduces it
    here, as such buckets are otherwise, and returns it."""
    with contextlib.ExitStack() as scope:
        if ready is not None:
            scope.enter_context(state._staging.side(buffer.device, ready))
        operand = Operand(buffer)  # a view: only float32/float64 buckets take this path
        feedback = _feedback(state, operand.array, layout, name)  # before Auto looks at it
        try:
            with trace.span("HOOK_START"):  # the agreement, and gloo's allreduce queued
                pending = state.comm.start_allreduce(
                    operand.array, op="avg", compression=compression, feedback=feedback,
                    name=name, algorithm=state.algorithm)
        except (ValueError, TypeError) as err:
            raise collective_error(state.comm, err, "allreduce", buffer) from err
    return fallback() if pending is None else pending


def _sparse_average(state: RingcommState, grad: torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    """The average over every rank of a sparse COO gradient (``grad``, coalesced, on the
    host), as a coalesced sparse tensor on ``device``: every rank's entries gathered, each
    divided by the world size, and added rank after rank, as DDP's own reduction of a sparse
    gradient does (it divides, then gloo's sparse allreduce adds the ranks' tensors in rank
    order). Exact, never compressed: the same gathered entries on every rank give every rank
    the same bits."""
    n = state.comm.size
    indices = Operand(grad.indices().transpose(0, 1).contiguous())
    values = Operand((grad.values() / n).contiguous())
    try:
        counts = state.comm.allgather(np.array([grad.values().shape[0]], dtype=np.int64))
        every_index = indices.result(state.comm.allgatherv(indices.array))
        every_value = values.result(state.comm.allgatherv(values.array))
    except (ValueError, TypeError) as err:
        raise collective_error(state.comm, err, "allreduce", grad) from err
    total = None
    for index, value in zip(every_index.split(counts.tolist()),
                            every_value.split(counts.tolist()), strict=True):
        part = torch.sparse_coo_tensor(index.transpose(0, 1), value, grad.shape,
                                       check_invariants=False)
        total = part if total is None else total + part
    assert total is not None
    return total.coalesce().to(device)


def _pass_on(future: torch.futures.Future, buffer: torch.Tensor,
             done: torch.futures.Future) -> None:
    """Complete the hook's ``future`` with the bucket's ``buffer`` (which the backend's result
    shares) as the backend's ``done`` completed."""
    try:
        done.value()  # the backend's error, if any
        future.set_result(buffer)
    except BaseException as err:  # never leave DDP waiting on a future nobody completes
        future.set_exception(err)


def _written(buffer: torch.Tensor) -> Any:
    """For a CUDA bucket, an event where backward's stream is now (the bucket is written, once
    it has passed); None for a CPU one."""
    if buffer.device.type != "cuda":
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(buffer.device))
    return ready


def ringcomm_hook(state: RingcommState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Average a DDP gradient bucket over all ranks with ringcomm, in place.

    Args:
        state: a RingcommState.
        bucket: the bucket DDP hands over (its buffer is not pre-divided by the world size).

    Returns:
        A future holding the bucket's buffer, averaged.

    Example::

        import ringcomm, ringcomm.torch as hvd
        from ringcomm.torch import RingcommState, ringcomm_hook
        from ringcomm.torch.process_group import init_process_group_from_mpi

        init_process_group_from_mpi()            # DDP's gloo group, under mpiexec
        model = torch.nn.parallel.DistributedDataParallel(net)
        model.register_comm_hook(RingcommState(compression=ringcomm.Int8()), ringcomm_hook)
    """
    state.check_spans_job()
    state.iteration_starts()
    buffer = bucket.buffer()
    if buffer.layout == torch.sparse_coo:
        return _sparse_hook(state, bucket, buffer)
    compression, name, layout = None, None, None
    if state.compresses(buffer):
        # The name keys the residuals and the compressor's own state (PowerSGD's Q).
        compression, name = state.compressor(bucket, buffer), f"ddp.bucket{bucket.index()}"
        if state.error_feedback:
            layout = state.layout(bucket, buffer)
    if bucket.is_last():
        state.iter += 1
    devices: list[int | str | torch.device] | None = (
        [buffer.device] if buffer.device.type == "cuda" else None)
    future: torch.futures.Future = torch.futures.Future(devices=devices)
    overlap = buffer.device.type == "cuda" if state.overlap is None else state.overlap
    starts = state.starts(buffer, compression, overlap)
    ready = _written(buffer) if starts or state.through_host(buffer) else None
    task: Callable[[], torch.Tensor | torch.futures.Future]
    if state.through_host(buffer):
        if state.stages(buffer, compression is not None):
            task = functools.partial(_reduce_staged, state, buffer, ready, bucket.index(),
                                     compression, layout, name)
        else:
            task = functools.partial(_reduce_on_side, state, buffer, ready, compression,
                                     layout, name)
    else:
        task = functools.partial(_reduce, state, buffer, compression, layout, name)
    if starts:
        # Decided on the thread that runs the calls, in the same order on every rank (an
        # Auto's choice changes at a call): started there, or reduced by ``task``.
        task = functools.partial(_reduce_started, state, buffer, ready, compression, layout,
                                 name, task)

    def settle(handle: Handle) -> None:
        try:
            result = handle.wait()
        except Exception as err:
            future.set_exception(err)
            return
        if isinstance(result, torch._C.Future):  # the backend's allreduce goes on
            result.add_done_callback(functools.partial(_pass_on, future, buffer))
        else:
            future.set_result(result)

    # Made here, on the thread running backward: it records that thread's stream, which the
    # background thread waits for before it reads the bucket.
    handle = Handle(buffer.device)
    handle.callback = settle
    state._engine.execute(state._counted(task), overlap=overlap, handle=handle,
                          caller=state._caller)
    return failing_for_cpp(future)  # an error reaches backward() as itself


def _sparse_hook(state: RingcommState, bucket: dist.GradBucket,
                 grad: torch.Tensor) -> torch.futures.Future:
    """The hook for a sparse gradient (an ``nn.Embedding(sparse=True)``'s: DDP gives each
    its own bucket, undivided): averaged exactly on the collectives' thread, in call order
    with the dense buckets; the future holds the sparse average, which DDP makes the
    parameter's gradient. A CUDA gradient is copied to the host here (on backward's thread,
    where it is written) and its average back to the GPU."""
    if bucket.is_last():
        state.iter += 1
    device = grad.device
    devices: list[int | str | torch.device] | None = [device] if device.type == "cuda" else None
    future: torch.futures.Future = torch.futures.Future(devices=devices)
    host = grad.coalesce().cpu()

    def settle(handle: Handle) -> None:
        try:
            future.set_result(handle.wait())
        except Exception as err:
            future.set_exception(err)

    handle = Handle(torch.device("cpu"))
    handle.callback = settle
    overlap = device.type == "cuda" if state.overlap is None else state.overlap  # as dense ones
    task = state._counted(functools.partial(_sparse_average, state, host, device))
    state._engine.execute(task, overlap=overlap, handle=handle, caller=state._caller)
    return failing_for_cpp(future)


# DDP's register_comm_hook compares these annotations with the classes themselves; postponed
# evaluation (the __future__ import) would leave strings there.
ringcomm_hook.__annotations__ = {"state": RingcommState, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
