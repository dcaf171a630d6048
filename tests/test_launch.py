"""Rank discovery from launcher environments, and init() against what the launcher says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from exit_checks import run_bounded
from ports import free_port

from ringcomm.core import launch
from ringcomm.core.launch import LaunchInfo, detect

# What horovodrun's own launcher sets in the second of four processes on two hosts.
HOROVODRUN = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
              "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2",
              "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4711",
              "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LaunchInfo(0, 1, 0, 1, "none")),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
         LaunchInfo(3, 4, 1, 2, "mpich")),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
         LaunchInfo(5, 8, 1, 4, "openmpi")),
        ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
         LaunchInfo(2, 4, 0, 2, "torchrun")),
        ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0",
          "SLURM_NTASKS_PER_NODE": "4"}, LaunchInfo(6, 8, 2, 4, "slurm")),
        # srun in an allocation of 16 tasks starts a step of 8: the step's count is the job's.
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "8",
          "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"},
         LaunchInfo(5, 8, 1, 4, "slurm")),
        # The batch script itself is one process, whatever the allocation's task count.
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"},
         LaunchInfo(0, 1, 0, 1, "none")),
        ({"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "6",
          "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "3"},
         LaunchInfo(3, 6, 0, 3, "mvapich")),
        ({"PMIX_RANK": "1", "PMIX_SIZE": "2"}, LaunchInfo(1, 2, 1, 2, "pmix")),
        # A bare launch without local variables is taken to be one host.
        ({"PMI_RANK": "1", "PMI_SIZE": "3"}, LaunchInfo(1, 3, 1, 3, "mpich")),
        # Lightning's launcher sets no RANK: on node 0 the rank is the local rank.
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0", "MASTER_PORT": "29500"},
         LaunchInfo(1, 2, 1, 2, "lightning")),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
         LaunchInfo(3, 4, 1, 2, "lightning")),
        # horovodrun's own launcher (no MPI); run by srun or mpiexec, its processes inherit
        # the outer launcher's variables, which describe horovodrun itself.
        (HOROVODRUN, LaunchInfo(1, 4, 1, 2, "horovodrun")),
        ({**HOROVODRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0",
          "PMI_RANK": "0", "PMI_SIZE": "1"}, LaunchInfo(1, 4, 1, 2, "horovodrun")),
    ],
)
def test_detect(env, expected):
    assert detect(env) == expected


def test_lightning_launch_is_recognised_and_its_rank_unknown():
    info = detect({"WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert info.launcher == "lightning" and not info.rank_known and not info.over_torch
    assert info.describe() == "WORLD_SIZE=2 without RANK (PyTorch Lightning's launcher)"
    assert detect({"WORLD_SIZE": "2", "RANK": "1"}).rank_known


@pytest.mark.parametrize(("env", "variable", "text"), [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "WORLD_SIZE", "WORLD_SIZE=2 (torchrun)"),
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, "PMI_SIZE", "PMI_SIZE=4 (mpich)"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}, "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_SIZE=3 (openmpi)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEPID": "1"}, "SLURM_NTASKS",
     "SLURM_NTASKS=2 (slurm)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "9", "SLURM_STEP_NUM_TASKS": "3"},
     "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_TASKS=3 (slurm)"),
    ({}, "", "no launcher variables (a process started on its own, size 1)"),
])
def test_launch_info_names_its_size_variable(env, variable, text):
    info = detect(env)
    assert info.size_variable == variable and info.describe() == text


def test_torchrun_wins_inside_mpirun():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "PMI_RANK": "0", "PMI_SIZE": "1"}
    assert detect(env).launcher == "torchrun"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "PMI_RANK should be an integer, got 'x'"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "expected 0 <= rank < size"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
         "expected 0 <= local rank < local size"),
    ],
)
def test_detect_rejects_bad_values(env, message):
    with pytest.raises(ValueError, match=message):
        detect(env)


def test_hydra_sets_what_detect_reads(mpiexec, subprocess_env):
    """Under the mpich wheel's mpiexec, every rank reads its own rank from the environment."""
    import re

    # One bracketed write per rank: the ranks share a pipe, and a print's text and newline can
    # be two writes that another rank's output slips between.
    code = ("import os; from ringcomm.core.launch import detect; i = detect(); "
            "os.write(1, f'<{i.rank} {i.size} {i.local_rank} {i.local_size} {i.launcher}>'"
            ".encode())")
    proc = run_bounded([mpiexec, "-n", "3", sys.executable, "-c", code], timeout=60,
                       env=subprocess_env)
    proc.check_returncode()
    out = proc.stdout
    rows = sorted(re.findall(r"<(\d+) (\d+) (\d+) (\d+) (\w+)>", out))
    assert rows == [(str(r), "3", str(r), "3", "mpich") for r in range(3)], out


# One write per line: the ranks' outputs share a pipe, and a print's text and newline can be
# two writes that another rank's line slips between.
INIT = ("import sys, numpy as np, ringcomm; c = ringcomm.init(abort_on_exception=False); "
        "sys.stdout.write(f'{c.rank} {c.size} {c.allreduce(np.ones(3))[0]}\\n'); "
        "sys.stdout.flush(); c.close()")


def test_log_level_info_names_rank_backend_and_launcher(mpiexec, subprocess_env):
    """Under mpiexec -n 2, RINGCOMM_LOG_LEVEL=INFO makes each rank log its init line."""

    env = {**subprocess_env, "RINGCOMM_LOG_LEVEL": "INFO"}
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", INIT], timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["0 2 2.0", "1 2 2.0"], proc.stdout
    lines = sorted(line for line in proc.stderr.splitlines() if "ringcomm.init" in line)
    assert len(lines) == 2, proc.stderr
    for rank, line in enumerate(lines):
        assert line.startswith(f"[ringcomm rank {rank}/2] INFO ringcomm.init: backend "), line
        assert "(auto: " in line and "launcher mpich (PMI_SIZE=2)" in line, line
        assert f"rank {rank} of 2, 2 ranks on this node" in line, line
        assert "consistency check on, timeout 1800 s" in line, line


def test_silent_by_default(mpiexec, subprocess_env):

    env = {k: v for k, v in subprocess_env.items() if k != "RINGCOMM_LOG_LEVEL"}
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", INIT], timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr


def test_torchrun_size_under_mpiexec_n1_raises(mpiexec, subprocess_env):
    """WORLD_SIZE=2 in a job mpiexec started with one process: backend "mpi" refuses it."""

    code = ("import ringcomm\n"
            "try:\n    ringcomm.init('mpi', abort_on_exception=False)\n"
            "except RuntimeError as err:\n    print(err)\n")
    env = {**subprocess_env, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    proc = run_bounded([mpiexec, "-n", "1", sys.executable, "-c", code], timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("WORLD_SIZE=2 (torchrun) but MPI.COMM_WORLD has 1 process: "
                                  "launch with mpiexec -n 2"), proc.stdout


def test_torchrun_variables_left_in_an_mpiexec_job(mpiexec, subprocess_env, tmp_path):
    """torchrun's RANK=0 and WORLD_SIZE=2 (with MASTER_ADDR and MASTER_PORT) left in the
    environment of mpiexec -n 2, which both processes inherit alike: backend "auto" says so on
    both ranks at once (it waited 30 minutes for a torch.distributed rank 1 that never came,
    both processes claiming rank 0), and "mpi", which needs no torch.distributed, runs on
    MPI's own numbering."""
    code = ("import numpy as np, os, ringcomm, sys\n"
            "try:\n"
            "    c = ringcomm.init(sys.argv[1], abort_on_exception=False)\n"
            "    out = f'rank {c.rank} size {c.size} {c.allreduce(np.full(2, c.rank + 1.0))}'\n"
            "except RuntimeError as err:\n    out = f'error: {err}'\n"
            "with open(f\"{sys.argv[2]}.{os.environ['PMI_RANK']}\", 'w') as f:\n"
            "    f.write(out)\n")
    env = {**subprocess_env, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}

    def run(backend: str) -> list[str]:
        out = tmp_path / backend
        proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", code, backend, str(out)],
                           timeout=90, env=env)
        assert proc.returncode == 0, proc.stderr
        return [Path(f"{out}.{rank}").read_text() for rank in range(2)]

    auto = run("auto")
    assert auto[0] == auto[1], auto
    assert auto[0].startswith("error: RANK and WORLD_SIZE=2 (torchrun's variables) do not "
                              "number the 2 processes of this MPI job: MPI ranks 0 to 1 have "
                              "RANK [0, 0]."), auto
    assert "unset RANK, WORLD_SIZE" in auto[0], auto
    assert run("mpi") == ["rank 0 size 2 [3. 3.]", "rank 1 size 2 [3. 3.]"]



@pytest.mark.parametrize("world_size, processes, expected", [
    (4, 2, "RANK and WORLD_SIZE=4 (torchrun's variables) do not give the 2 processes of this "
           "MPI job 2 distinct ranks below 4: MPI ranks 0 to 1 have RANK [0, 0]."),
    (2, 4, "RANK=0 and WORLD_SIZE=2 (torchrun's variables) describe a job of 2 processes, but "
           "an MPI launcher started 4 processes in this one: some would share a rank. They "
           "were left"),
    (1, 2, "RANK=0 and WORLD_SIZE=1 (torchrun's variables) describe a job of 1 process, but "
           "an MPI launcher started 2 processes in this one: some would share a rank (each "
           "would run as a job of its own). They were left"),
], ids=["larger", "smaller", "one"])
def test_torchrun_variables_of_another_size_left_in_an_mpiexec_job(
        mpiexec, subprocess_env, tmp_path, world_size, processes, expected):
    """RANK=0 and a WORLD_SIZE other than the job's left in the environment of an mpiexec job:
    backend "auto" refuses them at once, the same on every rank. Before, with WORLD_SIZE=4 in
    mpiexec -n 2, and with WORLD_SIZE=2 in mpiexec -n 4, one process waited its whole timeout
    (30 minutes by default) for torch.distributed ranks that never came while the others
    failed at once (EADDRINUSE); with WORLD_SIZE=1 in mpiexec -n 2 one process went on alone,
    a communicator of 1 process in a job of 2."""
    code = ("import os, ringcomm, sys\n"
            "try:\n"
            "    c = ringcomm.init(abort_on_exception=False)\n"
            "    out = f'rank {c.rank} size {c.size}'\n"
            "except RuntimeError as err:\n    out = f'error: {err}'\n"
            "with open(f\"{sys.argv[1]}.{os.environ['PMI_RANK']}\", 'w') as f:\n"
            "    f.write(out)\n")
    env = {**subprocess_env, "RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RINGCOMM_TIMEOUT": "60"}
    out = tmp_path / "auto"
    proc = run_bounded([mpiexec, "-n", str(processes), sys.executable, "-c", code, str(out)],
                       timeout=90, env=env)
    assert proc.returncode == 0, proc.stderr
    got = [Path(f"{out}.{rank}").read_text() for rank in range(processes)]
    assert len(set(got)) == 1, got
    assert got[0].startswith(f"error: {expected}"), got
    assert "unset RANK, WORLD_SIZE" in got[0], got


def test_one_mpiexec_per_part_of_a_torchrun_style_job(mpiexec, subprocess_env, tmp_path):
    """Two mpiexec -n 2 jobs whose processes are ranks 0-1 and 2-3 of one job of 4 (RANK
    and WORLD_SIZE set for each process, as a script per node would): MPI's world is part of
    the job, and the check above, a collective over each part, lets them meet as one job of 4
    over torch.distributed."""
    code = ("import os, numpy as np, ringcomm, sys\n"
            "os.environ['RANK'] = str(int(sys.argv[2]) + int(os.environ['PMI_RANK']))\n"
            "c = ringcomm.init(abort_on_exception=False)\n"
            "out = f'rank {c.rank} size {c.size} {c.allreduce(np.full(2, c.rank + 1.0))}'\n"
            "with open(f\"{sys.argv[1]}.{c.rank}\", 'w') as f:\n"
            "    f.write(out)\n")
    env = {**subprocess_env, "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RINGCOMM_TIMEOUT": "60"}
    out = tmp_path / "part"
    jobs = [subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-c", code, str(out), base],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for base in ("0", "2")]
    try:
        ends = [job.communicate(timeout=120) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    assert [job.returncode for job in jobs] == [0, 0], ends
    got = [Path(f"{out}.{rank}").read_text() for rank in range(4)]
    assert got == [f"rank {r} size 4 [10. 10.]" for r in range(4)], got


@pytest.mark.parametrize("env, launched", [
    ({}, False),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, False),  # torchrun alone
    ({"RANK": "0", "WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "2"}, True),
    # torchrun's worker under mpiexec: the PMI variables are its agent's
    ({"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "1",
      "TORCHELASTIC_RUN_ID": "none"}, False),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, True),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, False),  # the batch script, not an srun task
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, True),
    # horovodrun's own launcher started it: no MPI job (ringcomm.init starts one over its
    # rendezvous server), also where horovodrun itself ran under mpiexec (PMI_*) or srun.
    (HOROVODRUN, False),
    ({**HOROVODRUN, "PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "5"}, False),
    ({**HOROVODRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, False),
])
def test_mpi_launched(env, launched):
    assert launch.mpi_launched(env) is launched


def test_horovodrun_rendezvous_is_where_its_server_listens():
    assert launch.horovodrun_rendezvous(HOROVODRUN) == ("10.0.0.1", 4711)
    assert launch.horovodrun_rendezvous({}) is None
    # HOROVOD_RANK without the rendezvous: not horovodrun's own launcher (its --mpi mode
    # starts processes through mpirun, which sets no HOROVOD_RANK).
    no_server = {k: v for k, v in HOROVODRUN.items() if "RENDEZVOUS" not in k}
    assert launch.horovodrun_rendezvous(no_server) is None
    with pytest.raises(ValueError, match="HOROVOD_GLOO_RENDEZVOUS_PORT should be an integer"):
        launch.horovodrun_rendezvous({**HOROVODRUN, "HOROVOD_GLOO_RENDEZVOUS_PORT": "x"})
    assert detect(HOROVODRUN).describe() == "HOROVOD_SIZE=4 (horovodrun)"



def test_a_process_started_by_a_rank_is_not_one_of_the_job(mpiexec, subprocess_env, tmp_path):
    """A rank of an mpiexec job runs a script of its own, which inherits mpiexec's variables
    and calls ringcomm.init(): it fails at once, saying why (its MPI start failed on the
    closed PMI_FD, with MPICH's error stack), and the job goes on."""
    script = tmp_path / "job.py"
    script.write_text((Path(__file__).parent / "inherited_child.py").read_text())
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, str(script)], timeout=90,
                       env=subprocess_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, proc.stdout
    for rank in range(2):
        child = (tmp_path / f"job.py.{rank}").read_text()
        assert child.startswith("0 RuntimeError: PMI_SIZE=2 (mpich), but PMI_FD="), child
        assert "is not one of the job's" in child, child


@pytest.mark.parametrize("variables", [
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"},
], ids=["torchrun", "horovodrun"])
@pytest.mark.parametrize("on_rank", [0, 1])
def test_launcher_variables_on_some_ranks_only(mpiexec, subprocess_env, tmp_path, variables,
                                               on_rank):
    """A launcher's variables in some processes of an mpiexec job only: every rank raises
    the same ArgumentMismatchError naming what each read. The ranks' start-ups parted: with
    torchrun's, each read the other's message as its own (an error of garbage bytes, a
    different one per rank); with Horovod's, one rank raised TypeError and the other waited
    the whole timeout."""
    code = ("import os, sys, ringcomm\n"
            "try:\n"
            "    ringcomm.init(abort_on_exception=False)\n"
            "    out = 'no error'\n"
            "except Exception as err:\n    out = f'{type(err).__name__}: {err}'\n"
            "with open(f\"{sys.argv[1]}.{os.environ['PMI_RANK']}\", 'w') as f:\n"
            "    f.write(out)\n")
    out = tmp_path / "out"
    plain = [sys.executable, "-c", code, str(out)]
    tagged = ["env", *(f"{k}={v}" for k, v in variables.items()), *plain]
    first, second = (tagged, plain) if on_rank == 0 else (plain, tagged)
    env = {**subprocess_env, "RINGCOMM_TIMEOUT": "60"}
    proc = run_bounded([mpiexec, "-n", "1", *first, ":", "-n", "1", *second], timeout=90,
                       env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [Path(f"{out}.{rank}").read_text() for rank in range(2)]
    assert errors[0] == errors[1], errors
    launcher = "torchrun" if "RANK" in variables else "horovodrun"
    read = [launcher if rank == on_rank else "mpich" for rank in range(2)]
    assert errors[0].startswith(
        "ArgumentMismatchError: init: the ranks of this MPI job read different launchers' "
        f"variables: {read[0]} on rank 0; {read[1]} on rank 1."), errors


def test_a_torchrun_world_that_never_comes_is_said_while_waiting(subprocess_env):
    """RANK=0 and WORLD_SIZE=2 left in the shell of a plain process: torch.distributed waits
    for a rank that never comes, up to the timeout (30 minutes by default), and said nothing
    until then. A warning at half the timeout (at most a minute) and the error say that no
    torchrun agent started the process and that the variables may be stale."""
    env = {**subprocess_env, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RINGCOMM_TIMEOUT": "6"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = run_bounded([sys.executable, "-c",
                        "import ringcomm; ringcomm.init(abort_on_exception=False)"],
                       timeout=60, env=env)
    assert proc.returncode != 0
    stale = ("no torchrun agent started this process (no TORCHELASTIC_RUN_ID), so RANK, "
             "WORLD_SIZE, MASTER_ADDR and MASTER_PORT may be left in its environment by an "
             "earlier launch")
    assert "RuntimeWarning: WORLD_SIZE=2 (torchrun): torch.distributed has waited 3 s for the " in (
        proc.stderr)
    assert f"(up to the timeout, 6 s); {stale}" in proc.stderr, proc.stderr[-3000:]
    assert "RuntimeError: WORLD_SIZE=2 (torchrun), but torch.distributed could not start " in (
        proc.stderr)
    assert f"MASTER_PORT='{env['MASTER_PORT']}'); {stale}: " in proc.stderr, proc.stderr[-3000:]


def test_open_mpi_variables_left_in_an_mpich_job(mpiexec, subprocess_env, tmp_path):
    """Open MPI's OMPI_COMM_WORLD_RANK=0 and OMPI_COMM_WORLD_SIZE=1 left in the environment of
    MPICH's mpiexec -n 2: the processes hold mpiexec's connection, so MPICH's variables are
    theirs; the job of 2 runs (both ranks raised, blaming an mpiexec of another MPI)."""
    code = ("import numpy as np, os, ringcomm, sys\n"
            "c = ringcomm.init(abort_on_exception=False)\n"
            "total = int(c.allreduce(np.array([c.rank], np.int64))[0])\n"
            "with open(f\"{sys.argv[1]}.{os.environ['PMI_RANK']}\", 'w') as f:\n"
            "    f.write(f'rank {c.rank} of {c.size}, sum {total}')\n")
    out = tmp_path / "out"
    env = {**subprocess_env, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", code, str(out)], timeout=90,
                       env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [Path(f"{out}.{r}").read_text() for r in range(2)] == [
        "rank 0 of 2, sum 1", "rank 1 of 2, sum 1"]
