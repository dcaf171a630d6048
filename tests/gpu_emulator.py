"""Run ringcomm's CUDA kernels and its CuPy code paths on the CPU, for tests without a GPU.

``build()`` compiles every kernel instantiation that ringcomm.ops.cuda launches (the sources in
kernels/, the name expressions of ringcomm.ops._cuda_source) as host C++ against
tests/cuda_emulation.h, behind a launcher that takes its arguments the way CUDA does (an array
of pointers to each argument's bytes) and checks their number, sizes and pointer-ness against
the kernel's parameters. ``installed()`` then points ringcomm.ops._cuda_runtime at a stand-in for
CuPy whose arrays are NumPy arrays (``DeviceArray``, reported as CuPy arrays so that
``ringcomm.ops.get`` picks the CUDA operations) and whose kernel launches run the emulated
kernels. What runs is ringcomm's own code, kernels and Python alike; only CuPy and the GPU are
replaced.

The emulated GPU computes as the real one does (tests/cuda_emulation.h): float32 NaN results are
the canonical NaN, subnormals are flushed exactly when the kernels are compiled with -ftz=true
(ringcomm compiles them with ``_cuda_source.OPTIONS``, which say -ftz=false), blocks run in a
shuffled order and threads leave each barrier in a shuffled order. Every launch is recorded with
its scalar arguments (``Emulator.launches``), so tests can count passes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ringcomm.ops import _cuda_runtime, _cuda_source

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["DeviceArray", "Emulator", "FakeCupy", "Launch", "build", "build_kernels",
           "cache_dir", "flushes_subnormals", "installed", "one_launch_at_a_time"]

_PREAMBLE = """\
#include "cuda_emulation.h"
#include <cstddef>
#include <type_traits>
#include <utility>
{includes}

namespace {{
template <class... P, std::size_t... I>
void call(void (*k)(P...), unsigned g, unsigned b, void** a, std::index_sequence<I...>) {{
  rc_emu::launch(k, g, b, *static_cast<std::remove_reference_t<P>*>(a[I])...);
}}
template <class... P> void run(void (*k)(P...), unsigned g, unsigned b, void** a) {{
  call(k, g, b, a, std::index_sequence_for<P...>{{}});
}}
// Bytes of each parameter, plus 1000 for pointers.
template <class... P> int signature(void (*)(P...), unsigned* out) {{
  const unsigned s[] = {{(unsigned)(sizeof(P) + (std::is_pointer_v<P> ? 1000 : 0))..., 0u}};
  for (unsigned i = 0; i < sizeof...(P); ++i) out[i] = s[i];
  return (int)sizeof...(P);
}}
struct Kernel {{
  const char* name;
  void (*run)(unsigned, unsigned, void**);
  int (*signature)(unsigned*);
}};
const Kernel KERNELS[] = {{
{entries}
}};
}}  // namespace

#pragma GCC visibility push(default)
extern "C" {{
int emu_count() {{ return (int)(sizeof(KERNELS) / sizeof(KERNELS[0])); }}
const char* emu_name(int i) {{ return KERNELS[i].name; }}
int emu_signature(int i, unsigned* out) {{ return KERNELS[i].signature(out); }}
void emu_run(int i, unsigned grid, unsigned block, void** args) {{
  KERNELS[i].run(grid, block, args);
}}
void emu_configure(int ftz, unsigned long long seed, int shuffle, unsigned workers) {{
  rc_emu::configure(ftz != 0, seed, shuffle != 0, workers);
}}
}}
#pragma GCC visibility pop
"""
_ENTRY = ('  {{"{name}", [](unsigned g, unsigned b, void** a) {{ run(&{name}, g, b, a); }},\n'
          '   [](unsigned* s) {{ return signature(&{name}, s); }}}},')


def _source(includes: Sequence[str], names: Sequence[str]) -> str:
    return _PREAMBLE.format(includes="\n".join(f'#include "{i}"' for i in includes),
                            entries="\n".join(_ENTRY.format(name=name) for name in names))


def flushes_subnormals(options: Sequence[str]) -> bool:
    """Whether NVRTC flushes float32 subnormals to zero in kernels compiled with ``options``
    (its default is not to; CuPy's RawModule adds -ftz=true to whatever it is given)."""
    flags = {o.lstrip("-") for o in options}
    return "ftz=true" in flags


class Launch(NamedTuple):
    """One emulated kernel launch: the kernel, its grid and block sizes, and its arguments
    (scalars as Python numbers, arrays as ("array", size))."""

    name: str
    grid: int
    block: int
    args: tuple[Any, ...]


def _mix(seed: int, index: int) -> int:
    """A 64-bit seed for launch ``index`` of an emulator seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Emulator:
    """The compiled kernels: ``launch(name, grid, block, args)`` runs one on the CPU.

    Args:
        path: the shared library ``build`` made.
        options: the NVRTC options the kernels are taken to be compiled with; their -ftz decides
            whether float32 subnormals are flushed (default: ringcomm's own options).
        seed: seeds the shuffled block and thread orders (launch i uses a seed mixed from it
            and i, so a run is replayed by the same seed).
        shuffle: False runs blocks and threads in index order.
        workers: blocks that run at once, each on an OS thread of its own (a library that
            ``build_kernels`` built with ``workers`` above 1 only); 1 runs them one after
            another.
    """

    def __init__(self, path: Path, *, options: Sequence[str] | None = None, seed: int = 0,
                 shuffle: bool = True, workers: int = 1) -> None:
        self._lib = ctypes.CDLL(str(path))
        self._lib.emu_name.restype = ctypes.c_char_p
        self._lib.emu_signature.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint)]
        self._lib.emu_run.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                      ctypes.POINTER(ctypes.c_void_p)]
        self._lib.emu_configure.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
                                            ctypes.c_uint]
        self.kernels: dict[str, tuple[int, list[int]]] = {}
        sizes = (ctypes.c_uint * 32)()
        for i in range(self._lib.emu_count()):
            nargs = self._lib.emu_signature(i, sizes)
            self.kernels[self._lib.emu_name(i).decode()] = (i, list(sizes[:nargs]))
        self.options = tuple(_cuda_source.OPTIONS if options is None else options)
        self.ftz = flushes_subnormals(self.options)
        self.seed = seed
        self.shuffle = shuffle
        self.workers = workers
        self.launches: list[Launch] = []

    def reseed(self, seed: int) -> None:
        """Seed the orders of the launches that follow (launch indices count from here)."""
        self.seed = seed
        self.launches.clear()

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Run kernel ``name`` over ``grid`` blocks of ``block`` threads.

        Raises:
            TypeError: the arguments do not match the kernel's parameters (count, size, or an
                array where a scalar belongs and vice versa), which CuPy would not notice.
        """
        index, params = self.kernels[name]
        if len(args) != len(params):
            raise TypeError(f"{name} takes {len(params)} arguments, got {len(args)}")
        keep = []
        for pos, (arg, param) in enumerate(zip(args, params, strict=True)):
            pointer, size = param >= 1000, param % 1000
            if isinstance(arg, np.ndarray):
                if not pointer:
                    raise TypeError(f"{name}: argument {pos} is an array, the kernel takes a "
                                    f"{size}-byte scalar")
                keep.append(np.array([arg.__array_interface__["data"][0]], np.uint64))
            elif isinstance(arg, np.generic):
                if arg.itemsize != size or (pointer and arg != 0):
                    raise TypeError(f"{name}: argument {pos} has {arg.itemsize} bytes "
                                    f"({arg.dtype}), the kernel takes {size}"
                                    f"{' (a pointer)' if pointer else ''}")
                keep.append(np.array([arg]))
            else:
                raise TypeError(f"{name}: argument {pos} is a {type(arg).__name__}; pass "
                                "NumPy scalars so that their width is explicit")
        pointers = (ctypes.c_void_p * max(1, len(keep)))(*[k.ctypes.data for k in keep])
        shown = tuple(("array", a.size) if isinstance(a, np.ndarray) else a.item() for a in args)
        self._lib.emu_configure(int(self.ftz), _mix(self.seed, len(self.launches)),
                                int(self.shuffle), self.workers)
        self.launches.append(Launch(name, grid, block, shown))
        self._lib.emu_run(index, grid, block, pointers)


def build(directory: Path, *, options: Sequence[str] | None = None, seed: int = 0,
          shuffle: bool = True) -> Emulator:
    """Compile ringcomm's kernels (every instantiation it launches) for the emulator into
    ``directory``, reused while the sources are unchanged.

    Args:
        directory: where the shared library is kept.
        options, seed, shuffle: as for ``Emulator``.

    Raises:
        FileNotFoundError: no C++ compiler.
    """
    names = [n for source in _cuda_source.SOURCES for n in _cuda_source.name_expressions(source)]
    return build_kernels(directory, _cuda_source.SOURCES, names, options=options, seed=seed,
                         shuffle=shuffle)


def build_kernels(directory: Path, sources: Sequence[str | Path], names: Sequence[str], *,
                  options: Sequence[str] | None = None, seed: int = 0,
                  shuffle: bool = True, workers: int = 0) -> Emulator:
    """Compile the kernels ``names`` of ``sources`` (files in kernels/, or paths) for the
    emulator into ``directory``, reused while the sources are unchanged. With ``workers``
    (more than 1), a library whose launches run that many blocks at once
    (cuda_emulation.h's RC_EMU_CONCURRENT).

    Raises:
        FileNotFoundError: no C++ compiler.
    """
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise FileNotFoundError("no C++ compiler")
    code = _source([str(s) for s in sources], names)
    # -O0: builds in half the time, and the emulated kernels spend theirs switching fibers.
    # Hidden symbols: two libraries loaded in one process (this one and a concurrent build,
    # say) would otherwise share the emulator's inline variables, which the dynamic linker
    # binds process-wide (STB_GNU_UNIQUE) even for RTLD_LOCAL libraries.
    flags = ["-std=c++20", "-O0", "-ffp-contract=off", "-fno-strict-aliasing",
             "-fvisibility=hidden", "-DRC_EMULATE", "-shared", "-fPIC",
             *(["-DRC_EMU_CONCURRENT", "-pthread"] if workers > 1 else [])]
    digest = hashlib.sha256(code.encode() + " ".join(flags).encode())
    extra = [Path(s) for s in sources if Path(s).is_absolute()]
    for header in [*sorted((ROOT / "kernels").glob("*.cu*")), ROOT / "tests/cuda_emulation.h",
                   *extra]:
        digest.update(header.read_bytes())
    lib = directory / f"emulated_kernels_{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        # Names of this process: concurrent builders (MPI ranks) never read or load each
        # other's partial files.
        src = directory / f"emulated_kernels.{os.getpid()}.cpp"
        src.write_text(code)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, *flags, f"-I{ROOT / 'kernels'}",
               f"-I{ROOT / 'tests'}", str(src), "-o", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        finally:
            src.unlink(missing_ok=True)
        if done.returncode:
            raise RuntimeError(f"building the emulated kernels failed:\n{done.stderr[-4000:]}")
        tmp.replace(lib)  # atomic: a loader sees no file or a whole one
    return Emulator(lib, options=options, seed=seed, shuffle=shuffle, workers=max(1, workers))


# --------------------------------------------------------------------- the CuPy stand-in
class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """A NumPy array standing for a CuPy array: ``.data.ptr``, ``.get()`` and ``.set()``."""

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        return _Pointer(self.__array_interface__["data"][0])

    def get(self) -> np.ndarray:
        return np.array(self, copy=True).view(np.ndarray)

    def set(self, arr: np.ndarray) -> None:
        np.copyto(self.view(np.ndarray), arr)


DeviceArray.__module__ = "cupy.emulated"  # what ringcomm.ops.is_device_array looks at


_F32 = np.dtype(np.float32)


def flush_subnormals(x: Any) -> Any:
    """``x`` with its float32 subnormals made signed zeros, as CuPy's own kernels do: CuPy
    compiles them with -ftz=true, which flushes float32 inputs and results. Other dtypes and
    non-arrays pass unchanged."""
    if not isinstance(x, np.ndarray) or x.dtype != _F32:
        return x
    tiny = x.view(np.ndarray)
    sub = (tiny != 0) & (np.abs(tiny) < np.finfo(np.float32).smallest_normal)
    if not sub.any():
        return x
    out = np.where(sub, np.copysign(np.float32(0), tiny), tiny).astype(np.float32)
    return out.view(type(x)) if isinstance(x, DeviceArray) else out


def _cupy_cast(x: Any, dtype: Any) -> Any:
    """A cast by one of CuPy's kernels: float32 flushed on the way in and out."""
    with np.errstate(all="ignore"):
        return flush_subnormals(np.asarray(flush_subnormals(np.asarray(x))).astype(dtype))


def _setitem(self: DeviceArray, key: Any, value: Any) -> None:
    # An assignment that converts runs a CuPy cast kernel; one of the same dtype moves bytes.
    if isinstance(value, np.ndarray) and value.dtype != self.dtype:
        value = _cupy_cast(value, self.dtype)
    np.ndarray.__setitem__(self, key, value)


DeviceArray.__setitem__ = _setitem  # type: ignore[method-assign]


def _dev(x: np.ndarray) -> DeviceArray:
    return x.view(DeviceArray)


class _Event:
    """An event of the emulated stream: every launch has finished when it returns, so an
    event's time is the host's clock when it is recorded."""

    done = True

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        pass

    def record(self) -> _Event:
        return _Event()


class _Runtime:
    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3

    @staticmethod
    def getDeviceCount() -> int:
        return 1

    @staticmethod
    def getDevice() -> int:
        return 0

    @staticmethod
    def getDeviceProperties(device: int) -> dict[str, int]:
        return {"multiProcessorCount": 1}

    @staticmethod
    def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)


class _Cuda:
    runtime = _Runtime()
    Event = _Event

    @staticmethod
    def get_elapsed_time(start: _Event, end: _Event) -> float:
        """Milliseconds between two recorded events."""
        return (end.at - start.at) * 1e3

    @staticmethod
    def get_current_stream() -> _Stream:
        return _Stream()

    @staticmethod
    def alloc_pinned_memory(nbytes: int) -> bytearray:
        return bytearray(nbytes)


class FakeCupy:
    """The few CuPy functions ringcomm calls, on DeviceArrays."""

    ndarray = DeviceArray
    cuda = _Cuda()

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator

    def empty(self, shape: Any, dtype: Any = np.float64) -> DeviceArray:
        return _dev(np.empty(shape, dtype))

    def zeros(self, shape: Any, dtype: Any = np.float64) -> DeviceArray:
        return _dev(np.zeros(shape, dtype))

    def arange(self, *args: Any, dtype: Any = None) -> DeviceArray:
        return _dev(np.arange(*args, dtype=dtype))

    def asarray(self, x: Any, dtype: Any = None) -> DeviceArray:
        return _dev(np.array(x, dtype=dtype, copy=True))

    def ascontiguousarray(self, x: Any, dtype: Any = None) -> DeviceArray:
        if dtype is not None and np.dtype(dtype) != np.asarray(x).dtype:
            return _dev(np.ascontiguousarray(_cupy_cast(x, dtype)))
        return _dev(np.ascontiguousarray(x))

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return bool(np.may_share_memory(a, b))

    def __getattr__(self, name: str) -> Any:  # ufuncs: isfinite, add, divide, ...
        ufunc = getattr(np, name)

        def call(*args: Any, **kw: Any) -> DeviceArray:
            # CuPy's ufunc kernels flush float32 subnormals (inputs and results).
            args = tuple(flush_subnormals(a) for a in args)
            with np.errstate(all="ignore"):  # CuPy does not warn either
                return _dev(flush_subnormals(np.asarray(ufunc(*args, **kw))))

        return call


@contextlib.contextmanager
def installed(emulator: Emulator) -> Iterator[FakeCupy]:
    """Run ringcomm.ops.cuda (and the MPI backend's device staging) on the emulator inside the
    block; CuPy, if any, is back afterwards."""
    fake = FakeCupy(emulator)

    def function(name: str) -> Any:
        def kernel(grid: tuple[int], block: tuple[int], args: tuple[Any, ...]) -> None:
            emulator.launch(name, grid[0], block[0], args)

        return kernel

    rt = _cuda_runtime
    saved = (rt._cupy, rt.function, dict(rt._functions), dict(rt._sm_counts))
    rt._cupy, rt.function = fake, function  # type: ignore[assignment]
    rt._functions.clear()
    rt._sm_counts.clear()
    try:
        yield fake
    finally:
        rt._cupy, rt.function = saved[0], saved[1]  # type: ignore[assignment]
        rt._functions.clear()
        rt._functions.update(saved[2])
        rt._sm_counts.clear()
        rt._sm_counts.update(saved[3])


@contextlib.contextmanager
def one_launch_at_a_time(emulator: Emulator) -> Iterator[Emulator]:
    """Serialize the emulator's launches inside the block: it runs one kernel at a time, and
    tests whose ranks are threads launch from several."""
    lock = threading.Lock()
    launch = emulator.launch

    def serialized(*args: Any) -> None:
        with lock:
            launch(*args)

    emulator.launch = serialized  # type: ignore[method-assign]
    try:
        yield emulator
    finally:
        del emulator.launch


def cache_dir() -> Path:
    """Where the emulated kernels are built: shared by the ranks of an MPI job and kept between
    runs (the file name carries a hash of the sources)."""
    path = Path(tempfile.gettempdir()) / f"ringcomm-emulator-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path
