"""Run pytest in one rank of an mpiexec job, its output in a log file unless it is rank 0.

    mpiexec -n 4 python tests/mpi_pytest.py tests/mpi [pytest arguments]

The redirection happens before pytest starts (pytest keeps the original descriptors for its
terminal), so the console shows rank 0 alone; the others write to
``$RINGCOMM_TEST_LOGDIR/rank<r>.log``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One BLAS/OpenMP thread per rank (as torchrun sets for its processes): the ranks already fill
# the cores, and threads spinning beside them took the digits training from 3.6 s to 25 s at 2
# ranks on 2 cores. Before anything loads NumPy's BLAS or torch; the user's settings stand.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringcomm.backends.mpi_process import yield_when_oversubscribed  # noqa: E402
from ringcomm.core.launch import detect  # noqa: E402


def main() -> int:
    yield_when_oversubscribed()  # before the test modules import mpi4py
    info = detect()
    if info.rank != 0:
        logdir = Path(os.environ.get("RINGCOMM_TEST_LOGDIR", f"logs/mpi-n{info.size}"))
        logdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(logdir / f"rank{info.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import pytest

    return pytest.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
