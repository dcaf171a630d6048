"""ringcomm: gradient communication for data-parallel training.

A chunked, pipelined ring allreduce that can compress what it sends (int8 block quantization,
top-k sparsification, fp16/bf16 casts) with error feedback, behind one ``Communicator`` interface
with MPI, NCCL and (under torchrun) torch.distributed gloo backends.

Example::

    import numpy as np
    import ringcomm

    comm = ringcomm.init()                       # under mpiexec -n 4
    g = np.random.rand(1 << 20).astype(np.float32)
    avg = comm.allreduce(g, op="avg")            # identical on every rank
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any

from ringcomm import registry as _backends
from ringcomm.algorithms.powersgd import PowerSGD
from ringcomm.comm import settings as _settings
from ringcomm.comm.base import Communicator
from ringcomm.compress import BF16, FP16, Auto, Compressor, ErrorFeedback, Int8, TopK
from ringcomm.core import log as _log
from ringcomm.core.joined import mark_joined, refuse_inherited
from ringcomm.core.launch import LaunchInfo
from ringcomm.core.launch import detect as launch_info
from ringcomm.core.types import (
    ArgumentMismatchError,
    CollectiveError,
    CollectiveTimeoutError,
    CommStats,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
    ReduceOp,
    Transport,
)
from ringcomm.core.version import __version__

__all__ = [
    "BF16",
    "FP16",
    "ArgumentMismatchError",
    "Auto",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommStats",
    "Communicator",
    "Compressor",
    "DtypeMismatchError",
    "ErrorFeedback",
    "Int8",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LaunchInfo",
    "PowerSGD",
    "ReduceOp",
    "TopK",
    "Transport",
    "__version__",
    "init",
    "launch_info",
    "nccl_available",
]


_LOG = _log.get_logger("init")


def nccl_available() -> bool:
    """Whether this process sees a CUDA GPU and can load NCCL (what ``backend="auto"`` asks)."""
    from ringcomm.backends import nccl

    return nccl.usable()


def _check_torch_group(info: LaunchInfo) -> None:
    """Raise when torch.distributed's initialized group and the launcher's variables give the
    job different sizes (a group of one in a launch of several, say): which processes the
    communicator should span is then unknown, and either guess could train apart."""
    if info.launcher != "torch.distributed":
        return
    launched = launch_info(os.environ)
    if launched.launcher not in ("none", "lightning") and launched.size != info.size:
        raise RuntimeError(
            f"{info.describe()} but {launched.describe()}: initialize torch.distributed over "
            "the processes the launcher started (init_process_group() without rank or "
            "world_size under torchrun; ringcomm.torch.process_group.init_process_group_from_mpi"
            "() under mpiexec)")


def _lightning_hint(info: LaunchInfo) -> str:
    """Why a process of Lightning's launcher cannot start a communicator before
    torch.distributed is up, and where to start it instead."""
    return (f"{info.describe()}: this process's global rank is known only once Lightning "
            "has initialized torch.distributed (in trainer.fit), and its main process has no "
            "such variables before then. Create the communicator there: "
            "ringcomm.torch.lightning.RingcommDDPStrategy registers ringcomm's DDP hook and "
            "creates it, or call ringcomm.init() in a LightningModule hook such as setup(); "
            "then it spans torch.distributed's group")


def _size_hint(info: LaunchInfo, backend: str) -> str:
    """How to make the communicator span what the launcher started."""
    if info.launcher == "torch.distributed":
        return ("use backend='auto' or 'gloo', which run over torch.distributed's default "
                "group, or launch with mpiexec so that MPI's world is that group's")
    if info.launcher == "torchrun":
        if backend == "gloo":
            return ("initialize torch.distributed from torchrun's environment "
                    "(init_process_group() without rank or world_size), or let ringcomm.init do it")
        return (f"launch with mpiexec -n {info.size}, or use backend='auto' or 'gloo' under "
                "torchrun")
    if info.launcher == "horovodrun":
        return ("horovodrun's variables are set but not the address of its rendezvous server "
                "(HOROVOD_GLOO_RENDEZVOUS_ADDR and _PORT), over which its processes form one "
                f"job: launch with horovodrun itself, or with mpiexec -n {info.size}")
    return info.mpi_hint()


def _check_spans_job(comm: Communicator, info: LaunchInfo, mpi_comm: Any) -> None:
    """Raise (the same on every rank) when ``comm`` does not span what the launcher says.

    A communicator on a given ``mpi_comm`` other than MPI.COMM_WORLD may span part of the job;
    it is not checked.
    """
    if info.launcher == "none" or comm.size == info.size:
        return
    if mpi_comm is not None:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is None or mpi_comm != mpi.COMM_WORLD:
            return
    size, backend = comm.size, comm.backend
    comm.close()
    group = _backends.REGISTRY[backend].spans
    raise RuntimeError(f"{info.describe()} but {group} has {size} "
                       f"process{'es' if size != 1 else ''}: {_size_hint(info, backend)}")


def _log_init(comm: Communicator, why: str, info: LaunchInfo,
              options: _settings.Settings) -> None:
    _log.set_rank(comm.rank, comm.size)
    if not _LOG.isEnabledFor(logging.INFO):
        return
    launcher = info.launcher
    if info.size_variable:
        launcher += f" ({info.size_variable}={info.size})"
    _LOG.info("backend %s (%s); launcher %s; rank %d of %d, %d rank%s on this node; "
              "segment_bytes %d, inline_bytes %d, consistency check %s, timeout %g s; "
              "allreduce algorithm %s, topology %s",
              comm.backend, why, launcher, comm.rank, comm.size, comm.local_size,
              "s" if comm.local_size != 1 else "", comm.segment_bytes, comm.inline_bytes,
              "on" if comm.consistency_check else "off", options.timeout, comm.algorithm,
              comm.topology)


def init(backend: str = "auto", *, mpi_comm: Any = None, consistency_check: bool | None = None,
         segment_bytes: int | None = None, inline_bytes: int | None = None,
         timeout: datetime.timedelta | float | None = None,
         abort_on_exception: bool = True, algorithm: str | None = None,
         topology: str | int | None = None) -> Communicator:
    """Create a communicator over the processes of this job.

    Launched by mpiexec/mpirun, srun or torchrun (``python -m torch.distributed.run``), the
    communicator spans every process the launcher started, or init raises saying which
    launcher variables give what size and how to fix the launch: a communicator of one process
    in a job of several is never returned. Where torch.distributed's default group is already
    initialized (PyTorch Lightning, Accelerate, or the script itself did it), that group is
    the job. Under Lightning's own launcher (``WORLD_SIZE`` without ``RANK``) init raises
    until Lightning has initialized torch.distributed: call it from inside the training
    (``ringcomm.torch.lightning``).

    Starting is collective: every rank's settings (the options below and their environment
    variables) are agreed in one exchange once the backend is up. A bad value on any rank, or
    a setting that differs between ranks, raises the same error on every rank, naming the
    setting and its value on each, before any data moves.

    Args:
        backend: "mpi", "nccl", "gloo" (torch.distributed; initialized from torchrun's
            environment if need be), or "auto": NCCL where every rank has a GPU of its own
            and NCCL loads, otherwise MPI, or gloo under torchrun (whose processes are not an
            MPI job); the same choice on every rank. ``comm.backend`` tells which was chosen.
            Every backend takes NumPy and CuPy arrays: the NCCL communicator moves CuPy
            arrays over NCCL and NumPy arrays over its host transport (MPI, or NCCL through
            device buffers where MPI did not launch the job), so host code runs unchanged
            on a machine where "auto" picks NCCL. Device work runs on the rank's GPU,
            ``local_rank % device_count`` (``comm.cuda_device``).
        mpi_comm: the mpi4py communicator to run on (or, for NCCL, to exchange its unique id
            over); ``MPI.COMM_WORLD`` by default. A communicator on part of the job is taken
            as it is (its size is not checked against the launcher's).
        consistency_check: check before each collective that every rank passed matching
            arguments, raising the same error on every rank instead of hanging. On by default;
            the environment variable ``RINGCOMM_CONSISTENCY_CHECK=0`` turns it off.
        segment_bytes: ring segment size in bytes, 64 B to 1 GiB (default: the measured
            ``ringcomm.algorithms.ring.DEFAULT_SEGMENT_BYTES``); env ``RINGCOMM_SEGMENT_BYTES``,
            which takes K, M and G suffixes (KiB, MiB, GiB: "512K", "2M").
        inline_bytes: dense allreduces of up to this many bytes ride inside the per-call
            agreement message (one exchange instead of a ring: each rank sends its array to
            each other rank). A multiple of 8, at most 1 MiB; default 4096, and over MPI where
            every rank shares one node (and the topology setting says so) 192 KiB shared
            among the other ranks, from 4 KiB to 64 KiB (64 KiB up to 4 ranks); env
            ``RINGCOMM_INLINE_BYTES`` (suffixes as above). Over MPI each call sends only its
            own message; over gloo and NCCL the whole slot travels with every collective, so
            0 suits jobs of many small compressed calls there.
        timeout: how long a collective waits for its peers before it fails, as a
            ``datetime.timedelta`` or seconds; env ``RINGCOMM_TIMEOUT`` (seconds); 30 minutes
            by default. On the NCCL backend it also bounds every host wait for the GPU: at
            the timeout, or on an asynchronous NCCL error, the NCCL communicator is aborted
            (``ncclCommAbort``) and the job ends with an error naming the collective.
        abort_on_exception: make an uncaught exception on any rank abort the whole job
            (``MPI_Abort``) instead of leaving the other ranks waiting forever.
        algorithm: the allreduce algorithm of calls that name none (``comm.algorithm``):
            "flat" (one ring over every rank), "hierarchical" (within each node, across
            nodes, within each node; every node must hold the same number of ranks) or
            "auto" (hierarchical where the job has several nodes of several ranks each, for
            calls of at least 1 MiB dense or through a cast or Int8, and top-k ones on 64
            nodes or more; flat otherwise). Env
            ``RINGCOMM_ALGORITHM``; "auto" by default.
        topology: which ranks share a node (``comm.topology``): "auto" (the same host name,
            as launchers place ranks) or ``k``, consecutive blocks of ``k`` ranks, for
            clusters where host names say otherwise. Env ``RINGCOMM_RANKS_PER_NODE`` (an int)
            overrides "auto".

    Returns:
        A Communicator. With ``RINGCOMM_LOG_LEVEL=INFO``, init logs the backend chosen (and
        why), the launcher, rank and size, and the options to stderr (logger ``ringcomm.init``).

    Raises:
        ValueError: unknown backend (on every rank: under an MPI launch once MPI started),
            or ``mpi_comm`` with backend "gloo" (before anything starts).
        InvalidArgumentError, InvalidTypeError: a bad value or type for an option or its
            environment variable on some rank (the message names the ranks, the option or
            variable, its value and what is expected), raised on every rank.
        ArgumentMismatchError: a setting, or the backend asked for (under an MPI launch,
            where every backend but gloo starts MPI), differs between ranks (raised on every
            rank).
        RuntimeError: the chosen backend cannot start here (missing package, no GPU; the
            message says what to install), or the communicator would not span the job that
            the launcher started (the message names the launcher's variables).
    """
    if backend == "gloo" and mpi_comm is not None:
        raise ValueError("mpi_comm is for the mpi and nccl backends; backend 'gloo' runs over "
                         f"torch.distributed's default group, got mpi_comm={mpi_comm!r}")
    # A bad value is raised by the communicator's first exchange, on every rank: raised here,
    # before the backend starts, it would leave the other ranks waiting in its start-up.
    options, startup_error = _settings.read(consistency_check, segment_bytes, inline_bytes,
                                            timeout, algorithm, topology)
    info = launch_info()
    refuse_inherited(info)  # a process that one of the job's started (core/joined.py)
    if not info.rank_known:
        raise RuntimeError(_lightning_hint(info))
    _check_torch_group(info)
    _log.set_rank(info.rank, info.size)
    # horovodrun's processes (without MPI) become an MPI job first, over its rendezvous server.
    if mpi_comm is None:
        _backends.join_mpi_over_horovodrun(info, options.timeout)
    # Under an MPI launch, the backend asked for is agreed first (over MPI), an unknown one
    # included: raised alone, before MPI starts, it left the others in MPI's start-up.
    _backends.agree_backend(backend, mpi_comm, info, options.timeout)
    if backend != "auto" and backend not in _backends.REGISTRY:
        raise ValueError(f"unknown backend {backend!r}; expected one of "
                         f"{', '.join(('auto', *_backends.REGISTRY))}")
    if backend == "auto":
        backend, why = _backends.choose_auto(mpi_comm, info, options.timeout)
        why = f"auto: {why}"
    else:
        why = "asked for"
    _LOG.debug("starting backend %s (%s); launcher %s", backend, why, info.describe())
    comm = _backends.REGISTRY[backend].build(mpi_comm, options, info, startup_error)
    _check_spans_job(comm, info, mpi_comm)
    _log_init(comm, why, info, options)
    mark_joined(info)
    if abort_on_exception and comm.size > 1:
        from ringcomm.backends.mpi_process import install_abort_hook

        install_abort_hook()
    return comm
