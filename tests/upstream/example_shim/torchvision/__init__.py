"""A stand-in for the part of torchvision that Horovod's PyTorch examples use.

torchvision's wheels on PyPI are built against the CUDA build of torch and cannot be imported
with the CPU build; this package is put first on ``PYTHONPATH`` for the examples' processes
only (tests/upstream/run_horovod_examples.py). It provides ``datasets.MNIST`` (scikit-learn's
8x8 digits upscaled to 28x28: nothing to download), ``transforms.Compose``, ``ToTensor`` and
``Normalize``, and ``models.resnet18``.
"""

from __future__ import annotations

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
__version__ = "0.0+ringcomm.stand.in"
