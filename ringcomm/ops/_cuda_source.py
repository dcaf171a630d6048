"""The CUDA sources behind :mod:`ringcomm.ops.cuda` and the kernels each one instantiates.

Nothing here needs CuPy or a GPU: the test suite compiles exactly these sources and name
expressions with NVRTC on machines without one. Sources live in ``kernels/`` at the repository
root and ship as the package ``ringcomm._kernels``; they are read through importlib.resources
from an installed wheel, and from the folder itself in a checkout or an editable install.
Local headers (``#include "x.cuh"``) are inlined, so NVRTC needs no include path.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ringcomm.core.types import ReduceOp

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = [
    "COPY_PAIRS",
    "CTYPES",
    "DIVIDE_PAIRS",
    "FLOATS",
    "OPTIONS",
    "REDUCE_MIXED",
    "SOURCES",
    "cast_name",
    "copy_name",
    "divide_name",
    "name_expressions",
    "read_source",
    "reduce_name",
]

#: Kernel sources, by file name.
SOURCES = ("elementwise.cu", "quantize.cu", "cast.cu", "topk.cu", "lowrank.cu")

#: NVRTC options: C++17; no contraction of a * b + c into an FMA, and no flush of float32
#: subnormals to zero, neither of which NumPy does (ops/_kernel_cache.py compiles with exactly
#: these: CuPy's RawModule would add -ftz=true).
OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false")

#: The C++ type a NumPy dtype name is stored as in the kernels.
CTYPES = {
    "float16": "rc::half_t",
    "bfloat16": "rc::bf16_t",
    "float32": "float",
    "float64": "double",
    "int32": "int",
    "int64": "long long",
}
FLOATS = ("float16", "bfloat16", "float32", "float64")

# The instantiations cover what the ring, the compressors and the feedback use; rarer dtype
# combinations and layouts are converted to these (contiguous, the wider dtype) by the copy
# kernels and run on them (ops/cuda.py), never on CuPy's arithmetic, whose -ftz=true flushes
# float32 subnormals. Only conversions without a kernel here (float <-> integer, which NumPy
# leaves undefined for NaN and out-of-range values) are CuPy's.
#: (dst, src) dtype pairs with a conversion kernel; a same-dtype copy is a memcpy.
COPY_PAIRS = (
    *((d, s) for d in FLOATS for s in FLOATS if d != s),
    ("int32", "int64"),
    ("int64", "int32"),
)
#: (a, b, out) dtype triples of the mixed reductions: a float32 partial sum and a 16-bit
#: contribution; every dtype also reduces with itself.
REDUCE_MIXED = (("float32", "float16", "float32"), ("float32", "bfloat16", "float32"))
#: (in, out) dtype pairs of divide: each float with itself, and float32 into 16 bits.
DIVIDE_PAIRS = (*((f, f) for f in FLOATS), ("float32", "float16"), ("float32", "bfloat16"))

_FORMATS = {"f16": "rc::FmtF16", "bf16": "rc::FmtBF16"}


def copy_name(dst: str, src: str) -> str:
    """Name expression of the kernel converting dtype ``src`` to ``dst``."""
    return f"rc::copy_kernel<{CTYPES[dst]}, {CTYPES[src]}>"


def reduce_name(op: str, a: str, b: str, out: str) -> str:
    """Name expression of ``out = a (op) b`` for dtype names a, b, out and op "sum"..."prod"."""
    functor = ReduceOp.parse(op).spec.kernel
    return f"rc::reduce_kernel<{functor}, {CTYPES[a]}, {CTYPES[b]}, {CTYPES[out]}>"


def divide_name(src: str, out: str) -> str:
    """Name expression of ``out = src / divisor``."""
    return f"rc::divide_kernel<{CTYPES[src]}, {CTYPES[out]}>"


def cast_name(kind: str, fmt: str) -> str:
    """Name expression of cast kernel ``kind`` ("encode", "decode", "hop") for "f16"/"bf16"."""
    return f"rc::cast_{kind}_kernel<{_FORMATS[fmt]}>"


def int8_name(kind: str, stochastic: bool, error: bool) -> str:
    """The instantiation of int8 kernel ``kind`` ("encode" or "hop") for a rounding mode and
    whether it writes the quantization error (each compiled without the others' work)."""
    return f"rc::int8_{kind}_kernel<{str(stochastic).lower()}, {str(error).lower()}>"


def _elementwise_names() -> list[str]:
    names = [copy_name(d, s) for d, s in COPY_PAIRS]
    for op in {o.spec.kernel: o for o in ReduceOp}.values():  # one per kernel functor
        names += [reduce_name(op, t, t, t) for t in CTYPES]
        names += [reduce_name(op, a, b, o) for a, b, o in REDUCE_MIXED]
    names += [divide_name(s, o) for s, o in DIVIDE_PAIRS]
    for f in FLOATS:
        names += [f"rc::compensate_kernel<{CTYPES[f]}>", f"rc::zero_nonfinite_kernel<{CTYPES[f]}>"]
    names += ["rc::uniform_kernel", "rc::scatter_add_kernel", "rc::finite_copy_kernel",
              "rc::scatter_zero_kernel", "rc::topk_overflow_kernel"]
    return names


_NAMES = {
    "elementwise.cu": _elementwise_names,
    "quantize.cu": lambda: [int8_name(k, s, e) for k in ("encode", "hop")
                            for s in (False, True) for e in (False, True)]
    + ["rc::int8_decode_kernel"],
    "cast.cu": lambda: [cast_name(k, f) for k in ("encode", "decode", "hop") for f in _FORMATS],
    "lowrank.cu": lambda: ["rc::outer_sum_kernel", "rc::subtract_outer_kernel",
                           "rc::outer_sum_parts_kernel", "rc::subtract_outer_parts_kernel",
                           "rc::mark_dense_parts_kernel", "rc::dense_runs_kernel"],
    "topk.cu": lambda: ["rc::select_hist", "rc::select_pick", "rc::sample_limits",
                        "rc::select_count", "rc::select_scan", "rc::select_write",
                        "rc::select_compact"],
}


@functools.cache
def name_expressions(source: str) -> tuple[str, ...]:
    """Every kernel instantiation ``source`` is compiled with, as NVRTC name expressions."""
    return tuple(_NAMES[source]())


def _kernel_dir() -> Traversable | Path:
    """Where the kernel sources are: the installed ``ringcomm._kernels``, else ``kernels/``.

    A checkout put on ``sys.path`` without being installed (a copy of the working tree, as the
    GPU check runs), or installed in editable mode, has no ``ringcomm._kernels`` package (the
    folder has no ``__init__.py``, so that it never hides an installed ``kernels`` package);
    its sources sit at the root.
    """
    try:
        return importlib.resources.files("ringcomm._kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "kernels"


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.cache
def read_source(name: str) -> str:
    """The text of kernel source ``name`` with its local ``#include "..."`` headers inlined.

    Raises:
        FileNotFoundError: the package ships no such source.
    """
    root = _kernel_dir()
    seen: set[str] = set()

    def expand(file: str) -> str:
        seen.add(file)
        text = root.joinpath(file).read_text(encoding="utf-8")

        def include(match: re.Match[str]) -> str:
            header = match.group(1)
            return "" if header in seen else f"// from {header}\n{expand(header)}"

        return _INCLUDE.sub(include, text)

    return expand(name)
