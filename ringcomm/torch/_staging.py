"""CUDA gradient buckets through pinned host memory, for backends that move host arrays only.

Over gloo, or an MPI that is not CUDA-aware, a device bucket reaches the wire through host
memory anyway. Staged message by message, each piece is a synchronous copy on the background
thread's stream (the device's default stream, which runs in lockstep with the training's
kernels), so communication and backward take turns instead of overlapping. Staged whole, the
bucket is one asynchronous download on a side stream of its own (after the point backward had
reached when the hook was called), the ring runs on the host copy, and one upload brings the
result back: the GPU goes on with backward meanwhile, as DDP's own gloo allreduce does.

The download is queued where the hook is called (on the thread running backward), so that it
runs as soon as the bucket is written, while the background thread is still busy with the
bucket before; an uncompressed bucket is divided by the number of ranks there too, on the GPU
before the copy (as DDP's own allreduce divides), and the host copies are summed: dividing 25
MB on one core of the host took milliseconds of each step's critical path.

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

__all__ = ["STAGED_DTYPES", "Download", "HostStaging"]

#: Dtypes staged whole (NumPy holds them as they are; others take the widening path).
STAGED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16})


class Download:
    """A bucket's copy to its pinned host tensor, queued on the side stream."""

    __slots__ = ("_copied", "host")

    def __init__(self, host: torch.Tensor, copied: Any) -> None:
        self.host, self._copied = host, copied

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (the GIL released meanwhile)."""
        self._copied.synchronize()
        return self.host


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

    def download(self, key: Any, buffer: torch.Tensor, ready: Any,
                 divide_by: int = 1) -> Download:
        """Queue the copy of ``buffer`` into its pinned host tensor on the side stream, once
        the event ``ready`` (recorded where the bucket was handed over) has passed, after
        dividing ``buffer`` by ``divide_by`` there when it is not 1; returns at once, with
        what waits for the copy (:meth:`Download.wait`) on the thread that reduces it."""
        host = self.host(key, buffer)
        stream = self.stream(buffer.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if divide_by != 1:
                buffer.div_(divide_by)
            host.copy_(buffer.reshape(-1), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        return Download(host, copied)

    def upload(self, host: torch.Tensor, buffer: torch.Tensor) -> None:
        """Copy the host result back into ``buffer``; complete when this returns."""
        stream = self.stream(buffer.device)
        with torch.cuda.stream(stream):
            buffer.reshape(-1).copy_(host, non_blocking=True)
        stream.synchronize()
