"""ringcomm as a torch.distributed backend: ``torch.distributed.init_process_group("ringcomm")``.

``import ringcomm.torch`` registers the backend "ringcomm" (:func:`register`), so that DDP,
FSDP and every framework built on torch.distributed can use ringcomm's ring without a hook::

    import ringcomm.torch  # registers "ringcomm"
    torch.distributed.init_process_group("ringcomm")     # under torchrun or mpiexec
    model = torch.nn.parallel.DistributedDataParallel(net)

The process group (:class:`RingcommProcessGroup`) runs allreduce (sum, avg, min, max,
product), broadcast, allgather (list and tensor forms), reduce-scatter (list and tensor
forms), the coalesced forms of allreduce, allgather and reduce-scatter, and barrier through a
ringcomm communicator over the group's processes: for the job's group, ``ringcomm.init``'s
(MPI under an MPI launcher, a gloo group of its own under torchrun); for a group of some of
the job's ranks (``new_group``), one its members make alone, as torch makes the group and
calls its collectives on its members only: over MPI (``MPI_Comm_create_group``) where an MPI
launcher started the job, else over the group's own gloo group (``ProcessGroupTransport``).
Results are exact and bit-identical on every rank (no compression here: compression stays
opt-in, through the DDP hook). A reduce op
ringcomm does not have (BAND, BOR, BXOR, PREMUL_SUM) raises the same ValueError on every rank,
naming the op and the backend. ``all_to_all_single`` first gathers every rank's dtype and
counts on the communicator, so that bad split sizes, dtypes that differ between ranks and
counts a rank does not expect raise the same error on every rank (gloo mixes the bytes of the
first without a word and ends the process on the last); the bytes then move in pairwise
exchanges over MPI, or through gloo's own all-to-all where the communicator is over gloo.
Every other collective (send/recv, gather, scatter, reduce) runs on a gloo process group over
the same store, registered as this group's backend for CPU tensors: correct, though not
ringcomm's ring.

The group defines every collective that PyTorch's C++ trampoline for Python groups forwards:
for a method the group lacked, the trampoline would call the gloo backend while holding the
GIL, which deadlocks with gloo's worker thread (it takes the GIL to release a finished
collective's tensors while holding its queue's lock).

The collectives run one at a time per group, in the order they were called (the same on every
rank): those the caller waits for at once (``async_op=False``, as FSDP2's on CPU) on the
calling thread where no other is pending (no thread handoff:
bench/results/dist_backend_inline.md), the others (``async_op=True``, however small) on a
thread of the group's own behind the pending ones, the call returning at once with a work
object, so that DDP overlaps its bucket allreduces with backward as on torch's own backends;
``work.wait()`` (what a call without ``async_op=True`` does) raises the collective's error,
if any, on the caller's thread.

Limits: CPU tensors (strided ones copied where they must be), of NumPy's dtypes for the
gathers and reduce-scatters. CUDA tensors run on torch's NCCL where torch has it and the
process a GPU (a NCCL process group over the same store, as torch's own "cpu:gloo,cuda:nccl"),
else on the gloo fallback, as do the other dtypes. Which
path a call takes depends on each rank's own tensors: a call that takes the fallback first
agrees on it with every rank (``Communicator.checkpoint``), so that a rank whose tensors took
the other path for the same call raises the same error as every other rank instead of
waiting in its path.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import queue
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ringcomm.backends.gloo import ProcessGroupTransport
from ringcomm.backends.gloo_held import hold, pause_at_exit
from ringcomm.backends.mpi_join import join as join_mpi
from ringcomm.backends.mpi_process import import_mpi, mpi_world_is_job
from ringcomm.comm.base import Communicator
from ringcomm.comm.callers import calls_as
from ringcomm.comm.settings import read as read_settings
from ringcomm.core.log import get_logger
from ringcomm.core.process_end import at_process_end
from ringcomm.core.restarts import attempt_prefix
from ringcomm.core.types import InvalidArgumentError
from ringcomm.registry import communicator_options
from ringcomm.torch import _all_to_all
from ringcomm.torch._futures import failing_for_cpp
from ringcomm.torch._gloo_views import Views, WrittenBack
from ringcomm.torch._operand_errors import in_torch_terms
from ringcomm.torch._tensors import Operand, as_array, resolved, travels_widened

__all__ = ["BACKEND_NAME", "RingcommProcessGroup", "register"]

#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND_NAME = "ringcomm"
_LOG = get_logger("torch.dist_backend")

# The thread that runs a group's collectives on ringcomm's communicator (see _Worker), named
# after the group: a process's live threads that call collectives need names of their own.
_WORKER_NAME = "ringcomm-process-group"

# torch.distributed exports the other options types, but not this one.
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions

# MPI_Comm_create_group's tags for sub-groups' communicators: every MPI has at least these.
_CREATE_TAGS = 32768


def _direct(output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether the communicator may write a collective's ``output`` itself: C-contiguous, of
    ``input``'s dtype and no negative view (else the result is copied into it, and cast)."""
    return (output.layout == torch.strided and output.is_contiguous()
            and output.dtype == input.dtype and not output.is_neg())


def _here(opts: Any) -> bool:
    """Whether a collective may run on the calling thread (where nothing is pending): one the
    caller waits for at once (``async_op=False``, as plain ``dist.all_reduce(t)`` and FSDP2's
    gathers and reduce-scatters of CPU tensors), which the group's thread would run while the
    caller waits, the handoff all it would add. Never one the caller does not wait for
    (``async_op=True``, DDP's buckets), however small: a rank may start such calls on two
    groups in one order while another starts them in the other, then wait for both, which
    torch's own backends complete; run here, the first would wait for the other rank's
    first, on another group, for good."""
    return not getattr(opts, "asyncOp", True)


def _torch_name(value: Any) -> str:
    """A torch dtype or layout as messages name it ("float32", "sparse_coo")."""
    return str(value).removeprefix("torch.")


def _refuse(comm: Any, problem: str | None) -> None:
    """Raise ``problem``, an error of this rank's own arguments found before its collective,
    on every rank, before anything moves: this rank marks the point with the problem
    (``Communicator.checkpoint``), so that a rank without it, gone into the collective, meets
    that mark in the collective's agreement and every rank raises ArgumentMismatchError
    naming what each was at; ranks with the same problem each raise it as ValueError."""
    if problem is not None:
        comm.checkpoint(problem)
        raise ValueError(problem)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch, [first, past the last): every element lies in between."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (their spans overlap; strided views that
    interleave without sharing count too: a copy too many, never one too few)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1 and a.device == b.device


def _overlapping(tensors: list[torch.Tensor]) -> bool:
    """Whether two of ``tensors`` may share memory (one listed twice, or views of one)."""
    return any(_meet(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1:])


def _apart(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``inputs`` of a coalesced call, each copied where it may share memory with another
    member's output: every member reads its input as it was when the call was made (as gloo
    does), not as an earlier member wrote it."""
    if len(inputs) < 2:
        return inputs
    return [t.clone() if any(_meet(t, o) for j, o in enumerate(outputs) if j != i) else t
            for i, t in enumerate(inputs)]


def _fit_problem(collective: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 size: int, *, gathering: bool) -> str | None:
    """What is wrong with a tensor collective's outputs for its inputs, or None: each output
    of its input's dtype (no cast: gloo and NCCL refuse one too), and of ``size`` times the
    input's elements (``gathering``) or the input of ``size`` times the output's."""
    for output, input in zip(outputs, inputs, strict=True):
        if output.dtype != input.dtype:
            return (f"{collective}: the output's dtype is "
                    f"{_torch_name(output.dtype)}, expected the input's, "
                    f"{_torch_name(input.dtype)}")
        names = ("output", "input") if gathering else ("input", "output")
        whole, part = (output, input) if gathering else (input, output)
        if whole.numel() != part.numel() * size:
            return (f"{collective}: the {names[0]} has {whole.numel()} elements, expected "
                    f"{part.numel() * size} (the {names[1]}'s {part.numel()} times the "
                    f"group's {size} ranks)")
    return None


def _gather_lists_problem(output_lists: list[list[torch.Tensor]],
                          inputs: list[torch.Tensor], size: int) -> str | None:
    """What is wrong with an all_gather's output lists for its inputs, or None: one output
    per rank, each of its input's shape and dtype (as gloo checks)."""
    for i, (outs, t) in enumerate(zip(output_lists, inputs, strict=True)):
        if len(outs) != size:
            return (f"all_gather: output list {i} has {len(outs)} tensors, expected one per "
                    f"rank ({size})")
        for r, out in enumerate(outs):
            if out.shape != t.shape or out.dtype != t.dtype:
                return (f"all_gather: output {r} of list {i} is "
                        f"{_torch_name(out.dtype)} {tuple(out.shape)}, expected "
                        f"the input's {_torch_name(t.dtype)} {tuple(t.shape)}")
    return None


# torch's reduce ops, by name, as ringcomm's (avg: ringcomm's own, exact as the others).
_OPS = {"SUM": "sum", "AVG": "avg", "MIN": "min", "MAX": "max", "PRODUCT": "prod"}


def _op_name(op: Any) -> str:
    """The name of a torch.distributed reduce op (a ReduceOp, or its RedOpType)."""
    op = getattr(op, "op", op)  # ReduceOp wraps a RedOpType
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1]


def _reduce_op(opts: Any) -> str:
    """ringcomm's name of the reduce op in ``opts``; for an op ringcomm does not have (BAND,
    BOR, BXOR, PREMUL_SUM), its own name in lower case, which the communicator refuses in its
    agreement, so that every rank raises (where only some ranks passed it too)."""
    name = _op_name(opts.reduceOp)
    return _OPS.get(name, name.lower())


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _integer_average(comm: Communicator, op: str, tensors: list[torch.Tensor],
                     collective: str) -> bool:
    """Whether ``op`` averages integer tensors here, which the backend runs as NCCL's
    ncclAvg (and so torch's NCCL groups) does: a sum, then a division by the group's size
    rounding toward zero (PyTorch Lightning's "mean" asks for it on every backend but gloo).
    The communicator averages floats only, so those tensors (see :func:`_op_of`) run as
    "sum" after a checkpoint that no plain sum on another rank passes (collective where
    True)."""
    if op != "avg" or not any(_integral(t) for t in tensors):
        return False
    comm.checkpoint(f"{collective} averaging integers")
    return True


def _op_of(t: torch.Tensor, op: str, summed: bool) -> str:
    """The communicator's op for ``t`` in a call whose integer averages run as sums."""
    return "sum" if summed and _integral(t) else op


def _divide_integers(t: torch.Tensor, size: int, summed: bool) -> None:
    """``t`` (a sum over ``size`` ranks, where ``summed`` and it is integral) divided by
    ``size``, rounding toward zero, as NCCL's ncclAvg."""
    if summed and _integral(t):
        t.div_(size, rounding_mode="trunc")


@contextlib.contextmanager
def _refusing_ops(collective: str) -> Iterator[None]:
    """Say which ops the backend has when the communicator refuses an unknown one (the same
    message on every rank: the communicator's names the rank that passed it)."""
    try:
        yield
    except InvalidArgumentError as err:
        if "unknown op" not in str(err):
            raise
        raise ValueError(f"{collective}: the {BACKEND_NAME} backend reduces with "
                         f"{', '.join(_OPS)}; {err}") from err


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the communicator's gathers and reduce-scatters as a NumPy view
    (strided ones included): a dense CPU tensor of a dtype NumPy has (the others run on the
    gloo fallback)."""
    return t.device.type == "cpu" and t.layout == torch.strided and t.dtype in _NUMPY_DTYPES


def _reducible(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the communicator's reduce-scatter: ``_plain``, but 8-bit integers,
    which its reductions refuse and gloo sums as torch does, wrapping around (16-bit ones,
    which gloo refuses too, stay: the communicator's refusal names the dtype)."""
    return _plain(t) and t.dtype not in _NARROW_INTEGERS


def _bytes_of(t: torch.Tensor) -> bool:
    """Whether the communicator's all-to-all may move ``t`` as its bytes: a dense CPU tensor
    (any dtype but a quantized one)."""
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized


def _read(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inputs as their values (see ``resolved``: a conjugate or negative view as a copy)."""
    return [resolved(t) for t in tensors]


def _carried(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the communicator's allreduce and broadcast (as an Operand: a
    NumPy view, a widened copy, or a resolved copy of a conjugate or negative view): a dense
    CPU tensor of a dtype NumPy has, or bool or bfloat16. The others (sparse and quantized
    tensors, float8 and the other dtypes NumPy lacks) run on the gloo fallback, which sums
    sparse tensors as DDP's sparse gradients need and refuses the rest, on every rank: each
    rank decides by its own tensors, and the fallback's agreement comes first."""
    return (t.device.type == "cpu" and t.layout == torch.strided
            and (t.dtype in _OPERAND_DTYPES or travels_widened(t.dtype)))


_NARROW_INTEGERS = frozenset({torch.int8, torch.uint8})
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8,
                           torch.uint8, torch.int16, torch.int32, torch.int64})
# What an Operand hands over as a view of the tensor's own memory (``Tensor.numpy()``):
# the communicator then refuses, on every rank, the dtypes it does not reduce.
_OPERAND_DTYPES = _NUMPY_DTYPES | {torch.complex64, torch.complex128, torch.uint16,
                                   torch.uint32, torch.uint64}


def _eager(cls: type) -> type:
    """``cls`` with the methods PyTorch's C++ calls run eagerly, never traced by torch.compile.

    c10d calls a Python group's collectives, and DDP's reducer its work objects, from C++;
    in a compiled model's forward (DDP rebuilding its buckets, broadcasting its buffers)
    TorchDynamo would trace those Python frames and stop at the group's attributes
    (UnsafeScriptObjectError: the group is an opaque object to it), where torch's own C++
    groups have no frame to trace. Disabled lazily: TorchDynamo (2.6 s to import here) is
    imported at the first call, never by ``import torch``, which registers this backend.
    About 1.3 us a call on a loaded machine (torch.compiler.disable's own 1.0 us there).
    """
    for name, member in list(vars(cls).items()):
        if callable(member) and (not name.startswith("_") or name in _CALLED_FROM_CPP):
            setattr(cls, name, _disable_dynamo(member))
    return cls


def _layout(t: torch.Tensor) -> str:
    """A tensor's layout as a word before its dtype in a message: "" for a dense one."""
    return "" if t.layout == torch.strided else f"{_torch_name(t.layout)} "


# PyTorch's own lazy form of torch.compiler.disable (what its optimizers use), where it has one.
_disable_dynamo = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


# The underscored methods of a Python group that c10d's trampoline calls.
_CALLED_FROM_CPP = frozenset({"_allgather_base", "_reduce_scatter_base"})


_eager(WrittenBack)  # a fallback's work, which DDP's reducer may wait on from C++


@_eager
class _Work(dist._Work):
    """The work object of one collective: ``wait()`` raises the collective's error on the
    caller's thread, and ``get_future()`` (what DDP waits on) is completed with its result or
    its error. (A work made by torch's ``_create_work_from_future`` would return from
    ``wait()`` without raising the future's error: a failed collective would pass silently.)

    The collective completes ``future`` with ``set_result`` or ``set_exception``, a failure
    that C++ does not see (DDP's reducer crashed reading the error as tensors): what
    ``get_future()`` gives is failed for C++ too (ringcomm.torch._futures)."""

    def __init__(self, future: Future[Any]) -> None:
        super().__init__()
        self._future = future
        self._chained: Future[Any] | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._future.wait()  # raises the collective's error, if any
        return True

    def get_future(self) -> Future[Any]:
        if self._chained is None:  # made when asked: most callers only wait
            self._chained = failing_for_cpp(self._future)
        return self._chained

    def result(self) -> Any:
        """The collective's output tensors, once it is done (raising its error, if any)."""
        self._future.wait()
        return self._future.value()

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True


@_eager
class _Works(dist._Work):
    """Several works of the gloo fallback as one: ``wait()`` waits for each (raising the first
    failed one's error); the future completes with ``result`` once all have, or with the
    first error. (Nothing here waits inside a future's callback: gloo completes its futures
    on its own worker thread.)"""

    def __init__(self, works: list[Any], result: Any) -> None:
        super().__init__()
        self._works, self._result = works, result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def result(self) -> Any:
        """The output tensors, once every work is done (raising the first failed one's
        error)."""
        self.wait()
        return self._result

    def get_future(self) -> Future[Any]:
        result = self._result

        def settled(everyone: Future[list[Future[Any]]]) -> Any:
            for done in everyone.value():
                done.value()  # raises a failed collective's error
            return result
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(settled)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)


class _Worker:
    """Runs a group's collectives one at a time, in the order they were submitted (the same
    on every rank): one that may run here (see _here) on the submitting thread where none is
    queued or running (no thread handoff, which cost more than the call: 31 us against 22 for
    an 8-byte all_reduce), the others on a thread of the group's own, behind what is
    pending, so that the caller (DDP's autograd thread, say) goes on meanwhile, as with
    torch's own backends. Either way the calls are made under the worker's name
    (``calls_as``), which the agreement matches across ranks.

    Completing a collective's future runs the callbacks chained to it (``.then``) on the
    thread that completes it. A collective such a callback calls (torch's PowerSGD hook
    allreduces its P matrices in one and waits) runs there and then, right after the one
    whose callback it is, as on every rank: queued, it would wait for the thread that waits
    for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._state = threading.Lock()  # guards _pending and the start of the thread
        self._pending = 0  # submitted and not finished
        self._running = threading.Lock()  # held by whichever thread runs a collective
        self._thread: threading.Thread | None = None
        self._completing = threading.local()  # .depth > 0: running a future's callbacks

    def submit(self, run: Callable[[], Any], future: Future[Any], may_run_here: bool) -> None:
        """Run ``run`` and complete ``future`` with its result or error: here and now where
        ``may_run_here`` and nothing is pending, or where this thread is completing another
        collective's future (a callback's collective: this thread holds the group), else on
        the group's thread after what is pending."""
        if getattr(self._completing, "depth", 0):
            with self._state:
                self._pending += 1
            try:
                with calls_as(self.name):
                    self._settle(run, future)
            finally:
                self._finished()
            return
        with self._state:
            here = may_run_here and self._pending == 0
            self._pending += 1
            if here:  # free: whoever ran last released it before it stopped pending
                self._running.acquire()
            elif self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name,
                                                daemon=True)
                self._thread.start()
        if not here:
            self._queue.put((run, future))
            return
        try:
            with calls_as(self.name):
                self._settle(run, future)
        finally:
            self._running.release()
            self._finished()

    def stop(self) -> None:
        """Run what is queued, then end the thread."""
        with self._state:
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _finished(self) -> None:
        with self._state:
            self._pending -= 1

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._running:
                self._settle(*item)
            self._finished()

    def _settle(self, run: Callable[[], Any], future: Future[Any]) -> None:
        """Complete ``future`` with ``run()``'s result, or its error (raised by whoever
        waits), running its callbacks as this thread's (see :meth:`submit`)."""
        try:
            result = run()
        except BaseException as err:  # handed to whoever waits for the work
            error: BaseException | None = err
        else:
            error = None
        local = self._completing
        local.depth = getattr(local, "depth", 0) + 1
        try:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        finally:
            local.depth -= 1


def _nccl_backend(store: Any, rank: int, size: int,
                  timeout: datetime.timedelta) -> Any | None:
    """torch's NCCL process group over ``store`` for a group's CUDA tensors, made as torch
    makes the one of "cpu:gloo,cuda:nccl" (its communicators at their first collective);
    None where this torch has no NCCL or the process sees no GPU."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("ringcomm-nccl", store), rank, size, options)


def _pairwise(collective: Callable[..., Any], outputs: list[torch.Tensor],
              inputs: list[torch.Tensor], opts: Any) -> Any:
    """Each (output, input) pair through ``collective``, a method of a fallback group,
    called here on the caller's thread (like every call of the fallback, so that they reach
    it in the caller's order), as one work."""
    works = [collective(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
    return works[0] if len(works) == 1 else _Works(works, outputs)


def _this_attempts(store: Any) -> Any:
    """``store`` under a prefix of this torchrun attempt's own, where it holds the keys of an
    earlier attempt of a restarted job (``ringcomm.core.restarts``)."""
    prefix = attempt_prefix()
    return dist.PrefixStore(prefix, store) if prefix else store


@_eager
class RingcommProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a ringcomm communicator.

    Made by torch.distributed (``init_process_group("ringcomm")`` or ``new_group(...,
    backend="ringcomm")``) through the creator :func:`register` installs; users do not make
    one themselves.

    Args:
        store: the rendezvous store torch.distributed made for this group.
        rank, size: this process's rank in the group, and the group's size.
        timeout: the group's timeout (also the communicator's).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._timeout = timeout
        store = _this_attempts(store)
        # gloo over the same store: the control plane while the communicator is made, and the
        # backend of every collective this group does not run itself.
        self._store = store
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("ringcomm-gloo", store), rank, size,
                                           timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._gloo)
        # torch's NCCL for CUDA tensors, where this torch has NCCL and the process a GPU (as
        # torch's own "cpu:gloo,cuda:nccl"); else they run on gloo too.
        self._nccl = _nccl_backend(store, rank, size, timeout)
        if self._nccl is not None:
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL,
                                   self._nccl)
        pause_at_exit()  # for the tensors PyTorch hands this gloo group itself (reduce, ...)
        self._comm: Communicator | None = None
        self._mpi_comm: Any = None  # a sub-group's members' MPI communicator (see below)
        self._making = self._shut = False
        self._worker: _Worker | None = None
        _LIVE.add(self)
        at_process_end(_shutdown_at_exit, order=10)  # before MPI_Finalize (mpi_join)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def communicator(self) -> Communicator | None:
        """The ringcomm communicator, once the first collective made it."""
        return self._comm

    def _communicator(self) -> Communicator | None:
        """The communicator, made by the first collective (on every member at the same
        call; for a group smaller than the job, by its members alone); None while it is
        being made (the collectives that make it run on gloo)."""
        if self._comm is not None or self._making:
            return self._comm
        self._making = True
        try:
            if self.size() == dist.get_world_size() and self._numbered_as_job():
                self._comm = self._job_communicator()
            else:  # some of the job's ranks, or all of them in another order
                self._comm = self._members_communicator()
            # It waits the group's timeout, which its timeout errors name.
            self._comm.transport.timeout_source = (
                "the group's timeout, dist.init_process_group(timeout=...) or "
                "dist.new_group(timeout=...)")
        finally:
            self._making = False
        return self._comm

    def _numbered_as_job(self) -> bool:
        """Whether this group numbers every process as torch's default group does (that
        group itself, or all its ranks in its order): asked of every member, so that all
        make the same kind of communicator."""
        same = int(self.rank() == dist.get_rank())
        return all(row[0] for row in self._gather_ints([same]))

    def _job_communicator(self) -> Communicator:
        """ringcomm.init()'s communicator over the job, numbered as this group is: over MPI
        under an MPI launcher, and under torchrun too where every process can join one MPI
        world over this group's store (``ringcomm.backends.mpi_join``), else over gloo."""
        from ringcomm import init

        if not mpi_world_is_job() and self.size() > 1:
            # MPI's world numbered as torch's default group (this group may number otherwise:
            # then _check_numbering below says so, on every rank).
            cannot = join_mpi(self._store, dist.get_rank(), dist.get_world_size(),
                              self._timeout.total_seconds())
            if cannot is not None:
                _LOG.info("the ringcomm backend stays on gloo: MPI cannot join the job's "
                          "processes (%s)", cannot)
        comm = init(timeout=self._timeout.total_seconds(), abort_on_exception=False)
        try:
            self._check_numbering(comm)
        except RuntimeError:
            comm.close()
            raise
        return comm

    def _members_communicator(self) -> Communicator:
        """A communicator of this sub-group's members alone (torch makes a group, and calls
        its first collective, on its members only), numbered as the group is: over an MPI
        communicator made by them (``MPI_Comm_create_group``, collective over the members
        only) where an MPI launcher started the whole job, else over the group's own gloo
        group (torchrun's processes share no MPI world); the same choice on every member."""
        ranks = self._members_mpi_ranks()
        if ranks is None:
            return self._gloo_communicator()
        from ringcomm import init

        MPI = import_mpi()
        world = MPI.COMM_WORLD
        members = world.Get_group().Incl(ranks)
        try:  # a tag of the group's own, for groups of shared members made at once
            self._mpi_comm = world.Create_group(members, zlib.crc32(
                self.group_name.encode()) % _CREATE_TAGS)
        finally:
            members.Free()
        _LOG.debug("group of %d of the job's %d ranks: MPI ranks %s", self.size(),
                   dist.get_world_size(), ranks)
        return init(mpi_comm=self._mpi_comm, timeout=self._timeout.total_seconds(),
                    abort_on_exception=False)

    def _gloo_communicator(self) -> Communicator:
        """A communicator over a gloo group of this group's members, made over its store,
        with the options and environment variables of ``ringcomm.init`` (agreed by the
        members)."""
        settings, startup_error = read_settings(timeout=self._timeout.total_seconds())
        # A gloo group of its own: gloo pairs collectives by the order they reach a group,
        # and the fallback's reach self._gloo from the caller's thread while the
        # communicator's run on the worker's.
        store = dist.PrefixStore("ringcomm-communicator", self._store)
        group = dist.ProcessGroupGloo(dist.PrefixStore("group", store), self.rank(),
                                      self.size(), self._timeout)
        transport = ProcessGroupTransport(group, dist.PrefixStore("splits", store),
                                          timeout=settings.timeout)
        transport.world_ranks = tuple(dist.get_process_group_ranks(self))  # for messages
        transport.world_size = dist.get_world_size()
        _LOG.debug("group of %d of the job's %d ranks (%s): over its gloo group", self.size(),
                   dist.get_world_size(), transport.world_ranks)
        return Communicator(transport, **communicator_options(settings, startup_error))

    def _members_mpi_ranks(self) -> list[int] | None:
        """Each member's rank in MPI's world, in this group's order, where MPI's world is the
        job (an MPI launcher started it); None elsewhere: gathered over the members' gloo
        group, so every member gets the same answer."""
        mine = -1
        if mpi_world_is_job():
            try:
                world = import_mpi().COMM_WORLD
            except RuntimeError:  # no mpi4py
                world = None
            if world is not None and world.Get_size() == dist.get_world_size():
                mine = world.Get_rank()
        ranks = [row[0] for row in self._gather_ints([mine])]
        return None if min(ranks) < 0 or len(set(ranks)) != len(ranks) else ranks

    def _gather_ints(self, mine: list[int]) -> list[list[int]]:
        """Every member's ``mine`` (as many ints on each), in group order, over the gloo
        group: the control plane of the communicator's making."""
        row = torch.tensor(mine, dtype=torch.int64)
        table = torch.empty(len(mine) * self.size(), dtype=torch.int64)
        hold(table, row)
        self._gloo._allgather_base(table, row, _AllgatherOptions()).wait()
        return table.view(self.size(), len(mine)).tolist()

    def _check_numbering(self, comm: Communicator) -> None:
        """Raise the same RuntimeError on every rank unless ``comm`` numbers every process as
        this group does (a job whose launcher and torch.distributed number the processes
        differently would otherwise sum the wrong ranks' data, or hang on the ranks that do
        match): each rank's (rank, size) in ``comm``, gathered over the gloo group."""
        seen = [tuple(pair) for pair in self._gather_ints([comm.rank, comm.size])]
        wrong = [f"rank {g} is ringcomm's rank {r} of {n}"
                 for g, (r, n) in enumerate(seen) if (r, n) != (g, self.size())]
        if wrong:
            raise RuntimeError(
                f"the ringcomm backend's group of {self.size()} numbers its processes unlike "
                f"ringcomm.init(): {'; '.join(wrong)} (the launcher and "
                f"torch.distributed.init_process_group number the processes differently)")

    # ------------------------------------------------------------------------ collectives
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if opts is None:
            opts = dist.AllreduceOptions()
        comm = self._communicator()
        if comm is None or not all(_carried(t) for t in tensors):
            views = Views()
            staged = views.writes(tensors)
            return views.work(self._fallback("all_reduce", staged).allreduce(staged, opts),
                              tensors)
        op = _reduce_op(opts)

        def run() -> list[torch.Tensor]:
            # Tensors that share memory (all_reduce_coalesced of one tensor twice, or of views
            # of one) hold the sum once, as on gloo, which reduces the list's values as they
            # were: copies reduced, then written back. As many collectives either way, on
            # every rank.
            work = [t.clone() for t in tensors] if _overlapping(tensors) else tensors
            summed = _integer_average(comm, op, work, "all_reduce")
            for t in work:
                x = Operand(t)
                with _refusing_ops("all_reduce"), in_torch_terms(comm, "all_reduce", t, x.array):
                    comm.allreduce(x.array, out=x.array, op=_op_of(t, op, summed))
                x.write_back()
                _divide_integers(t, comm.size, summed)
            if work is not tensors:
                for t, w in zip(tensors, work, strict=True):
                    t.copy_(w)
            return tensors
        return self._submit(run, here=_here(opts))

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if opts is None:
            opts = dist.BroadcastOptions()
        comm = self._communicator()
        if comm is None or not all(_carried(t) for t in tensors):
            views = Views()
            staged = views.writes(tensors)
            return views.work(self._fallback("broadcast", staged).broadcast(staged, opts),
                              tensors)
        root = opts.rootRank

        def run() -> list[torch.Tensor]:
            for t in tensors:
                x = Operand(t)
                with in_torch_terms(comm, "broadcast", t, x.array):
                    comm.broadcast(x.array, root=root)
                x.write_back()
            return tensors
        return self._submit(run, here=_here(opts))

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        inputs = _read(inputs)
        comm = self._communicator()
        if opts is None:
            opts = _AllgatherOptions()
        if comm is None or not all(_plain(t) for t in inputs):
            views = Views()
            ins, outs = views.reads(inputs), [views.writes(ts) for ts in output_lists]
            fallback = self._fallback("all_gather", ins, held=[t for ts in outs for t in ts])
            return views.work(fallback.allgather(outs, ins, opts), output_lists)

        size = self.size()

        def run() -> Any:
            _refuse(comm, _gather_lists_problem(output_lists, inputs, size))
            for outs, t in zip(output_lists, inputs, strict=True):
                gathered = comm.allgather(as_array(t).reshape(1, -1))
                for r, out in enumerate(outs):
                    out.copy_(torch.from_numpy(gathered[r]).view(out.shape))
            return output_lists
        return self._submit(run, here=_here(opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Any:
        return self.all_gather_single_coalesced([output], [input], opts)

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Any:
        inputs = _read(inputs)
        comm = self._communicator()
        if opts is None:
            opts = _AllgatherOptions()
        if comm is None or not all(_plain(t) for t in inputs):
            views = Views()
            ins, outs = views.reads(inputs), views.writes(outputs)
            fallback = self._fallback("all_gather_into_tensor", ins, held=outs)
            return views.work(_pairwise(fallback._allgather_base, outs, ins, opts), outputs)

        size = self.size()

        def run() -> list[torch.Tensor]:
            _refuse(comm, _fit_problem("all_gather_into_tensor", outputs, inputs, size,
                                       gathering=True))
            for output, input in zip(outputs, _apart(outputs, inputs), strict=True):
                if _direct(output, input):  # into the output
                    comm.allgather(as_array(input).reshape(1, -1),
                                   out=as_array(output).reshape(size, -1))
                else:
                    gathered = comm.allgather(as_array(input).reshape(1, -1))
                    output.copy_(torch.from_numpy(gathered.reshape(-1)).view(output.shape))
            return outputs
        return self._submit(run, here=_here(opts))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # its name before torch 2.12

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if opts is None:
            opts = dist.AllreduceCoalescedOptions()
        if self._communicator() is None or not all(_carried(t) for t in tensors):
            return self._fallback("all_reduce_coalesced", tensors).allreduce_coalesced(
                tensors, opts)
        plain = dist.AllreduceOptions()
        plain.reduceOp = opts.reduceOp
        plain.asyncOp = getattr(opts, "asyncOp", True)
        return self.allreduce(tensors, plain)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Any:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._reduce_scatter(outputs, inputs, opts, "reduce_scatter_tensor")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # before torch 2.12

    def reduce_scatter(self, outputs: list[torch.Tensor],
                       input_lists: list[list[torch.Tensor]], opts: Any = None) -> Any:
        input_lists = [_read(ts) for ts in input_lists]
        pieces = [t for ts in input_lists for t in ts]
        if self._communicator() is None or not all(_reducible(t) for t in (*outputs, *pieces)):
            views = Views()
            outs, ins = views.writes(outputs), [views.reads(ts) for ts in input_lists]
            fallback = self._fallback("reduce_scatter", outs, held=[t for ts in ins for t in ts])
            return views.work(fallback.reduce_scatter(outs, ins, opts if opts is not None
                                                      else dist.ReduceScatterOptions()),
                              outputs)
        # One input per rank, each of its output's size and dtype (refused on every rank).
        wrong = [f"input list {i}'s tensor for rank {r} is {t.numel()} elements of "
                 f"{_torch_name(t.dtype)}, its output {o.numel()} of "
                 f"{_torch_name(o.dtype)}"
                 for i, (o, ts) in enumerate(zip(outputs, input_lists, strict=True))
                 for r, t in enumerate(ts) if t.numel() != o.numel() or t.dtype != o.dtype]
        wrong += [f"input list {i} has {len(ts)} tensors, expected one per rank "
                  f"({self.size()})"
                  for i, ts in enumerate(input_lists) if len(ts) != self.size()]
        flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in input_lists]
        return self._reduce_scatter(outputs, flat, opts, "reduce_scatter",
                                    wrong[0] if wrong else None)

    def _reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                        opts: Any, what: str, wrong: str | None = None) -> Any:
        """Reduce-scatter each of ``inputs`` into its output; ``wrong``: an error of this
        rank's arguments, raised on every rank before anything moves."""
        inputs = _read(inputs)
        comm = self._communicator()
        if opts is None:
            opts = dist.ReduceScatterOptions()
        if comm is None or not all(_reducible(t) for t in inputs):
            views = Views()
            ins, outs = views.reads(inputs), views.writes(outputs)
            fallback = self._fallback(what, ins, held=outs)
            return views.work(_pairwise(fallback._reduce_scatter_base, outs, ins, opts),
                              outputs)
        op = _reduce_op(opts)
        size = self.size()

        def run() -> list[torch.Tensor]:
            _refuse(comm, f"{what}: {wrong}" if wrong is not None else _fit_problem(
                what, outputs, inputs, size, gathering=False))
            summed = _integer_average(comm, op, inputs, what)
            for output, input in zip(outputs, _apart(outputs, inputs), strict=True):
                direct = _direct(output, input)
                with _refusing_ops("reduce_scatter"):
                    chunk = comm.reduce_scatter(
                        as_array(input).reshape(-1), op=_op_of(input, op, summed),
                        out=as_array(output).reshape(-1) if direct else None)
                if not direct:
                    output.copy_(torch.from_numpy(chunk).view(output.shape))
                _divide_integers(output, comm.size, summed)
            return outputs
        return self._submit(run, here=_here(opts))

    def _on_nccl(self, tensors: list[torch.Tensor]) -> bool:
        """Whether a call of ``tensors`` that leaves ringcomm's communicator goes to torch's
        NCCL (CUDA tensors, where the group has it) rather than to gloo."""
        return self._nccl is not None and any(t.device.type == "cuda" for t in tensors)

    def _fallback(self, collective: str, tensors: list[torch.Tensor], *, sizes: bool = True,
                  held: list[torch.Tensor] | None = None) -> Any:
        """The process group that runs a collective ringcomm's communicator does not take
        (its tensors are CUDA ones, or of a dtype NumPy lacks): torch's NCCL for CUDA tensors
        where there is one, else gloo; the tensors handed to gloo (``tensors`` and ``held``)
        are held until gloo lets go of them (gloo_held).

        For a group with a communicator, first, once the collectives queued before it have
        run, agree with every rank that each takes that fallback here, with tensors of the
        same dtypes (and ``sizes``, element counts). Which path a call takes depends on each
        rank's own tensors; a rank on another path would otherwise wait there until the
        timeout, where now every rank raises the same ArgumentMismatchError, naming each
        rank's call. And gloo mixes the bytes of tensors whose dtypes differ between ranks
        without a word (each rank gets another wrong answer), or ends the process where their
        sizes differ."""
        cuda = self._on_nccl(tensors)
        fallback, name = (self._nccl, "NCCL") if cuda else (self._gloo, "gloo")
        comm = self._comm
        if comm is not None:
            what = ", ".join(f"{_layout(t)}{_torch_name(t.dtype)}"
                             f"{f' [{t.numel()}]' if sizes else ''}" for t in tensors)
            label = f"{collective} of {what} on the {name} fallback"
            # After the pending collectives (their exchanges come first), as one of them.
            self._submit(lambda: comm.checkpoint(label), here=True).wait()
        if not cuda:
            hold(*tensors, *(held or ()))
        return fallback

    # reduce, gather and scatter run on gloo (NCCL for CUDA tensors, where the group has it),
    # after the agreement of the fallback (the root included; the communicator made first, as
    # by any collective), views as contiguous copies.
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        self._communicator()
        views = Views()
        staged = views.writes(tensors)
        fallback = self._fallback(f"reduce to rank {opts.rootRank}", staged)
        return views.work(fallback.reduce(staged, opts), tensors)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        self._communicator()
        views = Views()
        ins, outs = views.reads(inputs), [views.writes(ts) for ts in output_lists]
        fallback = self._fallback(f"gather to rank {opts.rootRank}", ins,
                                  held=[t for ts in outs for t in ts])
        return views.work(fallback.gather(outs, ins, opts), output_lists)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        self._communicator()
        views = Views()
        outs, ins = views.writes(outputs), [views.reads(ts) for ts in input_lists]
        fallback = self._fallback(f"scatter from rank {opts.rootRank}", outs,
                                  held=[t for ts in ins for t in ts])
        return views.work(fallback.scatter(outs, ins, opts), outputs)

    def barrier(self, opts: Any = None) -> Any:
        comm = self._communicator()
        if comm is None:
            return self._gloo.barrier(opts if opts is not None else dist.BarrierOptions())
        return self._submit(comm.barrier, here=True)

    # Point-to-point runs on gloo (NCCL for CUDA tensors, where the group has it): torch hands
    # a receive from any source to the backend of the tensor's device from C++, without
    # passing through here, so the sends it meets go there too. Sends and receives from a
    # given rank pass through here, where torch lets a Python group take them, so that the
    # tensors handed to gloo are held until gloo lets go of them (gloo_held).
    def _peer_backend(self, tensors: list[torch.Tensor]) -> Any:
        if self._on_nccl(tensors):
            return self._nccl
        hold(*tensors)
        return self._gloo

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Any:
        return self._peer_backend(tensors).send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Any:
        return self._peer_backend(tensors).recv(tensors, srcRank, tag)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Any:
        input = _read([input])[0]
        comm = self._communicator()
        if opts is None:
            opts = dist.AllToAllOptions()
        if comm is None or not (_bytes_of(output) and _bytes_of(input)):
            source = _all_to_all.apart(output, input)  # in place: neither gloo nor NCCL can
            fallback = self._fallback("all_to_all_single", [source, output], sizes=False)
            return fallback.alltoall_base(output, source, output_split_sizes,
                                          input_split_sizes, opts)
        sizes = (list(output_split_sizes), list(input_split_sizes))
        if comm.backend == "mpi":
            def run() -> torch.Tensor:
                _all_to_all.all_to_all_single(comm, output, input, *sizes)
                return output
            return self._submit(run, here=_here(opts))
        # Over gloo, gloo's own all-to-all moves the bytes (faster than gloo's point-to-point
        # pairs underneath the communicator), once the counts are agreed in call order.
        self._submit(lambda: _all_to_all.agree_counts(comm, output, input, *sizes),
                     here=True).wait()
        source = _all_to_all.apart(output, input)
        hold(output, source)
        return self._gloo.alltoall_base(output, source, *sizes, opts)

    all_to_all_single = alltoall_base

    def _worker_name(self) -> str:
        """The name of the thread that runs this group's collectives: the same on every
        member (torch names a group alike on all), another for each group of the process."""
        return f"{_WORKER_NAME} {self.group_name}"

    def _submit(self, run: Callable[[], Any], *, here: bool = False) -> Any:
        """Hand ``run`` to the group's worker, which runs the collectives one after another
        in the order they were called (the same on every rank), and return the work object
        whose future ``run``'s result (or error) completes; ``here``: a call the worker may
        run on this thread where nothing is pending (see _here)."""
        future: Future[Any] = Future()
        if self._worker is None:
            # Named alike on every rank: the caller's name is part of each call's agreement.
            self._worker = _Worker(self._worker_name())
        self._worker.submit(run, future, here)
        return _Work(future)

    def shutdown(self) -> None:
        """Finish the queued collectives, close the communicator and ask the gloo group to
        shut down, which torch 2.13's gloo does nothing for: its threads end with the group
        (torch.distributed.destroy_process_group calls this; groups never destroyed are shut
        down at exit). The tensors of this group's gloo collectives are held until gloo
        lets go of them (ringcomm.backends.gloo_held), except those of reduce, gather and
        scatter, which torch hands to the gloo group without passing through Python."""
        if self._shut:
            return
        self._shut = True
        _LIVE.discard(self)
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
        if self._mpi_comm is not None:
            self._mpi_comm.Free()
            self._mpi_comm = None
        if self._nccl is not None:
            self._nccl.shutdown()
        self._gloo.shutdown()


# Groups not shut down yet: shut down at exit, while the interpreter is whole (see shutdown),
# where the program never called torch.distributed.destroy_process_group.
_LIVE: weakref.WeakSet[RingcommProcessGroup] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    for group in list(_LIVE):
        try:
            group.shutdown()
        except Exception as err:  # a peer already gone: nothing is left to finish
            _LOG.debug("process group not shut down at exit: %s", err)


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    return RingcommProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the "ringcomm" backend with torch.distributed (done by ``import
    ringcomm.torch``; calling it again does nothing)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
    _LOG.debug("registered the torch.distributed backend %r", BACKEND_NAME)
