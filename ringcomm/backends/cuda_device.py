"""Which CUDA device and stream a transport's device work runs on: the device chosen per
process (:class:`DeviceChoice`), streams told apart (:func:`stream_identity`), and scratch
ordered after the stream of its last use (:class:`ScratchOrder`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from ringcomm.core.log import get_logger
from ringcomm.core.types import Array

__all__ = ["DeviceChoice", "ScratchOrder", "stream_identity"]

_NO_DEVICE = contextlib.nullcontext()
_LOG = get_logger("mpi")


class DeviceChoice:
    """The CUDA device of one process's device arrays on the MPI backend.

    Selected once, when the first device array comes: ``device`` when given, else
    ``local_rank % device_count`` (as the NCCL backend picks its GPU); logged at DEBUG level.

    Args:
        local_rank: this rank's position among the job's ranks on its host.
        device: the device to use instead, or None.

    Raises:
        ValueError: ``device`` is negative.
    """

    __slots__ = ("_asked", "_count", "_local_rank", "id")

    def __init__(self, local_rank: int, device: int | None = None) -> None:
        if device is not None and int(device) < 0:
            raise ValueError(f"device must be a CUDA device number >= 0, got {device}")
        self._local_rank = int(local_rank)
        self._asked = None if device is None else int(device)
        self._count: int | None = None
        #: The selected device (None until the first device array).
        self.id: int | None = None

    def select(self, rank: int) -> int:
        """Select the device (once) and return it.

        Raises:
            ValueError: CuPy sees no usable GPU, or the device asked for does not exist.
        """
        if self.id is not None:
            return self.id
        from ringcomm.ops import _cuda_runtime

        try:
            count = int(_cuda_runtime.cp().cuda.runtime.getDeviceCount())
        except RuntimeError as err:
            raise ValueError(f"device arrays need a usable CUDA GPU: {err}") from err
        device = self._local_rank % count if self._asked is None else self._asked
        if device >= count:
            raise ValueError(f"CUDA device {device} does not exist; this process sees {count}")
        self._count, self.id = count, device
        _LOG.debug("rank %d: device arrays run on CUDA device %d (%s)", rank, device,
                   self.why())
        return device

    def check(self, a: Array, rank: int) -> None:
        """Raise unless device array ``a`` is on the selected device (selecting it first).

        Raises:
            ValueError: ``a`` is on another device, or no device can be selected.
        """
        device = self.select(rank)
        on = getattr(getattr(a, "device", None), "id", device)
        if on != device:
            raise ValueError(
                f"a CuPy array on CUDA device {on}, but rank {rank} runs its device work on "
                f"device {device} ({self.why()}); create the arrays on device {device} "
                f"(cupy.cuda.Device({device}).use() or torch.cuda.set_device({device}) "
                f"first), or pass device={on} to MPICommunicator")

    def scope(self) -> Any:
        """A context making the device current (a fresh one per use: CuPy's Device context
        is not safe across threads); a no-op before one is selected."""
        if self.id is None:
            return _NO_DEVICE
        from ringcomm.ops import _cuda_runtime

        return _cuda_runtime.cp().cuda.Device(self.id)

    def why(self) -> str:
        """How the device was chosen, in words."""
        if self._asked is not None:
            return "asked for with device="
        return f"local rank {self._local_rank} on this host modulo {self._count} visible devices"


_PER_THREAD_STREAM = 2  # cudaStreamPerThread: one handle, a different stream on every thread


def stream_identity(stream: Any) -> tuple[int, int]:
    """What tells CUDA streams apart: the handle, and for the per-thread default stream the
    thread as well."""
    ptr = int(stream.ptr)
    return ptr, threading.get_ident() if ptr == _PER_THREAD_STREAM else 0


class ScratchOrder:
    """Orders a transport's device scratch after the stream of its last use.

    A scratch buffer outlives the call that used it, and that call's kernels may still be
    queued on another stream than this call's (CuPy's pool keeps fresh allocations apart per
    stream; scratch has no such guard): when the current stream is not the last call's, it
    first waits (on the device, the host does not) for the work enqueued on that one.
    """

    __slots__ = ("_event", "_last")

    def __init__(self) -> None:
        self._event: Any = None
        # Held, so that its handle is not reused by a new stream meanwhile.
        self._last: tuple[Any, tuple[int, int]] | None = None

    def follow(self, cuda: Any) -> None:
        """Order the current stream of ``cuda`` (``cupy.cuda``) after the last one."""
        current = cuda.get_current_stream()
        mine = stream_identity(current)
        last = self._last
        if last is not None and last[1] != mine:
            if self._event is None:
                self._event = cuda.Event(disable_timing=True)
            self._event.record(last[0])
            current.wait_event(self._event)  # takes the recording current at this call
        self._last = (current, mine)
