"""A rank that dies (or raises) mid-collective ends the whole job, non-zero, within 60 s."""

from __future__ import annotations

import sys
import time

import pytest
from exit_checks import run_bounded

SCRIPT = r"""
import os, signal, sys, time
import numpy as np
import ringcomm

how = sys.argv[1]
comm = ringcomm.init("mpi")
x = np.ones(1 << 22, dtype=np.float32)
comm.allreduce(x)                       # everyone is up
if comm.rank == 1:
    time.sleep(0.5)                     # the others are inside the next allreduce by now
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    else:
        raise RuntimeError("rank 1 fails mid-job")
comm.allreduce(x)
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("how", ["kill", "exit", "raise"])
def test_dead_rank_ends_the_job(mpiexec, subprocess_env, tmp_path, how):
    script = tmp_path / "die.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = run_bounded([mpiexec, "-n", "3", sys.executable, str(script), how],
                       timeout=90, env=subprocess_env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    assert "unreachable" not in proc.stdout
    if how == "raise":
        assert "rank 1 fails mid-job" in proc.stderr


SETUP_SCRIPT = r"""
import datetime, os, sys
from mpi4py import MPI
from ringcomm.torch.process_group import init_process_group_from_mpi

if MPI.COMM_WORLD.Get_rank() == 1:  # its gloo cannot start: no such interface
    os.environ["GLOO_SOCKET_IFNAME"] = "rcnosuchif0"
init_process_group_from_mpi(timeout=datetime.timedelta(seconds=300),
                            abort_on_exception=sys.argv[1] == "abort")
print("unreachable", flush=True)
"""


def test_a_rank_whose_process_group_fails_to_start_ends_the_job(mpiexec, subprocess_env,
                                                               tmp_path):
    """init_process_group_from_mpi on a rank whose gloo cannot start: the job ends at once,
    non-zero, with that rank's error, instead of rank 0 waiting the group's timeout for it."""
    pytest.importorskip("torch")
    script = tmp_path / "setup.py"
    script.write_text(SETUP_SCRIPT)
    start = time.monotonic()
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, str(script), "abort"],
                       timeout=90, env=subprocess_env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    assert "unreachable" not in proc.stdout
    assert "rcnosuchif0" in proc.stderr, proc.stderr[-3000:]


BACKEND_SCRIPT = r"""
import torch, torch.distributed as dist
import ringcomm.torch  # registers "ringcomm"

dist.init_process_group("ringcomm")          # torchrun's processes join one MPI world
t = torch.ones(1 << 20)
dist.all_reduce(t)
assert dist.group.WORLD.communicator.backend == "mpi"
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails mid-job")
dist.all_reduce(t)                          # the others wait for rank 1 here
print("unreachable", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_that_raises_under_torchrun_ends_the_job(subprocess_env, tmp_path):
    """torch.distributed's "ringcomm" backend under torchrun, one rank raising mid-job: the job
    ends at once, non-zero, with that rank's traceback, as on gloo (torchrun ends the rest
    when a process fails). Without the abort the failing rank waited in MPI_Finalize's barrier
    at exit, the others waited for it, and torchrun saw no process end."""
    script = tmp_path / "job.py"
    script.write_text(BACKEND_SCRIPT)
    start = time.monotonic()
    proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], timeout=90, env=subprocess_env,
                       cwd=tmp_path)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "unreachable" not in output, output[-4000:]
    assert "rank 1 fails mid-job" in output, output[-4000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


PG_SCRIPT = r"""
import torch.distributed as dist
from ringcomm.torch.process_group import init_process_group

init_process_group()                        # over MPI's world; torch wraps sys.excepthook
if dist.get_rank() == 0:
    raise RuntimeError("rank 0 fails after init_process_group")
dist.barrier()                              # the others wait for rank 0 here
print("unreachable", flush=True)
"""


def test_a_rank_that_raises_after_init_process_group_prints_its_traceback(mpiexec,
                                                                          subprocess_env,
                                                                          tmp_path):
    """A job set up with ringcomm.torch.process_group.init_process_group under mpiexec, one
    rank raising: the job ends at once with that rank's traceback. torch's excepthook, which
    wraps ringcomm's abort hook, captured the traceback to print it after the hook returned,
    and the abort ended the job first: no error message at all."""
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(PG_SCRIPT)
    start = time.monotonic()
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, str(script)], timeout=90,
                       env=subprocess_env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "unreachable" not in proc.stdout
    assert "RuntimeError: rank 0 fails after init_process_group" in proc.stderr, (
        proc.stdout[-2000:] + proc.stderr[-2000:])
    assert "Traceback (most recent call last)" in proc.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
