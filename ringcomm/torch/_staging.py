"""CUDA gradient buckets through pinned host memory, for backends that move host arrays only.

Over gloo, or an MPI that is not CUDA-aware, a device bucket reaches the wire through host
memory anyway. Staged message by message, each piece is a synchronous copy on the background
thread's stream (the device's default stream, which runs in lockstep with the training's
kernels), so communication and backward take turns instead of overlapping. Staged whole, the
bucket is one asynchronous download on a side stream of its own (after the point backward had
reached when the hook was called), the ring runs on the host copy, and one upload brings the
result back: the GPU goes on with backward meanwhile, as DDP's own gloo allreduce does.

Compressed buckets keep their codecs on the GPU; their work runs on the same side stream
(:meth:`HostStaging.side`, for torch and CuPy alike), ordered after backward's by an event
instead of in lockstep with it on the default stream.

The host copies are page-locked and kept per bucket, so steady-state steps allocate nothing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

__all__ = ["STAGED_DTYPES", "HostStaging"]

#: Dtypes staged whole (NumPy holds them as they are; others take the widening path).
STAGED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16})


class HostStaging:
    """Pinned host copies of CUDA buckets and the side streams that move them.

    Used from the one thread that runs a communicator's collectives (the engine's worker, or
    the hook's caller when it runs inline).
    """

    def __init__(self) -> None:
        self._host: dict[Any, torch.Tensor] = {}
        self._streams: dict[int, Any] = {}
        self._cupy_streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def host(self, key: Any, buffer: torch.Tensor) -> torch.Tensor:
        """The pinned host tensor of ``buffer``'s size and dtype kept under ``key``."""
        held = self._host.get(key)
        if held is None or held.numel() != buffer.numel() or held.dtype != buffer.dtype:
            held = self._host[key] = torch.empty(buffer.numel(), dtype=buffer.dtype,
                                                 pin_memory=True)
        return held

    def stream(self, device: torch.device) -> Any:
        """The side stream of ``device`` on which buckets move between device and host."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    @contextlib.contextmanager
    def side(self, device: torch.device, ready: Any) -> Any:
        """Run the block's GPU work (torch's and CuPy's) on ``device``'s side stream, after the
        event ``ready``."""
        stream = self.stream(device)
        index = stream.device.index
        with torch.cuda.stream(stream), self._cupy_stream(index, stream):
            stream.wait_event(ready)
            yield stream

    def _cupy_stream(self, index: int, stream: Any) -> Any:
        """CuPy's view of the side stream (CuPy is imported by then: the bucket is a CuPy
        array on this path)."""
        import cupy

        with self._lock:
            ext = self._cupy_streams.get(index)
            if ext is None:
                ext = self._cupy_streams[index] = cupy.cuda.ExternalStream(
                    stream.cuda_stream, index)
        return ext

    def download(self, key: Any, buffer: torch.Tensor, ready: Any) -> torch.Tensor:
        """Copy ``buffer`` into its pinned host tensor once the event ``ready`` (recorded where
        the bucket was handed over) has passed; return the host tensor, filled."""
        host = self.host(key, buffer)
        stream = self.stream(buffer.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            host.copy_(buffer.reshape(-1), non_blocking=True)
        stream.synchronize()
        return host

    def upload(self, host: torch.Tensor, buffer: torch.Tensor) -> None:
        """Copy the host result back into ``buffer``; complete when this returns."""
        stream = self.stream(buffer.device)
        with torch.cuda.stream(stream):
            buffer.reshape(-1).copy_(host, non_blocking=True)
        stream.synchronize()
