"""Shared test configuration: the repository root, the venv's launcher, and the emulated GPU
for tests whose ranks are threads."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """The mpiexec next to this interpreter (the mpich wheel's Hydra), or skip."""
    here = Path(sys.executable).parent / "mpiexec"
    if not here.exists():
        pytest.skip("no mpiexec next to the interpreter (install ringcomm[mpi])")
    return str(here)


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for child processes: unbuffered output, and no inherited launcher rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_LOCAL", "HYDRA_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class ThreadDevice:
    """How a test puts arrays on the emulated device and reads them back (as NumPy)."""

    def __init__(self, put: Any, get: Any) -> None:
        self.put, self.get = put, get


@pytest.fixture(scope="module")
def thread_device() -> Iterator[ThreadDevice]:
    """The CPU emulator of tests/gpu_emulator.py installed as CuPy for the module's tests, its
    launches serialized (ranks as threads launch from several); skip without a C++ compiler."""
    import gpu_emulator

    try:
        emulator = gpu_emulator.build(gpu_emulator.cache_dir())
    except FileNotFoundError:
        pytest.skip("no C++ compiler for the emulated kernels")
    with gpu_emulator.one_launch_at_a_time(emulator), gpu_emulator.installed(emulator) as fake:
        yield ThreadDevice(fake.asarray, lambda a: np.array(a).view(np.ndarray))
