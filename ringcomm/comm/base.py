"""The Communicator: argument checks, cross-rank agreement, and dispatch to the algorithms.

A Communicator wraps a :class:`~ringcomm.core.types.Transport` (the backend). Every collective
checks its arguments, agrees on them with the other ranks (:mod:`ringcomm.comm.agree`), then
hands the data to an algorithm over the transport: the ring (:mod:`ringcomm.algorithms.ring`), a
compressed allreduce (:mod:`ringcomm.algorithms.compressed`), or the transport's own library.

Why one module past 400 lines: the Communicator is the public surface, every collective with
its documented contract, and each method is short; how an allreduce is planned and run is in
:mod:`ringcomm.comm._allreduce`, the agreement in :mod:`ringcomm.comm.agree`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ringcomm import ops as _ops
from ringcomm.algorithms import ring
from ringcomm.algorithms.auto import AutoFigures
from ringcomm.comm import _arrays, _twolevel, agree, settings
from ringcomm.comm._allreduce import Allreduce
from ringcomm.comm._inline import allgather_inline, reduce_scatter_inline
from ringcomm.comm._plan import AllreducePlan
from ringcomm.comm.callers import caller
from ringcomm.comm.topology import resolve_topology
from ringcomm.core.types import (
    USER,
    Array,
    CommStats,
    ReduceOp,
    Transport,
    check_op,
)
from ringcomm.core.version import __version__

if TYPE_CHECKING:
    from ringcomm.algorithms.auto import Auto
    from ringcomm.codecs.base import Compressor
    from ringcomm.codecs.feedback import ErrorFeedback

__all__ = ["Communicator"]

_F = TypeVar("_F", bound=Callable[..., Any])
_NO_DEVICE = contextlib.nullcontext()  # reusable: entering it does nothing


def _serialized(method: _F) -> _F:
    """Run ``method`` holding the communicator's lock: one call at a time per communicator."""
    @wraps(method)
    def locked(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class Communicator:
    """Collectives over a fixed group of processes, the same on every backend.

    Arrays are NumPy arrays (host) or CuPy arrays (device) on the MPI and NCCL backends: the
    NCCL backend moves CuPy arrays over NCCL and NumPy arrays over its host transport. Every
    collective must be called by all ranks in the same order with matching arguments, and the
    same kind of array; with the consistency check on (the default), arguments that differ
    between ranks raise the same error on every rank instead of hanging.

    Device work (kernels, scratch buffers, stream waits) runs with the communicator's CUDA
    device current, whichever thread makes the call (``cuda_device``).

    Several threads may share a communicator: their calls run one at a time, and with the
    consistency check on each call is matched across ranks by the calling thread's name, so
    calls that pair up across ranks from different threads raise ArgumentMismatchError on
    every rank instead of mixing their data.

    Args:
        transport: the backend's Transport (``ringcomm.init`` builds it); the communicator
            owns it from here on, and closes it also when these options are refused.
        consistency_check: agree on every call's arguments before data moves.
        segment_bytes: ring segment size; the measured default when None.
        inline_bytes: dense allreduces up to this size ride in the agreement message.
        algorithm: the default of ``allreduce(algorithm=None)``: "auto", "flat" or
            "hierarchical" (env ``RINGCOMM_ALGORITHM``; "auto" when neither is given).
        topology: which ranks share a node, for the hierarchical allreduce: "auto" (host
            names; env ``RINGCOMM_RANKS_PER_NODE`` overrides it) or a number of ranks per
            node (consecutive blocks of ranks).
        startup_error: this rank's error in reading its options (``ringcomm.init`` reads
            them before the backend starts, without raising), raised here on every rank.

    Construction is collective: every rank's settings (the options above and the
    transport's timeout) are agreed in one exchange, and an error on any rank or a setting
    that differs raises the same error on every rank (see :mod:`ringcomm.comm.settings`).
    """

    def __init__(self, transport: Transport, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None,
                 algorithm: str | None = None, topology: str | int = "auto",
                 startup_error: Exception | None = None) -> None:
        try:
            # Read at the first call, a bad value failed there, on its rank alone.
            _ops.cpu_kernels()
            self._two_level = _twolevel.TwoLevel(
                transport, _twolevel.resolve_algorithm(algorithm), topology)
            self._setup(transport, consistency_check, segment_bytes, inline_bytes)
        except Exception as err:  # raised below, on every rank
            startup_error = startup_error or (
                err if isinstance(err, (TypeError, ValueError)) else ValueError(
                    f"{type(err).__name__}: {err}"))
        except BaseException:
            transport.close()  # a refused option must not leak the backend's resources
            raise
        try:
            transport.operation = "init"  # what a timeout of the exchange below names
            settings.agree_at_start(transport, self._settings() if startup_error is None
                                    else {}, startup_error)
        except BaseException:
            transport.close()
            raise
        transport.operation = ""

    def _setup(self, transport: Transport, consistency_check: bool, segment_bytes: int | None,
               inline_bytes: int | None) -> None:
        # Agreed as given (None: the default, which every rank derives alike from the agreed
        # topology and from whether all ranks share this node).
        self._inline_setting = None if inline_bytes is None else settings.check_bytes(
            int(inline_bytes), "inline_bytes", 0, 8, settings.MAX_INLINE_BYTES)
        inline = (self._default_inline(transport) if self._inline_setting is None
                  else self._inline_setting)
        self._transport = transport
        self._lock = threading.RLock()  # one call at a time (re-entered by nested calls)
        self._stats = transport.stats  # read on every call: one attribute, not two
        self._closed = False
        self._agreement = agree.Agreement(transport, check=bool(consistency_check),
                                          inline_bytes=inline,
                                          segment_bytes=ring.DEFAULT_SEGMENT_BYTES)
        self._allreduce = Allreduce(transport, self._agreement, self._two_level)
        self._plans = self._allreduce.plans
        # A failed transport (a timeout) refuses every call: the repeats' fast path, which
        # skips _ensure_open, finds no plan and takes the checked path, which refuses.
        transport.on_failure(self._plans.clear)
        self._route = self._allreduce.route
        self.segment_bytes = ring.DEFAULT_SEGMENT_BYTES if segment_bytes is None else segment_bytes

    def _default_inline(self, transport: Transport) -> int:
        """The inline size where none is given: the transport's (larger over MPI where every
        rank shares one node), unless the topology setting puts the ranks on several nodes,
        where the n - 1 copies of an inlined array would cross the NICs (the classic size)."""
        setting = self._two_level.setting
        if setting != "auto" and int(setting) < transport.size:
            return agree.INLINE_BYTES
        return transport.default_inline_bytes

    # ----------------------------------------------------------------------------- properties
    @property
    def backend(self) -> str:
        """The backend's name: "mpi", "nccl", "gloo" (torchrun) or "threads" (tests)."""
        return self._transport.backend

    @property
    def transport(self) -> Transport:
        """The Transport this communicator runs its algorithms over."""
        return self._transport

    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < size."""
        return self._transport.rank

    @property
    def size(self) -> int:
        """Number of processes in the communicator."""
        return self._transport.size

    @property
    def local_rank(self) -> int:
        """This rank's position among the communicator's ranks on its host."""
        return self._transport.local_rank

    @property
    def local_size(self) -> int:
        """How many of the communicator's ranks run on this host."""
        return self._transport.local_size

    @property
    def cuda_device(self) -> int | None:
        """The CUDA device this communicator's device work runs on: NCCL's GPU; on the MPI
        backend the one it selected when first given device arrays; None before that and on
        backends without one."""
        return self._transport.device_id

    @property
    def timeout(self) -> float:
        """Seconds any wait for the other ranks (and, on NCCL, for the GPU) may last before
        the call fails with CollectiveTimeoutError (the same on every rank: agreed at start)."""
        return self._transport.timeout

    @property
    def stats(self) -> CommStats:
        """Bytes on the wire and calls since creation or ``stats.reset()``."""
        return self._stats

    @property
    def consistency_check(self) -> bool:
        """Whether every call's arguments are agreed on across ranks before data moves."""
        return self._agreement.check

    @consistency_check.setter
    def consistency_check(self, value: bool) -> None:
        """Collective: every rank sets the same value at the same point (one checked
        exchange agrees on it; a rank setting it alone raises the same error everywhere)."""
        with self._lock:
            self._configure("consistency_check", bool(value))
            self._agreement.check = bool(value)
            self._plans.clear()  # prepared small calls depend on the check

    @property
    def segment_bytes(self) -> int:
        """Ring segment size in bytes; every rank must use the same: it travels in every
        call's header, so a rank that set another raises the same error on every rank at the
        next call (with the consistency check on; with it off, nothing is compared)."""
        return self._agreement.segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: int) -> None:
        self._ensure_open()
        self._agreement.segment_bytes = settings.check_bytes(
            int(value), "segment_bytes", 64, 1, settings.MAX_SEGMENT_BYTES)
        self._plans.clear()  # prepared small calls carry the old value in their headers

    @property
    def inline_bytes(self) -> int:
        """Dense arrays up to this size ride in the agreement message (fixed at creation)."""
        return self._agreement.inline_bytes

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm of calls that name none: "auto", "flat" or "hierarchical"
        (every rank must use the same: it is checked each call)."""
        return self._two_level.algorithm

    @algorithm.setter
    def algorithm(self, value: str) -> None:
        self._two_level.algorithm = _twolevel.check_algorithm(value)
        self._plans.clear()  # prepared small calls carry the old value in their headers

    @property
    def topology(self) -> str | int:
        """Which ranks share a node: "auto" (host names) or a number of ranks per node.

        Setting it is collective (every rank at the same point, between calls, to the same
        value: one checked exchange agrees on it, and otherwise every rank raises the same
        error and keeps its setting): the node-local and cross-node groups are made again by
        the next call that needs them.
        """
        return self._two_level.setting

    @topology.setter
    def topology(self, value: str | int) -> None:
        try:
            setting, error = resolve_topology(value), None
        except (TypeError, ValueError) as err:
            setting, error = value, err  # refused on every rank by the agreement
        with self._lock:
            self._configure("topology", setting, error)
            self._two_level.set_topology(setting)

    @property
    def auto_figures(self) -> AutoFigures:
        """What ``compression="auto"`` has measured on this communicator (link, codecs)."""
        return self._allreduce.figures

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank {self.rank} of {self.size}"
        return f"<{type(self).__name__} backend={self.backend!r} {state}>"

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ collectives
    def allreduce(self, x: Array, out: Array | None = None, *, op: str | ReduceOp = "sum",
                  compression: Compressor | Auto | str | None = None,
                  feedback: ErrorFeedback | None = None, name: str | None = None,
                  algorithm: str | None = None) -> Array:
        """Reduce ``x`` elementwise over all ranks; every rank gets the bit-identical result.

        Args:
            x: array of a supported dtype, any shape, contiguous or not; left untouched unless
                it is also ``out``.
            out: where to write the result (same shape and dtype as ``x``); ``out=x`` reduces in
                place. A new array is returned when omitted.
            op: "sum", "avg", "min", "max" or "prod"; compressed calls take "sum" or "avg".
            compression: a compressor (``FP16()``, ``BF16()``, ``Int8()``, ``TopK()``) for what
                the ring sends; None sends the dtype as it is; "auto" (or an ``Auto``) picks
                per call the fastest of the allowed choices for this link and size.
            feedback: an ErrorFeedback that keeps, under ``name``, what compression did not
                send and adds it to the next call.
            name: the tensor's name; required with ``feedback``, and checked to match across
                ranks.
            algorithm: "flat" (one ring over every rank), "hierarchical" (within each node,
                across nodes, within each node: see :mod:`ringcomm.algorithms.hierarchical`;
                nodes must hold the same number of ranks) or "auto" (hierarchical where
                there are several nodes of several ranks, for calls of at least 1 MiB dense or
                through a cast or Int8 (on device arrays: on 64 nodes or more), and top-k
                ones on 2 nodes or more for device arrays, 64 for host arrays: see
                :mod:`ringcomm.comm._twolevel`); the
                communicator's ``algorithm`` when None.
                Checked to match across ranks.

        Returns:
            The reduced array (``out`` when given), with the shape of ``x``.

        Raises:
            TypeError: unsupported dtype, or an op the dtype does not support.
            ValueError: unknown op, ``out`` of another shape, or arguments that differ between
                ranks (raised on every rank).
            RuntimeError: the communicator is closed.
        """
        lock = self._lock
        lock.acquire()  # not ``with``: on a call of a few microseconds its lookups show
        try:
            self._transport.operation = "allreduce"
            if compression is None and feedback is None and algorithm is None:
                prepared = self._plans.get(x, op)
                if prepared is not None and not self._closed:
                    repeat = prepared.repeat
                    if repeat is not None:
                        self._stats.calls += 1  # before the exchange, as the full path
                        result = repeat.run(x, out)
                        if result is not None:
                            return result
                        self._stats.calls -= 1  # arrays it cannot take as they are: the full path
                    elif self._plans.fits(x, out):
                        self._stats.calls += 1
                        prepared.spec.caller = caller()
                        return self._execute(prepared, x, out)
            if _arrays.is_subclass(x) or _arrays.is_subclass(out):
                result = self.allreduce(_arrays.plain(x), _arrays.plain(out), op=op,
                                        compression=compression, feedback=feedback, name=name,
                                        algorithm=algorithm)
                return result if out is None else out
            self._ensure_open()
            plan = self._allreduce.plan(x, out, op, compression, feedback, name, algorithm)
            self.stats.calls += 1
            return self._execute(plan, x, out)
        finally:
            lock.release()

    @_serialized
    def start_allreduce(self, x: Array, *, op: str | ReduceOp = "sum",
                        compression: Compressor | Auto | str | None = None,
                        feedback: ErrorFeedback | None = None, name: str | None = None,
                        algorithm: str | None = None) -> Any | None:
        """Start an uncompressed allreduce of ``x`` in place where the backend runs it on
        threads of its own, and return its pending result; None where it does not (nothing
        has run: reduce ``x`` with ``allreduce`` then, with the same arguments).

        For adapters that overlap communication with computation (the DDP hook). The call is
        checked and agreed on as ``allreduce(x, out=x, op=op, compression=compression,
        feedback=feedback, name=name, algorithm=algorithm)`` is, then started where the
        backend has such an allreduce for it: over gloo, float32/float64 sums and averages
        above the inline size on the flat ring, run by gloo's allreduce (which copies a CUDA
        array through pinned host memory on streams and threads of its own, after the work
        queued on the current stream). The result is then a ``torch.futures.Future`` that
        completes with the reduced tensor, sharing ``x``'s memory (CUDA-aware for a CUDA
        array: ``wait()`` orders the current stream after it), or raises the allreduce's
        error. Every rank gets the same answer.

        ``compression`` is None or ``"auto"`` (an ``Auto``): a call of an Auto is started only
        once the Auto has chosen to send arrays like ``x`` uncompressed (after its trial
        calls, and with no residual of ``name`` pending in ``feedback``); until then, or where
        it chose a compressor, nothing is started. Every rank decides alike: the Auto's choice
        is the same on every rank at the same call. A compressor is never started.

        Nothing is exchanged where nothing starts: the allreduce that follows agrees on the
        call, and raises the errors ``allreduce`` raises for bad arguments (on every rank; a
        rank that started its call raises them here).

        Raises:
            TypeError, ValueError: as ``allreduce`` (on every rank), where the call starts on
                some rank.
            RuntimeError: the communicator is closed.
        """
        self._ensure_open()
        if compression is not None and self._allreduce.policy(compression) is None:
            return None  # a compressor: allreduce runs it
        self._transport.operation = "allreduce"
        x = _arrays.plain(x)
        plan = self._allreduce.plan(x, x, op, compression, feedback, name, algorithm)
        with self._on_device(x):  # a bucket a call, not a hot path: no host fast path
            pending = self._allreduce.start(plan, x)
        if pending is not None:
            self.stats.calls += 1
        return pending

    @_serialized
    def reduce_scatter(self, x: Array, *, op: str | ReduceOp = "sum",
                       out: Array | None = None) -> Array:
        """Reduce ``x`` over all ranks and return this rank's chunk of the flattened result.

        Rank r gets elements ``[r * L // size, (r + 1) * L // size)`` of the L reduced elements.
        ``out``, where given, takes the chunk (an array of that many elements, ``x``'s kind and
        dtype, C-contiguous, any shape) and is returned; it may share memory with ``x``.
        """
        self._transport.operation = "reduce_scatter"
        prepared = self._plans.scatter(x, op)
        if prepared is not None and not self._closed:
            self.stats.calls += 1  # before the exchange, as the full path
            result = prepared.run(x, out)
            if result is not None:
                return result
            self.stats.calls -= 1  # arrays it cannot take as they are: the full path
        self._ensure_open()
        given, x = x, _arrays.plain(x)
        spec = agree.CallSpec("reduce_scatter")
        try:
            self._transport.check_arrays(x, *(() if out is None else (out,)))
            dt = spec.set_array(x)
            rop = spec.set_op(check_op(op, dt))
            if out is not None:
                r, n = self.rank, self.size
                _arrays.check_result_out(x, out, (r + 1) * x.size // n - r * x.size // n,
                                         f"rank {r}'s chunk of {x.size} over {n} ranks")
        except (TypeError, ValueError) as err:
            spec.error, rop = err, ReduceOp.SUM
        if (spec.error is None and self._agreement.check
                and x.nbytes <= self._agreement.inline_bytes):
            if type(x) is not np.ndarray:  # copied to the host: as allreduce's inline path
                self._transport.wait_gpu("reduce_scatter")
            self.stats.calls += 1  # the exchange counts its bytes
            with self._on_device(x):
                chunk = reduce_scatter_inline(self._agreement, spec, _arrays.flat(x), out, rop)
            if given is x:  # a plain host array: its repeats run prepared (ScatterPlan)
                self._plans.keep_scatter(x, op, spec, rop, self._agreement)
            return chunk
        self._agreement.agree(spec)
        self.stats.calls += 1
        with self._on_device(x):
            chunk = ring.reduce_scatter(self._route(x), _arrays.flat(x), rop,
                                        segment_bytes=self.segment_bytes,
                                        out=None if out is None else out.reshape(-1))
            return chunk if out is None else out

    def allgather(self, x: Array, *, out: Array | None = None) -> Array:
        """Concatenate ``x`` from every rank along the first axis, in rank order.

        Any dtype but object: allgather and broadcast only move bytes.

        Every rank must pass the same shape; use ``allgatherv`` when the first dimension differs.
        ``out``, where given, takes the result (``size * len(x)`` rows: an array of that many
        elements, ``x``'s kind and dtype, C-contiguous, any shape) and is returned; ``x`` may
        be a view of it (its own rows, as FSDP gathers).
        """
        return self._gather("allgather", x, out)

    def allgatherv(self, x: Array) -> Array:
        """Concatenate ``x`` from every rank along the first axis; first dimensions may differ."""
        return self._gather("allgatherv", x)

    @_serialized
    def broadcast(self, x: Array, root: int = 0) -> Array:
        """Overwrite ``x`` on every rank with root's ``x``, in place; returns ``x``."""
        self._ensure_open()
        self._transport.operation = "broadcast"
        given, x = x, _arrays.plain(x)
        spec = agree.CallSpec("broadcast")
        try:
            self._transport.check_arrays(x)
            spec.set_array(x, reduced=False)
            _arrays.check_writeable(x, "x")
            spec.root = self._check_rank(root, "root")
        except (TypeError, ValueError) as err:
            spec.error = err
        self._agreement.agree(spec)
        self.stats.calls += 1
        if x.size == 0:
            return given
        with self._on_device(x):
            t = self._route(x)
            if x.flags.c_contiguous:
                t.broadcast(x.reshape(-1), root)
            else:
                flat = _arrays.flat(x)
                t.broadcast(flat, root)
                x[...] = flat.reshape(x.shape)
        nbytes = x.nbytes
        self.stats.add(nbytes * (self.size - 1) if self.rank == root else 0,
                       0 if self.rank == root else nbytes)
        return given

    @_serialized
    def sendrecv(self, send: Array, dest: int, recv: Array, source: int) -> Array:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``; returns ``recv``.

        A point-to-point call: only the two peers take part, and sizes are not checked across
        ranks. A message longer than ``recv`` raises InvalidArgumentError on the receiving rank
        (MPI backend; the sender's call completes). It never matches a message of a collective
        in progress. ``send`` and ``recv`` may share memory (a shift in place: ``send`` is
        copied first).
        """
        self._ensure_open()
        self._transport.operation = "sendrecv"
        self._check_rank(dest, "dest")
        self._check_rank(source, "source")
        self._transport.check_arrays(send, recv)
        for label, arr in (("send", send), ("recv", recv)):
            if not hasattr(arr, "flags") or not arr.flags.c_contiguous:
                raise ValueError(f"{label} must be a contiguous array, got {type(arr).__name__}")
        with self._on_device(send, recv):
            send = _arrays.apart(send, recv)
            self._transport.isendrecv(send, dest, recv, source, channel=USER).wait()
        self.stats.calls += 1
        self.stats.add(send.nbytes, recv.nbytes)
        return recv

    @_serialized
    def checkpoint(self, label: str) -> None:
        """Agree that every rank has reached the point of the program ``label`` names.

        Collective, and checked whether or not the consistency check is on: a rank at
        another point, or in a collective, raises the same ``ArgumentMismatchError`` on every
        rank, naming what each rank was at. For code that runs some of its collectives
        outside the communicator (the torch.distributed backend's gloo fallback): each rank
        marks where it leaves, so that no rank waits in one path while another takes the
        other.

        Raises:
            ArgumentMismatchError: another rank is elsewhere (on every rank).
            InvalidTypeError: ``label`` is not a str on some rank (on every rank).
        """
        self._ensure_open()
        self._transport.operation = "checkpoint"
        error = None if isinstance(label, str) else TypeError(
            f"checkpoint's label must be a str, got {type(label).__name__}")
        self._agreement.checkpoint(str(label), error)

    @_serialized
    def barrier(self) -> None:
        """Block until every rank has called ``barrier()``.

        With the consistency check on, the agreement exchange is the barrier, so a rank in
        another collective meanwhile raises the same error everywhere instead of hanging.
        """
        self._ensure_open()
        self._transport.operation = "barrier"
        if self.consistency_check:
            self._agreement.agree(agree.CallSpec("barrier"))
        else:
            self._transport.barrier()

    @_serialized
    def close(self) -> None:
        """Release the communicator's resources; later calls raise RuntimeError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._plans.clear()
            self._two_level.close()
            self._agreement.release()
            self._transport.close()

    # ----------------------------------------------------------------------------- helpers
    def _settings(self) -> dict[str, Any]:
        """What every rank must share, by name (agreed when the communicator starts): ranks
        running different releases of ringcomm could frame or reduce a call differently."""
        return {settings.VERSION_SETTING: __version__, "backend": self.backend,
                "consistency_check": self.consistency_check, "segment_bytes": self.segment_bytes,
                "inline_bytes": ("default" if self._inline_setting is None
                                 else self._inline_setting),
                "algorithm": self.algorithm, "topology": self.topology,
                "timeout": self._transport.timeout}

    def _configure(self, name: str, value: Any, error: Exception | None = None) -> None:
        """Agree with every rank on setting ``name`` to ``value`` at this point, ``error``
        raised on every rank if any rank has one (collective; the caller holds the lock and
        applies the setting once this returns)."""
        self._ensure_open()
        self._transport.operation = "configure"
        self._agreement.agree_setting(name, value, error)

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")
        failure = self._transport.failure
        if failure is not None:
            raise RuntimeError(
                f"the {self.backend} communicator was aborted after an earlier failure and "
                f"refuses every call: close it and end the job (it failed with "
                f"{type(failure).__name__}: {failure})")

    def _on_device(self, *arrays: Array) -> Any:
        """A context making the backend's CUDA device current where any of ``arrays`` is a
        device array (a no-op context for host arrays, and on backends without a device)."""
        if not any(_ops.is_device_array(a) for a in arrays):
            return _NO_DEVICE
        return self._transport.device_scope()

    def _execute(self, plan: AllreducePlan, x: Array, out: Array | None) -> Array:
        """Run a planned allreduce (with the device current, for device arrays)."""
        if type(x) is np.ndarray:  # the host fast path: no device to make current
            return self._allreduce.run(plan, x, out)
        with self._on_device(x):
            return self._allreduce.run(plan, x, out)

    def _check_rank(self, r: int, label: str) -> int:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.size:
            raise ValueError(f"{label} must be a rank in [0, {self.size}), got {r!r}")
        return int(r)

    @_serialized
    def _gather(self, kind: str, x: Array, out: Array | None = None) -> Any:
        self._ensure_open()
        self._transport.operation = kind
        x = _arrays.plain(x)
        spec = agree.CallSpec(kind)
        try:
            self._transport.check_arrays(x, *(() if out is None else (out,)))
            spec.set_array(x, reduced=False)
            if x.ndim == 0:
                raise ValueError(f"{kind} needs an array with at least one dimension, got a scalar")
            if out is not None:  # allgather: every rank's x has this one's shape
                _arrays.check_result_out(x, out, x.size * self.size,
                                         f"x's {x.size} from each of {self.size} ranks")
        except (TypeError, ValueError) as err:
            spec.error = err
        if (kind == "allgather" and spec.error is None and self._agreement.check
                and type(x) is np.ndarray and x.nbytes <= self._agreement.inline_bytes):
            self.stats.calls += 1  # the exchange counts its bytes
            gathered = allgather_inline(self._agreement, spec, x)
            if out is None:
                return gathered
            out.reshape(-1)[...] = gathered.reshape(-1)
            return out
        headers = self._agreement.headers(spec)
        self.stats.calls += 1
        firsts = [int(h) for h in headers[:, agree.DIM0]]
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        counts = [d * row for d in firsts]
        with self._on_device(x):
            if out is None:
                out = _ops.get(x).empty((sum(firsts), *x.shape[1:]), x.dtype)
            if out.size:
                flat = out.reshape(-1)
                # x may be a view of out (its own rows): sent from a copy, as MPI and the
                # others need the send apart from what they receive into.
                self._route(x).allgatherv(_arrays.apart(_arrays.flat(x), flat), counts, flat)
        own = x.nbytes
        self.stats.add(own * (self.size - 1), out.nbytes - own)
        return out
