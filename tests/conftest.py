"""Shared test configuration: the repository root, and the venv's launcher."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
