"""The baselines timed beside ringcomm on the same data: MPI's own Allreduce, torch.distributed's
gloo allreduce and NCCL's own allreduce (on GPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.perf.checks import mpi_op

__all__ = ["KNOWN", "baseline_fns"]

#: The baselines a run can name.
KNOWN = ("mpi", "gloo", "nccl")


def _gloo(world: Any) -> Any:
    try:
        import torch.distributed as dist
    except ModuleNotFoundError as err:
        raise SystemExit(f"ringcomm-perf: the gloo baseline needs PyTorch: pip install "
                         f"'ringcomm[torch]' ({err})") from err

    from ringcomm.torch.process_group import init_process_group_from_mpi

    if not dist.is_initialized():
        init_process_group_from_mpi(backend="gloo", mpi_comm=world)
    return dist


def baseline_fns(names: list[str], world: Any, x: Any, op: str) -> dict[str, Callable[[], Any]]:
    """The baselines' allreduce calls on the same data, each writing its own output (a
    baseline that cannot take ``x``'s kind or dtype is left out)."""
    fns: dict[str, Callable[[], Any]] = {}
    host = isinstance(x, np.ndarray)
    # MPI has no half-precision or bfloat16 sum: no MPI column for them.
    if "mpi" in names and host and x.dtype.kind != "V" and x.dtype != np.float16:
        reduction = mpi_op(op)
        y = np.empty_like(x)
        fns["mpi"] = lambda: world.Allreduce(x, y, op=reduction)
    if "gloo" in names and host:
        import torch

        dist = _gloo(world)
        t = torch.from_numpy(x.copy())
        red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}[op]
        fns["gloo"] = lambda: dist.all_reduce(t, op=red)
    if "nccl" in names and not host:
        from ringcomm.perf.nccl_baseline import allreduce_fn

        fns["nccl"] = allreduce_fn(world, x, op)
    return fns
