"""Torch tensors as the arrays ringcomm's collectives take: zero-copy views, written in place.

A CPU tensor reaches the communicator as a NumPy array through DLPack (same memory; see
``host_view``), a CUDA tensor as a CuPy array through DLPack (same memory, stream-ordered by
the DLPack exchange). Results are written into those views, so nothing is copied on the way
in or out.

Dtypes the communicator cannot carry (bool, uint8, int8, int16, and bfloat16, which neither
NumPy nor CuPy has) travel as a widened copy (int32, float32) that is written back afterwards.
The widened array carries its source dtype as trailing unit dimensions, so the communicator's
cross-rank shape check also tells an int8 tensor from an int32 one.

Devices and streams: a CUDA tensor is handed over with its own device current (the DLPack
exchange orders CuPy's stream after torch's current stream *of the current device*), and the
wait for a result is on the result's device. Work handed from one thread to another (the
collectives' background threads) is ordered after the submitting thread's stream by a
:class:`StreamFence`: the background threads run on the device's default stream, which the
fence makes wait for the point the submitter's stream had reached.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np
import torch

__all__ = ["Operand", "StreamFence", "as_array", "device_scope", "flat_bytes", "from_array",
           "host_view", "resolved", "sync_device", "travels_widened"]

# dtype -> (dtype it travels as, number of trailing unit dimensions that tag it)
_WIDENED: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bool: (torch.int32, 1),
    torch.uint8: (torch.int32, 2),
    torch.int8: (torch.int32, 3),
    torch.int16: (torch.int32, 4),
    torch.bfloat16: (torch.float32, 5),
}


def travels_widened(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` travel as a widened, tagged copy (see ``Operand``)."""
    return dtype in _WIDENED


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            "CUDA tensors need CuPy: pip install 'ringcomm[cuda12]'") from err
    return cupy


def host_view(t: torch.Tensor) -> np.ndarray:
    """A writable NumPy array over a (detached) CPU tensor's memory, which leaves the tensor
    as it was: ``Tensor.numpy()`` marks the tensor's storage not resizable for good, so that a
    later ``resize_`` of a tensor that went through a collective failed ("Trying to resize
    storage that is not resizable"; PyTorch's batched PowerSGD hook resizes its bucket), where
    gloo's leave it resizable. Through DLPack (about 2 us more than ``numpy()``), except where
    NumPy's DLPack arrays are read-only (before NumPy 2.1)."""
    view = np.from_dlpack(t)
    return view if view.flags.writeable else t.numpy()


def as_array(t: torch.Tensor) -> Any:
    """Return a NumPy (CPU) or CuPy (CUDA) array sharing ``t``'s memory.

    A CUDA tensor is exchanged with its device current, so that the DLPack exchange orders
    CuPy's current stream after torch's current stream of that device (not of device 0).

    Args:
        t: a tensor of a dtype NumPy/CuPy know (not bfloat16); any strides.

    Returns:
        An array of ``t``'s shape, strides and dtype; writing it writes ``t``.

    Raises:
        TypeError: the tensor lives on a device other than CPU or CUDA.
    """
    t = t.detach()
    if t.device.type == "cpu":
        return host_view(t)
    if t.device.type == "cuda":
        cupy = _cupy()
        with device_scope(t.device.index):
            return cupy.from_dlpack(t)
    raise TypeError(f"tensors on {t.device.type} are not supported; expected cpu or cuda")


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor over it (writing one writes the
    other).

    PyTorch calls a tensor of one element contiguous whatever its stride (``x[::2]`` of two
    elements has stride 2), and ``reshape(-1)`` keeps that stride, which a dtype view refuses
    ("self.stride(-1) must be 1"): such a tensor is taken at its one element with stride 1.
    An empty tensor gives an empty array of bytes (of any strides).
    """
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = t.detach().reshape(-1)
    if flat.stride(0) != 1 and flat.numel() == 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def from_array(a: Any) -> torch.Tensor:
    """Return a tensor sharing the memory of a NumPy or CuPy array."""
    if type(a).__module__.split(".", 1)[0] == "cupy":
        return torch.from_dlpack(a)
    return torch.from_numpy(a)


def sync_device(a: Any) -> None:
    """Wait for the work queued on the current CuPy stream of a CuPy array's device (nothing
    to wait for on the host).

    Torch reads the result on its own stream; CuPy wrote it on the current CuPy stream. Where
    NCCL communicators are open on the device, the wait is theirs: polled and bounded by
    their timeout, so that a dead peer raises instead of hanging (see
    ``ringcomm.backends.nccl.wait_for_stream``).

    Why the host waits, once per result, instead of ordering streams on the device: the
    collectives run on a background thread (the engine's worker, ringcomm.torch's
    coordinator), and the result reaches the caller through a handle or a DDP future that
    carries no CUDA event. The caller then reads it on whatever stream it has current, which
    nothing on the device orders after CuPy's; only a result that is complete when handed over
    is safe to read there. (A DLPack exchange orders one consumer stream, on the thread that
    makes it; it does not reach the caller's.)
    """
    if type(a).__module__.split(".", 1)[0] != "cupy":
        return
    cupy = _cupy()
    device = a.device.id
    with cupy.cuda.Device(device):
        stream = cupy.cuda.get_current_stream()
        nccl = sys.modules.get("ringcomm.backends.nccl")  # no NCCL communicator without it
        if nccl is None:
            stream.synchronize()
        else:
            nccl.wait_for_stream(stream, device, "a wait for a result on the GPU")


def device_scope(index: int | None) -> Any:
    """A context making CUDA device ``index`` current for torch and CuPy (fresh contexts: a
    shared one is not safe across threads); a no-op context for None."""
    if index is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(index))
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        stack.enter_context(cupy.cuda.Device(index))
    return stack


class StreamFence:
    """Where a thread's current CUDA stream was when it handed work to another thread.

    Made on the submitting thread (see :meth:`capture`), it orders the background threads'
    work after the submitter's: backward may run on a side stream, and a collective that read
    a gradient bucket on another stream without waiting could read it before it is written.

    Attributes:
        device: the CUDA device.
        event: recorded on the submitter's stream.
    """

    __slots__ = ("device", "event")

    def __init__(self, device: torch.device, event: Any) -> None:
        self.device, self.event = device, event

    @staticmethod
    def capture(device: Any = None) -> StreamFence | None:
        """Record the current stream of ``device`` (the current device when None) on this
        thread, and make the device's default stream, on which background threads run, wait
        for it; None where nothing needs ordering (CUDA unused, a CPU ``device``, or the
        current stream is the default stream).
        """
        if not torch.cuda.is_initialized():
            return None
        if device is not None and torch.device(device).type != "cuda":
            return None  # host tensors: no stream to order after
        stream = torch.cuda.current_stream(device)
        default = torch.cuda.default_stream(stream.device)
        if stream == default:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        # Enqueued now, so that every thread whose current stream is the default one is
        # ordered after the submitter (the coordinator's thread as well as the engine's).
        default.wait_event(event)
        return StreamFence(stream.device, event)

    def wait(self) -> None:
        """Make this thread's current stream of the device wait for the fence (the host does
        not wait)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)


def _lazy_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view whose values are its memory's, conjugated or negated when read
    (``x.conj()`` of a complex tensor, and its ``.imag``): NumPy would see the memory."""
    return t.is_conj() or t.is_neg()


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values: a conjugate or negative view resolved into a copy (its memory holds the
    values before the lazy negation, which NumPy and gloo would send); any other tensor as it
    is."""
    return t.detach().resolve_conj().resolve_neg() if _lazy_view(t) else t


class Operand:
    """One tensor as a collective's operand: a view of its memory, or a widened copy.

    Args:
        tensor: the tensor to read and/or write.
        copy_in: whether the collective reads the tensor (False for a pure output).

    Attributes:
        array: what to pass to the communicator.
        tensor: the tensor given.
        widened: whether ``array`` is a widened copy (of another dtype); a conjugate or
            negative view travels as a copy of its dtype (``write_back()`` moves the results
            of either into tensor).
    """

    __slots__ = ("_staged", "array", "tensor", "widened")

    def __init__(self, tensor: torch.Tensor, *, copy_in: bool = True) -> None:
        self.tensor = tensor
        self._staged: torch.Tensor | None = None
        spec = _WIDENED.get(tensor.dtype)
        if spec is not None:
            wide, tag = spec
            staged = (tensor.detach().to(wide, memory_format=torch.contiguous_format) if copy_in
                      else torch.empty(tensor.shape, dtype=wide, device=tensor.device))
            self._staged = staged
            self.array = as_array(staged).reshape(*tensor.shape, *(1,) * tag)
        elif _lazy_view(tensor):
            # A conjugate or negative view (x.conj(), its .imag): its memory holds the values
            # before the lazy negation, so it travels as a resolved copy, written back through
            # the view.
            staged = (resolved(tensor) if copy_in
                      else torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device))
            self._staged = staged
            self.array = as_array(staged)
        else:
            self.array = as_array(tensor)
        self.widened = spec is not None

    def result(self, array: Any) -> torch.Tensor:
        """Turn an array the communicator returned for this operand into a tensor of its dtype.

        The leading dimension may differ from the operand's (allgather).
        """
        sync_device(array)
        t = from_array(array)
        if self.widened:  # the leading dimension from the array: -1 is ambiguous at 0 elements
            shape = (t.shape[0], *self.tensor.shape[1:]) if self.tensor.dim() else ()
            t = t.reshape(shape).to(self.tensor.dtype)
        return t

    def write_back(self) -> None:
        """Make the tensor hold what the collective wrote into ``array``."""
        sync_device(self.array)
        if self._staged is not None:
            with torch.no_grad():
                self.tensor.copy_(self._staged)
