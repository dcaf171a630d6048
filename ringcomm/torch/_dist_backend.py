"""A Communicator over a torch.distributed gloo group, for jobs started by torchrun.

torchrun starts plain processes, each its own one-process MPI world (and MPICH's singletons
cannot connect to each other), so under torchrun the ring's point-to-point messages, the
agreement allgather and the broadcasts travel over a gloo group of torch.distributed instead.
The ring, compression and error feedback are ringcomm's own, as on every backend. Host arrays
only: device arrays are staged through host memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ringcomm import ops as _ops
from ringcomm.comm.base import Communicator

__all__ = ["TorchDistCommunicator"]

_RING_TAG = 7
_P2P_TAG = 11
# torch renamed all_gather_into_tensor (deprecated in newer releases) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Pair:
    """A send and a receive posted together; ``wait()`` completes both."""

    __slots__ = ("_after", "_works")

    def __init__(self, works: list[Any], after: Any = None) -> None:
        self._works, self._after = works, after

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        if self._after is not None:
            self._after()


def _host(x: Any) -> np.ndarray:
    return x if type(x) is np.ndarray else _ops.get(x).to_host(x)


class TorchDistCommunicator(Communicator):
    """Collectives over a gloo group of torch.distributed (torchrun jobs).

    Args:
        group: the gloo process group to run on; a new one over the default group's ranks
            when None (so that ringcomm's messages never match the application's).
        consistency_check: as for :func:`ringcomm.init`.
        segment_bytes: ring segment size; the measured default when None.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    backend = "gloo"

    def __init__(self, group: Any = None, *, consistency_check: bool = True,
                 segment_bytes: int | None = None, inline_bytes: int | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group() (torchrun sets its environment)")
        self._group = dist.new_group(backend="gloo") if group is None else group
        self._owns_group = group is None
        from ringcomm import launch_info

        info = launch_info()
        self.local_rank, self.local_size = info.local_rank, info.local_size
        super().__init__(dist.get_rank(self._group), dist.get_world_size(self._group),
                         consistency_check=consistency_check, segment_bytes=segment_bytes,
                         inline_bytes=inline_bytes)

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self._group, r)

    def _post(self, tag: int, send: Any, dest: int, recv: Any, source: int) -> _Pair:
        works, after = [], None
        if recv is not None:
            host_recv = recv if type(recv) is np.ndarray else np.empty(recv.shape, recv.dtype)
            if host_recv is not recv:
                device_recv = recv

                def after() -> None:
                    _ops.get(device_recv).copy_from_host(device_recv, host_recv)
            works.append(dist.irecv(torch.from_numpy(host_recv), self._global(source),
                                    group=self._group, tag=tag))
        if send is not None:
            works.append(dist.isend(torch.from_numpy(_host(send)), self._global(dest),
                                    group=self._group, tag=tag))
        return _Pair(works, after)

    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int) -> _Pair:
        return self._post(_RING_TAG, send, dest, recv, source)

    def _user_isendrecv(self, send: Any, dest: int, recv: Any, source: int) -> _Pair:
        return self._post(_P2P_TAG, send, dest, recv, source)

    def _allgather_fixed(self, send: np.ndarray, recv: np.ndarray) -> None:
        _all_gather(torch.from_numpy(recv).view(-1), torch.from_numpy(send), group=self._group)

    def _allgatherv(self, x: Any, counts: list[int], out: Any) -> None:
        # gloo has no allgatherv: gather rows padded to the longest, then drop the padding.
        width = max(counts)
        rows = np.zeros((self._size, width), dtype=x.dtype)
        rows[self._rank, : counts[self._rank]] = _host(x)
        _all_gather(torch.from_numpy(rows).view(-1), torch.from_numpy(rows[self._rank].copy()),
                    group=self._group)
        flat = np.concatenate([rows[r, : counts[r]] for r in range(self._size)])
        _ops.get(out).copy_from_host(out, flat)

    def _broadcast(self, x: Any, root: int) -> None:
        host = _host(x)
        dist.broadcast(torch.from_numpy(host), self._global(root), group=self._group)
        if host is not x:
            _ops.get(x).copy_from_host(x, host)

    def _allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _barrier(self) -> None:
        dist.barrier(group=self._group)

    def _close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self._group)
