"""Array operations the ring and the compressors call, one module per array kind.

``get(x)`` returns :mod:`ringcomm.ops.numpy` for NumPy arrays and :mod:`ringcomm.ops.cuda` for
CuPy arrays; both expose the same functions, and the NumPy module is the reference the GPU tests
compare against. Callers never branch on the array kind themselves.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["get", "is_device_array", "numpy_ops"]


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (judged by its type's module, without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


_loaded: dict[str, ModuleType] = {}


def numpy_ops() -> ModuleType:
    """The NumPy operations module."""
    module = _loaded.get("numpy")
    if module is None:
        from ringcomm.ops import numpy as module

        _loaded["numpy"] = module
    return module


def get(x: Any) -> ModuleType:
    """The operations module for arrays like ``x``."""
    if type(x) is np.ndarray or not is_device_array(x):
        return numpy_ops()
    module = _loaded.get("cuda")
    if module is None:
        from ringcomm.ops import cuda as module

        _loaded["cuda"] = module
    return module
