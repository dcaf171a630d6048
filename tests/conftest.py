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


@pytest.fixture(autouse=True)
def _forget_joined_jobs() -> Iterator[None]:
    """A test that started a communicator under a launcher's variables of its own (set with
    monkeypatch) leaves this process marked as a process of that job (``RINGCOMM_JOINED``,
    ringcomm/core/joined.py), which the processes later tests start would inherit."""
    yield
    os.environ.pop("RINGCOMM_JOINED", None)


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
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_LOCAL", "HYDRA_"))
           and k != "RINGCOMM_JOINED"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def lightning_plain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                    subprocess_env: dict[str, str]) -> Path:
    """Lightning's DDP on PyTorch's own gloo, trained once a session under Lightning's own
    launcher (tests/test_frameworks.py's script, mode "plain"): the baseline that the
    "ringcomm" backend's runs under every launcher must equal bit for bit. The directory
    holding ``plain_0.pt`` and ``plain_1.pt``, made by the first test that asks, under a lock
    that xdist's workers share (their temporary directories have this session's in common)."""
    pytest.importorskip("lightning")
    from filelock import FileLock
    from test_frameworks import train_plain

    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker: its session's directory
        root = root.parent
    out = root / "lightning_plain"
    with FileLock(str(root / "lightning_plain.lock")):
        if not all((out / f"plain_{rank}.pt").exists() for rank in (0, 1)):
            out.mkdir(exist_ok=True)
            train_plain(out, subprocess_env)
    return out


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
