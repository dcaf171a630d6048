"""Torch tensors as the arrays ringcomm's collectives take: zero-copy views, written in place.

A CPU tensor reaches the communicator as ``tensor.numpy()`` (same memory), a CUDA tensor as a
CuPy array through DLPack (same memory, stream-ordered by the DLPack exchange). Results are
written into those views, so nothing is copied on the way in or out.

Dtypes the communicator cannot carry (bool, uint8, int8, int16, and bfloat16, which neither
NumPy nor CuPy has) travel as a widened copy (int32, float32) that is written back afterwards.
The widened array carries its source dtype as trailing unit dimensions, so the communicator's
cross-rank shape check also tells an int8 tensor from an int32 one.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Operand", "as_array", "from_array", "sync_device"]

# dtype -> (dtype it travels as, number of trailing unit dimensions that tag it)
_WIDENED: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bool: (torch.int32, 1),
    torch.uint8: (torch.int32, 2),
    torch.int8: (torch.int32, 3),
    torch.int16: (torch.int32, 4),
    torch.bfloat16: (torch.float32, 5),
}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            "CUDA tensors need CuPy: pip install 'ringcomm[cuda12]'") from err
    return cupy


def as_array(t: torch.Tensor) -> Any:
    """Return a NumPy (CPU) or CuPy (CUDA) array sharing ``t``'s memory.

    Args:
        t: a tensor of a dtype NumPy/CuPy know (not bfloat16); any strides.

    Returns:
        An array of ``t``'s shape, strides and dtype; writing it writes ``t``.

    Raises:
        TypeError: the tensor lives on a device other than CPU or CUDA.
    """
    t = t.detach()
    if t.device.type == "cpu":
        return t.numpy()
    if t.device.type == "cuda":
        return _cupy().from_dlpack(t)
    raise TypeError(f"tensors on {t.device.type} are not supported; expected cpu or cuda")


def from_array(a: Any) -> torch.Tensor:
    """Return a tensor sharing the memory of a NumPy or CuPy array."""
    if type(a).__module__.split(".", 1)[0] == "cupy":
        return torch.from_dlpack(a)
    return torch.from_numpy(a)


def sync_device(a: Any) -> None:
    """Wait for the work queued on a CuPy array's stream (nothing to wait for on the host).

    Torch reads the result on its own stream; CuPy wrote it on the current CuPy stream.
    """
    if type(a).__module__.split(".", 1)[0] == "cupy":
        _cupy().cuda.get_current_stream().synchronize()


class Operand:
    """One tensor as a collective's operand: a view of its memory, or a widened copy.

    Args:
        tensor: the tensor to read and/or write.
        copy_in: whether the collective reads the tensor (False for a pure output).

    Attributes:
        array: what to pass to the communicator.
        tensor: the tensor given.
        widened: whether ``array`` is a copy (then ``write_back()`` moves results into tensor).
    """

    __slots__ = ("_staged", "array", "tensor", "widened")

    def __init__(self, tensor: torch.Tensor, *, copy_in: bool = True) -> None:
        self.tensor = tensor
        spec = _WIDENED.get(tensor.dtype)
        if spec is None:
            self._staged = None
            self.array = as_array(tensor)
        else:
            wide, tag = spec
            staged = (tensor.detach().to(wide, memory_format=torch.contiguous_format) if copy_in
                      else torch.empty(tensor.shape, dtype=wide, device=tensor.device))
            self._staged = staged
            self.array = as_array(staged).reshape(*tensor.shape, *(1,) * tag)
        self.widened = spec is not None

    def result(self, array: Any) -> torch.Tensor:
        """Turn an array the communicator returned for this operand into a tensor of its dtype.

        The leading dimension may differ from the operand's (allgather).
        """
        sync_device(array)
        t = from_array(array)
        if self.widened:
            t = t.reshape(-1, *self.tensor.shape[1:]).to(self.tensor.dtype)
        return t

    def write_back(self) -> None:
        """Make the tensor hold what the collective wrote into ``array``."""
        sync_device(self.array)
        if self._staged is not None:
            with torch.no_grad():
                self.tensor.copy_(self._staged)
