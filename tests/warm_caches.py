"""Fill, once and before the tests start, the on-disk caches their processes would fill.

    python tests/warm_caches.py [--workers 2]

ringcomm compiles its Numba kernels (ops/_cpu_codecs.py, ops/_cpu_topk.py) and its compiled
small allreduce (backends/_mpi_fused_jit.py, for each dtype) on first use and keeps the code in
Numba's cache; the tests' emulated GPU (tests/gpu_emulator.py) is a C++ library built on first
use and kept in a temporary directory. In a fresh clone the suite's first jobs each compile
what they use, several processes at once (every rank of a job, both pytest workers) before any
has written the cache. Here each is compiled once, ``--workers`` at a time (``make test`` runs
this first); where the caches are already filled it takes a few seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

#: The dtypes the compiled small allreduce reduces (ringcomm.backends.mpi_fused.supports).
FUSED_DTYPES = ("float32", "float64", "int32", "int64")


def _kernel(name: str) -> None:
    from ringcomm.ops import _cpu_codecs, _cpu_jit, _cpu_topk  # noqa: F401  (they register)

    _cpu_jit.compile_kernel(name)


def _fused(dtype: str) -> None:
    from ringcomm.backends import mpi_fused

    mpi_fused.precompile(dtype)


def _emulator(concurrent: bool) -> None:
    import gpu_emulator

    from ringcomm.ops import _cuda_source

    if concurrent:  # tests/test_kernel_topk.py's ``at_once``
        gpu_emulator.build_kernels(gpu_emulator.cache_dir(), ["topk.cu"],
                                   list(_cuda_source.name_expressions("topk.cu")), workers=4)
    else:
        gpu_emulator.build(gpu_emulator.cache_dir())


def tasks() -> list[tuple[Callable[[Any], None], Any]]:
    """Every (function, argument) to run: the longest first."""
    from ringcomm.ops import _cpu_codecs, _cpu_jit, _cpu_topk  # noqa: F401  (they register)

    out: list[tuple[Callable[[Any], None], Any]] = [(_emulator, False), (_emulator, True)]
    out += [(_fused, dtype) for dtype in FUSED_DTYPES]
    out += [(_kernel, name) for name in _cpu_jit.KERNELS]
    return out


def _run(task: tuple[Callable[[Any], None], Any]) -> tuple[str, float, str]:
    """Run one task: its name, its seconds, and why it built nothing (or "")."""
    fn, arg = task
    start, why = time.perf_counter(), ""
    try:
        fn(arg)
    except FileNotFoundError as exc:  # no C++ compiler: the emulator's tests skip
        why = str(exc)
    return f"{fn.__name__}({arg})", time.perf_counter() - start, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    todo = tasks()
    # New processes (not forks of this one): each compiles as a test's process would.
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        done = list(pool.map(_run, todo))
    slow = [f"{name} {seconds:.1f} s" for name, seconds, _ in done if seconds > 1]
    missing = [f"{name}: {why}" for name, _, why in done if why]
    print(f"== caches warm: {len(done)} compiled or loaded in {time.perf_counter() - start:.0f} s"
          + (f" ({', '.join(slow)})" if slow else ""))
    for line in missing:
        print(f"   not built: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
