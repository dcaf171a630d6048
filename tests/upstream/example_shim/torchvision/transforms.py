"""``Compose``, ``ToTensor`` and ``Normalize``, as torchvision's behave on arrays and tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Compose", "Normalize", "ToTensor"]


class Compose:
    """Apply ``transforms`` in order."""

    __slots__ = ("transforms",)

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for transform in self.transforms:
            x = transform(x)
        return x


class ToTensor:
    """Turn an H x W (x C) array into a C x H x W tensor; uint8 is scaled to floats in [0, 1].

    Raises:
        TypeError: for anything but a ``numpy.ndarray`` (torchvision's also takes PIL images,
            which the stand-in datasets do not produce).
        ValueError: for an array that is not 2-D or 3-D.
    """

    __slots__ = ()

    def __call__(self, pic: np.ndarray) -> torch.Tensor:
        if not isinstance(pic, np.ndarray):
            raise TypeError(f"expected a numpy.ndarray, got {type(pic).__name__}")
        if pic.ndim not in (2, 3):
            raise ValueError(f"expected an H x W or H x W x C array, got shape {pic.shape}")
        if pic.ndim == 2:
            pic = pic[:, :, None]
        tensor = torch.from_numpy(np.ascontiguousarray(pic.transpose(2, 0, 1)))
        if tensor.dtype == torch.uint8:
            return tensor.to(torch.get_default_dtype()).div(255)
        return tensor


class Normalize:
    """Subtract ``mean`` and divide by ``std``, per channel of a C x H x W float tensor."""

    __slots__ = ("inplace", "mean", "std")

    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> None:
        if len(mean) != len(std):
            raise ValueError(f"expected as many std as mean values ({len(mean)}), "
                             f"got {len(std)}")
        self.mean, self.std, self.inplace = tuple(mean), tuple(std), inplace

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            raise TypeError(f"expected a floating-point tensor, got {tensor.dtype}")
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        out = tensor if self.inplace else tensor.clone()
        return out.sub_(mean).div_(std)
