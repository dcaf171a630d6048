"""ringcomm: gradient communication for data-parallel training.

A chunked, pipelined ring allreduce that can compress what it sends (int8 block quantization,
top-k sparsification, fp16/bf16 casts) with error feedback, behind one ``Communicator`` interface
with an MPI and an NCCL backend.

Example::

    import numpy as np
    import ringcomm

    comm = ringcomm.init()                       # under mpiexec -n 4
    g = np.random.rand(1 << 20).astype(np.float32)
    avg = comm.allreduce(g, op="avg")            # identical on every rank
"""

from __future__ import annotations

import os
from typing import Any

from ringcomm.comm.base import Communicator
from ringcomm.comm.launch import LaunchInfo
from ringcomm.comm.launch import detect as launch_info
from ringcomm.comm.types import (
    ArgumentMismatchError,
    CollectiveError,
    CommStats,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
    ReduceOp,
    Transport,
)
from ringcomm.compress import BF16, FP16, Auto, Compressor, ErrorFeedback, Int8, TopK

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "FP16",
    "ArgumentMismatchError",
    "Auto",
    "CollectiveError",
    "CommStats",
    "Communicator",
    "Compressor",
    "DtypeMismatchError",
    "ErrorFeedback",
    "Int8",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LaunchInfo",
    "ReduceOp",
    "TopK",
    "Transport",
    "__version__",
    "init",
    "launch_info",
    "nccl_available",
]

_BACKENDS = ("auto", "mpi", "nccl")


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")


def nccl_available() -> bool:
    """Whether this process sees a CUDA GPU and can load NCCL (what ``backend="auto"`` asks)."""
    from ringcomm.comm import nccl

    return nccl.usable()


def _auto_backend(mpi_comm: Any) -> str:
    """NCCL where every rank can run it (a GPU of its own and NCCL), else MPI; the same
    answer on every rank (a collective when the job has several processes)."""
    from ringcomm.comm import nccl

    if mpi_comm is not None or launch_info().size > 1:
        return "nccl" if nccl.usable_everywhere(mpi_comm) else "mpi"
    return "nccl" if nccl.usable() else "mpi"


def init(backend: str = "auto", *, mpi_comm: Any = None, consistency_check: bool | None = None,
         segment_bytes: int | None = None, inline_bytes: int | None = None,
         abort_on_exception: bool = True) -> Communicator:
    """Create a communicator over the processes of this job.

    Args:
        backend: "mpi", "nccl", or "auto" (NCCL where every rank has a GPU of its own and NCCL
            loads, MPI otherwise; the same choice on every rank); ``comm.backend`` tells which
            was chosen.
        mpi_comm: the mpi4py communicator to run on (or, for NCCL, to exchange its unique id
            over); ``MPI.COMM_WORLD`` by default.
        consistency_check: check before each collective that every rank passed matching
            arguments, raising the same error on every rank instead of hanging. On by default;
            the environment variable ``RINGCOMM_CONSISTENCY_CHECK=0`` turns it off.
        segment_bytes: ring segment size in bytes (default: the measured
            ``ringcomm.ring.DEFAULT_SEGMENT_BYTES``); env ``RINGCOMM_SEGMENT_BYTES``.
        inline_bytes: dense allreduces of up to this many bytes ride inside the per-call
            agreement message (one exchange instead of a ring); that slot is sent with every
            collective, so 0 suits jobs of many small compressed calls. Default 4096; env
            ``RINGCOMM_INLINE_BYTES``.
        abort_on_exception: make an uncaught exception on any rank abort the whole job
            (``MPI_Abort``) instead of leaving the other ranks waiting forever.

    Returns:
        A Communicator.

    Raises:
        ValueError: unknown backend, or a bad value for an option.
        RuntimeError: the chosen backend cannot start here (missing package, no GPU); the
            message says what to install.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(_BACKENDS)}")
    if consistency_check is None:
        consistency_check = _env_flag("RINGCOMM_CONSISTENCY_CHECK", True)
    if segment_bytes is None and os.environ.get("RINGCOMM_SEGMENT_BYTES"):
        segment_bytes = int(os.environ["RINGCOMM_SEGMENT_BYTES"])
    if inline_bytes is None and os.environ.get("RINGCOMM_INLINE_BYTES"):
        inline_bytes = int(os.environ["RINGCOMM_INLINE_BYTES"])
    if backend == "auto":
        backend = _auto_backend(mpi_comm)
    options = {"consistency_check": consistency_check, "segment_bytes": segment_bytes,
               "inline_bytes": inline_bytes}
    if backend == "nccl":
        from ringcomm.comm.nccl import NCCLCommunicator

        comm: Communicator = NCCLCommunicator(mpi_comm=mpi_comm, **options)
    else:
        from ringcomm.comm.mpi import MPICommunicator

        comm = MPICommunicator(mpi_comm, **options)
    if abort_on_exception and comm.size > 1:
        from ringcomm.comm.mpi import install_abort_hook

        install_abort_hook()
    return comm
