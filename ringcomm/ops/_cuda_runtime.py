"""CuPy machinery behind :mod:`ringcomm.ops.cuda`: the lazy import, the compiled kernel modules
(compiled once per machine by ops/_kernel_cache.py, loaded once per device and source), grid
sizes, alignment checks and launches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ringcomm.core.types import Array
from ringcomm.ops import _cuda_source as _src
from ringcomm.ops import _cuda_stack
from ringcomm.ops import _kernel_cache as _cache

__all__ = ["BLOCK", "NULL", "aligned", "cp", "function", "grid", "launch", "overlap", "u32"]

#: Threads per block of the grid-stride kernels.
BLOCK = 256
#: A null pointer argument (an optional output not asked for).
NULL = np.uint64(0)
# Blocks per SM of a grid-stride launch: one full wave of 256-thread blocks.
_BLOCKS_PER_SM = 8

_cupy: Any = None
# (device, source) -> the loaded module and the lowered symbol of each name expression
_modules: dict[tuple[int, str], tuple[Any, Mapping[str, str]]] = {}
_functions: dict[tuple[int, str], Any] = {}
_sm_counts: dict[int, int] = {}
_targets: dict[int, _cache.Target] = {}
_SOURCE_OF = {name: source for source in _src.SOURCES for name in _src.name_expressions(source)}


def cp() -> Any:
    """The ``cupy`` module, imported on first use.

    Raises:
        RuntimeError: CuPy is not installed, or it sees no usable CUDA GPU.
    """
    global _cupy
    if _cupy is not None:
        return _cupy
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            f"CuPy arrays need CuPy and a CUDA GPU: {_cuda_stack.install_hint()} ({err})"
        ) from err
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError: no driver, or no device
        raise RuntimeError(f"CuPy sees no usable CUDA GPU ({err}); check the driver") from err
    if count < 1:
        raise RuntimeError("CuPy sees no CUDA GPU (CUDA_VISIBLE_DEVICES may hide them)")
    _cupy = cupy
    return cupy


def function(name: str) -> Any:
    """The kernel named by name expression ``name``, loaded on the current device.

    The first kernel of a source loads the whole source (all its instantiations): from
    ringcomm's kernel cache when this machine compiled it before, else compiled with NVRTC for
    the device's architecture and stored there (ops/_kernel_cache.py). CuPy's RawModule is not
    used: it would compile with -ftz=true.
    """
    cupy = _cupy or cp()
    device = cupy.cuda.runtime.getDevice()
    fn = _functions.get((device, name))
    if fn is None:
        source = _SOURCE_OF[name]
        loaded = _modules.get((device, source))
        if loaded is None:
            loaded = _modules[(device, source)] = _load(cupy, device, source)
        module, lowered = loaded
        fn = _functions[(device, name)] = module.get_function(lowered[name])
    return fn


def _target(cupy: Any, device: int) -> _cache.Target:
    """What to compile for ``device``: its own architecture, as NVRTC can."""
    target = _targets.get(device)
    if target is None:
        capability = int(cupy.cuda.Device(device).compute_capability)
        target = _targets[device] = _cache.target_for(capability,
                                                      _cache.nvrtc().supported_archs())
    return target


def _load(cupy: Any, device: int, source: str) -> tuple[Any, Mapping[str, str]]:
    """Kernel source ``source`` loaded into the current context of ``device``."""
    compiled = _cache.load_source(source, _target(cupy, device))
    module = cupy.cuda.function.Module()
    module.load(compiled.image)
    return module, compiled.lowered


def grid(items: int, per_block: int = BLOCK) -> int:
    """Blocks for a grid-stride kernel over ``items`` work items: enough for one full wave."""
    cupy = _cupy or cp()
    device = cupy.cuda.runtime.getDevice()
    sms = _sm_counts.get(device)
    if sms is None:
        sms = _sm_counts[device] = int(
            cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
    return max(1, min(-(-items // per_block), sms * _BLOCKS_PER_SM))


def launch(name: str, blocks: int, args: tuple[Any, ...], threads: int = BLOCK) -> None:
    """Launch kernel ``name`` on the current stream."""
    function(name)((blocks,), (threads,), args)


def elementwise(name: str, n: int, args: tuple[Any, ...], *arrays: Array) -> None:
    """Launch a grid-stride elementwise kernel: args, then n and the vector flag of arrays."""
    vec = aligned(*arrays)
    launch(name, grid(-(-n // 4) if vec else n), (*args, np.int64(n), np.int32(vec)))


_CONVERSIONS = frozenset(_src.COPY_PAIRS)


def converted(x: Array, dtype: Any) -> Any:
    """``x`` as a contiguous array of ``dtype`` (``x`` itself when it already is one).

    The elements are moved by CuPy (a copy, no arithmetic) and converted by ringcomm's copy
    kernel: CuPy compiles its own kernels with -ftz=true, so its casts and ufuncs flush float32
    subnormals to zero where NumPy, and so the CPU ranks of a job, keep them. Only a dtype
    pair without a ringcomm kernel (none of the dtypes the collectives take) is cast by CuPy.
    """
    cupy = _cupy or cp()
    dtype = np.dtype(dtype)
    if not x.flags.c_contiguous:
        x = cupy.ascontiguousarray(x)
    if x.dtype == dtype:
        return x
    out = cupy.empty(x.shape, dtype)
    if (dtype.name, x.dtype.name) not in _CONVERSIONS:
        out[...] = x
    elif x.size:
        elementwise(_src.copy_name(dtype.name, x.dtype.name), x.size, (out, x), out, x)
    return out


def aligned(*arrays: Array) -> int:
    """1 if every array (None skipped) starts where a group of 4 of its elements may move as
    one load (16 bytes, or 4 * itemsize when smaller), else 0."""
    for a in arrays:
        if a is not None and a.data.ptr % min(16, 4 * a.itemsize):
            return 0
    return 1


def overlap(a: Array, b: Array) -> bool:
    """Whether the memory of arrays ``a`` and ``b`` overlaps."""
    pa, pb = a.data.ptr, b.data.ptr
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def u32(value: int) -> np.uint32:
    """``value`` modulo 2**32, as the kernels' 32-bit seeds and counters take it."""
    return np.uint32(value & 0xFFFFFFFF)
