"""Array operations the ring and the compressors call, one module per array kind.

``get(x)`` returns the CPU operations for NumPy arrays and :mod:`ringcomm.ops.cuda` for CuPy
arrays; both expose the same functions. On the CPU that is :mod:`ringcomm.ops.cpu` (the codecs
compiled with Numba, everything else NumPy), or :mod:`ringcomm.ops.numpy` itself when
``RINGCOMM_CPU_KERNELS=numpy``. :mod:`ringcomm.ops.numpy` is the reference that both the
compiled CPU codecs and the GPU kernels are tested against. Callers never branch on the array
kind themselves.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

from ringcomm.core.types import Array

__all__ = ["CPU_KERNELS_VARIABLE", "cpu_kernels", "get", "host_ops", "is_device_array",
           "numpy_ops"]

#: The environment variable that chooses the CPU operations: "numba" (the default: compiled
#: codecs, the reference where Numba is unavailable) or "numpy" (the reference only).
CPU_KERNELS_VARIABLE = "RINGCOMM_CPU_KERNELS"
_CPU_CHOICES = ("numba", "numpy")


def is_device_array(x: Array) -> bool:
    """Whether ``x`` is a CuPy array (judged by its type's module, without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


_loaded: dict[str, ModuleType] = {}


def numpy_ops() -> ModuleType:
    """The NumPy operations module: the reference implementation."""
    module = _loaded.get("numpy")
    if module is None:
        from ringcomm.ops import numpy as reference

        module = _loaded["numpy"] = reference
    return module


def cpu_kernels() -> str:
    """What ``RINGCOMM_CPU_KERNELS`` chooses: "numba" (also where it is unset) or "numpy".
    Ranks may choose differently (both give the same bits); a communicator checks it as it
    starts, so that a bad value fails every rank there, not one rank at its first call.

    Raises:
        ValueError: the variable names neither.
    """
    raw = os.environ.get(CPU_KERNELS_VARIABLE, "").strip().lower() or "numba"
    if raw not in _CPU_CHOICES:
        raise ValueError(f"{CPU_KERNELS_VARIABLE} must be one of {', '.join(_CPU_CHOICES)}, "
                         f"got {os.environ[CPU_KERNELS_VARIABLE]!r}")
    return raw


def host_ops() -> ModuleType:
    """The operations module for NumPy arrays, as ``RINGCOMM_CPU_KERNELS`` chooses (read once).

    Raises:
        ValueError: the variable names neither "numba" nor "numpy".
    """
    module = _loaded.get("host")
    if module is None:
        if cpu_kernels() == "numpy":
            module = numpy_ops()
        else:
            from ringcomm.ops import cpu

            module = cpu
        _loaded["host"] = module
    return module


def get(x: Array) -> ModuleType:
    """The operations module for arrays like ``x``."""
    if type(x) is np.ndarray or not is_device_array(x):
        return _loaded.get("host") or host_ops()
    module = _loaded.get("cuda")
    if module is None:
        from ringcomm.ops import cuda

        module = _loaded["cuda"] = cuda
    return module
