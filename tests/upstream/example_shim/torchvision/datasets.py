"""``MNIST`` built from data that ships with scikit-learn, so an MNIST example needs no download.

scikit-learn's digits (1797 images, 8x8, values 0..16) are upscaled to MNIST's 28x28 and scaled
to 0..255; every fifth image forms the test split (1437 train, 360 test).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["MNIST"]

_SIDE = 28
_TEST_EVERY = 5


def _digits(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The images (N x 28 x 28, uint8) and labels (N, int64) of one split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.from_numpy(digits.images).float().unsqueeze(1)
    big = F.interpolate(small, size=(_SIDE, _SIDE), mode="bilinear", align_corners=False)
    pixels = (big.squeeze(1) * (255 / 16)).round().clamp(0, 255).to(torch.uint8)
    in_test = torch.arange(len(pixels)) % _TEST_EVERY == 0
    keep = ~in_test if train else in_test
    return pixels[keep], torch.from_numpy(digits.target).long()[keep]


class MNIST(torch.utils.data.Dataset):
    """torchvision's ``MNIST`` signature over scikit-learn's digits.

    Args:
        root: accepted for compatibility; nothing is read from or written to it.
        train: the training split if true, else the test split.
        transform: applied to each image, a 28 x 28 uint8 ``numpy.ndarray`` (what torchvision's
            ``ToTensor`` also accepts).
        target_transform: applied to each label, an ``int``.
        download: accepted for compatibility; the data ships with scikit-learn.

    Example::

        >>> ds = MNIST("./data", train=False, transform=transforms.ToTensor())
        >>> image, label = ds[0]  # a 1 x 28 x 28 float tensor in [0, 1], and 0
    """

    classes: ClassVar[list[str]] = [
        "0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six",
        "7 - seven", "8 - eight", "9 - nine"]

    def __init__(self, root: str | os.PathLike[str], train: bool = True,
                 transform: Callable[[np.ndarray], Any] | None = None,
                 target_transform: Callable[[int], Any] | None = None,
                 download: bool = False) -> None:
        self.root = root
        self.train = train
        self.transform = transform
        self.target_transform = target_transform
        self.data, self.targets = _digits(train)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = self.data[index].numpy()
        target: Any = int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
