"""Which CUDA major version this machine runs, and the ringcomm extra that installs its stack.

ringcomm's GPU half needs one CUDA stack per environment: CuPy, NCCL, NVRTC and the CUDA runtime
headers that CuPy 14 compiles against (found through ``cuda.pathfinder``). The extras ``cuda12``
and ``cuda13`` of pyproject.toml install each; :func:`install_hint` names the one that fits
here, for the messages of a missing CuPy or NCCL. Nothing here imports CuPy or needs a GPU, and
no function raises: a hint must still come when the stack is broken.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import re
import sys
from typing import NamedTuple

__all__ = [
    "EXTRAS",
    "PACKAGES",
    "CudaStack",
    "detect",
    "driver_loads",
    "extra_for",
    "header_dir",
    "install_hint",
]

#: The extra of ringcomm that installs the stack of each CUDA major version.
EXTRAS: dict[int, str] = {12: "cuda12", 13: "cuda13"}

#: What each extra installs (the distributions, as pyproject.toml lists them): CuPy, NCCL, NVRTC,
#: and the CUDA runtime, whose wheel carries the headers.
PACKAGES: dict[int, tuple[str, ...]] = {
    12: ("cupy-cuda12x", "nvidia-nccl-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"),
    13: ("cupy-cuda13x", "nvidia-nccl-cu13", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime"),
}

# Distributions whose name alone says which CUDA major they were built for, in the order they
# are trusted: the CuPy a process would import decides, then NCCL.
_NAMED = (("cupy-cuda13x", 13), ("cupy-cuda12x", 12), ("nvidia-nccl-cu13", 13),
          ("nvidia-nccl-cu12", 12))
_TORCH_LOCAL = re.compile(r"\+cu(\d+)$")  # torch's local version: 2.11.0+cu130


class CudaStack(NamedTuple):
    """The CUDA major version found here and where it was read (None, "" when none was)."""

    major: int | None
    source: str


def detect() -> CudaStack:
    """Find the CUDA major version of this environment, reading what is cheapest first.

    In order: an installed CuPy or NCCL wheel of one major version (the stack a process would
    load), PyTorch's CUDA build (``torch==2.11.0+cu130``), then the newest CUDA the driver
    supports (``cuDriverGetVersion``). Imports nothing heavy and never raises.
    """
    for dist, major in _NAMED:
        if _installed(dist):
            return CudaStack(major, dist)
    torch_major = _torch_major()
    if torch_major is not None:
        return CudaStack(torch_major, "torch")
    driver_major = _driver_major()
    if driver_major is not None:
        return CudaStack(driver_major, "driver")
    return CudaStack(None, "")


def extra_for(major: int | None) -> str | None:
    """The extra for CUDA ``major``: the newest one the driver of that version runs.

    A driver of a newer CUDA than ringcomm knows runs the newest stack; one older than CUDA 12
    runs none (None).
    """
    if major is None:
        return None
    fits = [m for m in EXTRAS if m <= major]
    return EXTRAS[max(fits)] if fits else None


def install_hint(major: int | None = None) -> str:
    """The pip command that installs ringcomm's GPU stack here, for an error message.

    Args:
        major: the CUDA major version; detected (:func:`detect`) when None.

    Returns:
        e.g. ``pip install 'ringcomm[cuda13]'``; both extras, each with its CUDA version, when
        the version is unknown, and with what was found when it is older than CUDA 12.

    Example::

        raise RuntimeError(f"CuPy arrays need CuPy and a CUDA GPU: {install_hint()} ({err})")
    """
    if major is None:
        major = detect().major
    extra = extra_for(major)
    if extra is not None:
        return f"pip install 'ringcomm[{extra}]'"
    choices = " or ".join(f"pip install 'ringcomm[{e}]' (CUDA {m})" for m, e in EXTRAS.items())
    if major is None:
        return choices
    return f"{choices}; found CUDA {major} here, and ringcomm needs CUDA 12 or newer"


def header_dir() -> str | None:
    """The directory of the CUDA runtime headers CuPy 14 compiles against, or None.

    Asks ``cuda.pathfinder`` as CuPy does (``find_nvidia_header_directory("cudart")``): the
    ``nvidia-cuda-runtime`` wheel's include directory, a conda environment, or CUDA_HOME /
    CUDA_PATH. None when it finds none or is not installed (CuPy 13 does without it).
    """
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        found = find_nvidia_header_directory("cudart")
    except Exception:  # a broken installation answers "not found", not an error
        return None
    return str(found) if found else None


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _torch_major() -> int | None:
    """CUDA major of PyTorch's build: torch.version.cuda if imported, else the wheel's version."""
    torch = sys.modules.get("torch")
    text = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    if text:
        return int(str(text).split(".")[0])
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    m = _TORCH_LOCAL.search(version)
    return int(m.group(1)) // 10 if m else None  # cu130 -> 13, cu128 -> 12


@functools.cache
def driver_loads() -> bool:
    """Whether the CUDA driver's library (libcuda.so.1) loads in this process; cached.

    Where it does not, this process sees no CUDA device: CUDA's runtime (CuPy's too) reaches
    every GPU through it. A rank without a GPU learns that here in a few microseconds, instead of
    importing CuPy to ask (0.2-1.5 s a process, most of it ml_dtypes, which CuPy imports).
    True where this cannot tell (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _driver_major() -> int | None:
    """The newest CUDA major the installed driver supports (libcuda's cuDriverGetVersion)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000 if version.value > 0 else None  # 13000 -> 13
