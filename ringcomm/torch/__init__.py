"""PyTorch adapters: a DDP communication hook, and a horovod.torch-compatible surface.

Two ways into a training job, both on ringcomm's communicator and compressors:

- DDP: ``model.register_comm_hook(RingcommState(...), ringcomm_hook)`` averages DDP's gradient
  buckets with ringcomm's ring (zero-copy, in place), optionally compressed with error feedback.
- Horovod: ``import ringcomm.torch as hvd`` gives the core horovod.torch calls with their names,
  arguments and semantics (init, rank, size, allreduce, allgather, broadcast, Compression,
  DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state, join, process sets,
  ...). Operations are matched across ranks by name, as in Horovod. Adasum and elastic
  training raise NotImplementedError.

Example (``mpiexec -n 4 python train.py``)::

    import torch
    import ringcomm.torch as hvd

    hvd.init()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.int8)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the adapters' one hard requirement, checked first)
except ModuleNotFoundError as _err:
    if _err.name != "torch":
        raise
    raise ModuleNotFoundError(
        "ringcomm.torch needs PyTorch, which is not installed here: pip install "
        "'ringcomm[torch]' (torch 2.4 or newer; install the torch build for your CUDA or CPU "
        "first, as pytorch.org says, then ringcomm)", name="torch") from _err

from ringcomm.torch import _mpi_rendezvous, dist_backend, elastic
from ringcomm.torch._errors import (
    HorovodArgumentError,
    HorovodInternalError,
    StalledOperationError,
)
from ringcomm.torch.accelerate import register_ddp_hook
from ringcomm.torch.compression import Compression, Compressor
from ringcomm.torch.hooks import RingcommState, ringcomm_hook
from ringcomm.torch.horovod._basics import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    ccl_built,
    communicator,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from ringcomm.torch.horovod._lifecycle import init, shutdown
from ringcomm.torch.horovod.alltoall import alltoall, alltoall_async
from ringcomm.torch.horovod.broadcast import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ringcomm.torch.horovod.functions import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    sparse_allreduce_async,
    synchronize,
)
from ringcomm.torch.horovod.grouped_allgather import grouped_allgather, grouped_allgather_async
from ringcomm.torch.horovod.optimizer import DistributedOptimizer
from ringcomm.torch.horovod.process_sets import add_process_set, remove_process_set
from ringcomm.torch.horovod.reducescatter import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from ringcomm.torch.horovod.sync_batch_norm import SyncBatchNorm
from ringcomm.torch.horovod.timeline import start_timeline, stop_timeline

dist_backend.register()  # torch.distributed.init_process_group("ringcomm")
_mpi_rendezvous.install()  # ... under mpiexec too (its env:// rendezvous from MPI)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "HorovodArgumentError",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RingcommState",
    "StalledOperationError",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "communicator",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "register_ddp_hook",
    "remove_process_set",
    "ringcomm_hook",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
