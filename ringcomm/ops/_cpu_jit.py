"""The registry and compiler of ringcomm's Numba kernels (ops/_cpu_codecs.py, ops/_cpu_topk.py).

A kernel is registered with an explicit signature and stays a Python function until
``compile_kernel`` is first asked for it, so a process compiles only the kernels it uses.
Compiled code is cached on disk by Numba. Its cache is invalidated by changes to the file that
defines a function, not by changes to jitted helpers it calls in other files: every jitted
function therefore lives in the module of the kernels that call it, and this module holds none.
Importing it imports Numba; ``ringcomm.ops.cpu`` catches what fails here and in compiling, and
runs the reference instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

__all__ = ["KERNELS", "OPTIONS", "cached_njit", "compile_kernel", "inline", "kernel"]

#: Bit-identity with NumPy needs IEEE float32 semantics: no fast-math (no reassociation, no
#: FMA contraction, NaN semantics kept). error_model="numpy" drops the division-by-zero checks.
#: One thread per call (no parallel=True): training processes already use every core.
OPTIONS: dict[str, Any] = {"nogil": True, "error_model": "numpy", "fastmath": False}

#: name -> (Numba signature, Python function) of every registered kernel.
KERNELS: dict[str, tuple[str, Callable[..., Any]]] = {}


def kernel(signature: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as a kernel with an explicit signature (the wrappers in ops/cpu.py only
    pass arrays that match it); it stays a Python function until ``compile_kernel``."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        KERNELS[fn.__name__] = (signature, fn)
        return fn
    return register


def inline(fn: Callable[..., Any]) -> Any:
    """A jitted helper, compiled into each kernel that calls it."""
    return numba.njit(inline="always", **OPTIONS)(fn)


def compile_kernel(name: str) -> Callable[..., Any]:
    """Compile kernel ``name``, or load it from Numba's cache (see ``cached_njit``).

    Raises:
        KeyError: no such kernel.
        Exception: whatever Numba raises when it cannot compile it.
    """
    signature, fn = KERNELS[name]
    return cached_njit(fn, signature)


def cached_njit(fn: Callable[..., Any], signature: str | None = None,
                options: dict[str, Any] = OPTIONS) -> Any:
    """``fn`` jitted with ``options`` (for ``signature``, else for the types of each call),
    its code cached on disk: next to its source file, else in Numba's user-wide directory; in
    memory only where neither is writable."""
    try:
        return numba.njit(signature, cache=True, **options)(fn)
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
        return numba.njit(signature, cache=False, **options)(fn)
