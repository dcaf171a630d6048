"""Which jobs get the shared segment of medium allreduces (ringcomm/backends/mpi_shared.py),
under a real mpiexec: ranks that MPI places on one node do; ranks that MPI places on nodes of
their own (MPICH's ``MPIR_CVAR_NOLOCAL=1``, as the emulated cluster runs them) do not, even
where they could map one file; both give the exact sum on every rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

# Each rank writes one bracketed line: its segment, and whether its sums were exact.
PROBE = r"""
import os, numpy as np, ringcomm
rank = int(os.environ["PMI_RANK"])
c = ringcomm.init("mpi", abort_on_exception=False)
exact = True
for n in (5_000, 30_001, 100_000):  # inlined, then medium
    x = np.arange(n, dtype=np.int64) * (rank + 1)
    y = c.allreduce(x)
    exact &= bool(np.array_equal(y, np.arange(n, dtype=np.int64) * 3))
    z = c.allreduce(x.astype(np.float64), op="avg")
    exact &= bool(np.array_equal(z, np.arange(n, dtype=np.float64) * 1.5))
shared = c.transport._shared
c.close()
os.write(1, f"<{rank}|{type(shared).__name__} {exact}>\n".encode())
"""


@pytest.mark.parametrize(("nolocal", "segment"), [("0", "SharedAllreduce"), ("1", "NoneType")])
def test_the_segment_only_where_mpi_sees_one_node(mpiexec, subprocess_env, nolocal, segment):
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("RINGCOMM_")}
    env["MPIR_CVAR_NOLOCAL"] = nolocal
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", PROBE], capture_output=True,
                          text=True, timeout=120, env=env)
    lines = dict(re.findall(r"^<(\d)\|(.*)>$", proc.stdout, re.MULTILINE))
    assert lines == {"0": f"{segment} True", "1": f"{segment} True"}, (
        proc.returncode, proc.stdout, proc.stderr)


# Rank 1 stalls where it would open rank 0's new segment: rank 0's exchange times out and
# ends the job (MPI_Abort, inside the wait, before any ``finally``).
STALL = r"""
import os, time, numpy as np, ringcomm
import ringcomm.backends.mpi_shared as shared
c = ringcomm.init("mpi")
c.allreduce(np.ones(8, np.float32))
if c.rank == 1:
    def stall(path, nbytes, token):
        os.write(1, f"<segment|{path}|{os.path.exists(path)}>\n".encode())
        time.sleep(60)
    shared._attach = stall
c.allreduce(np.ones(1 << 16, np.float32))  # 256 KiB: the segment's first use
"""


def test_the_segment_is_removed_where_a_timeout_ends_the_job(mpiexec, subprocess_env):
    """The segment's name goes with the job also where the job ends by a timeout while its
    ranks open it (it stayed in /dev/shm: MPI_Abort skipped the unlink in ``finally``)."""
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("RINGCOMM_")}
    env["RINGCOMM_TIMEOUT"] = "3"
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", STALL], capture_output=True,
                          text=True, timeout=120, env=env)
    found = re.findall(r"^<segment\|(.*)\|(\w+)>$", proc.stdout, re.MULTILINE)
    assert len(found) == 1 and found[0][1] == "True", (proc.stdout, proc.stderr[-3000:])
    assert proc.returncode != 0 and "Ending the job (MPI_Abort)" in proc.stderr, proc.stderr
    assert not os.path.exists(found[0][0])
