"""The Communicator interface and its backends (MPI, NCCL)."""

from ringcomm.comm.base import CommStats, Communicator, ReduceOp

__all__ = ["CommStats", "Communicator", "ReduceOp"]
