"""Multi-process tests: run under ``mpiexec -n N python -m pytest tests/mpi`` (tests/run_mpi.py).

Every rank runs the same tests in the same order (tests/mpi_pytest.py sends the output of ranks
other than 0 to log files). This plugin:

- agrees on each test phase's outcome across ranks: a test that fails on any rank fails on every
  rank (rank 0's report names the ranks and their errors), and a setup skipped on one rank is
  skipped on all, so that the ranks never run different collectives;
- works at any size, 1 included (a plain ``pytest`` runs these tests in one process).

Per-test timeouts come from pytest-timeout (thread method): a deadlocked rank dumps its stacks
and exits, and mpiexec then ends the whole job.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

_AGREE = MPI.COMM_WORLD.Dup()
RANK, SIZE = _AGREE.Get_rank(), _AGREE.Get_size()


def _summary(report: pytest.TestReport) -> str:
    text = report.longreprtext or ""
    lines = text.strip().splitlines()
    return "\n".join(lines[-25:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if SIZE == 1:
        return
    mine = (report.outcome, _summary(report) if report.outcome != "passed" else "")
    everyone = _AGREE.allgather(mine)
    failed = [(r, text) for r, (o, text) in enumerate(everyone) if o == "failed"]
    skipped = [(r, text) for r, (o, text) in enumerate(everyone) if o == "skipped"]
    if failed:
        others = [(r, t) for r, t in failed if r != RANK]
        if others:
            note = "\n\n".join(f"--- rank {r} ---\n{t}" for r, t in others)
            report.sections.append(("failures on other ranks", note))
        if report.outcome != "failed":
            report.outcome = "failed"
            ranks = ", ".join(str(r) for r, _ in failed)
            report.longrepr = f"failed on rank(s) {ranks} (passed here):\n\n" + "\n\n".join(
                f"--- rank {r} ---\n{t}" for r, t in failed)
    elif skipped and report.outcome == "passed" and call.when != "teardown":
        r, text = skipped[0]
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"skipped on rank {r}: {text}")


@pytest.fixture(scope="session")
def world():
    """A duplicate of MPI.COMM_WORLD for reference computations."""
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.fixture(scope="session")
def comm():
    """ringcomm's MPI communicator over all ranks."""
    import ringcomm

    c = ringcomm.init("mpi", abort_on_exception=False)
    yield c
    c.close()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded per test and per rank: ranks hold different data."""
    seed = zlib.crc32(request.node.nodeid.encode())  # hash() changes per process
    return np.random.default_rng([seed, RANK])
