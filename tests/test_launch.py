"""Rank discovery from launcher environments."""

from __future__ import annotations

import pytest

from ringcomm.comm.launch import LaunchInfo, detect


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
        ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
          "SLURM_NTASKS_PER_NODE": "4"}, LaunchInfo(6, 8, 2, 4, "slurm")),
        ({"PMIX_RANK": "1", "PMIX_SIZE": "2"}, LaunchInfo(1, 2, 1, 2, "pmix")),
        # A bare launch without local variables is taken to be one host.
        ({"PMI_RANK": "1", "PMI_SIZE": "3"}, LaunchInfo(1, 3, 1, 3, "mpich")),
    ],
)
def test_detect(env, expected):
    assert detect(env) == expected


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
    import subprocess
    import sys

    code = ("from ringcomm.comm.launch import detect; i = detect(); "
            "print(i.rank, i.size, i.local_rank, i.local_size, i.launcher)")
    out = subprocess.run([mpiexec, "-n", "3", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60, env=subprocess_env, check=True).stdout
    rows = sorted(tuple(line.split()) for line in out.strip().splitlines())
    assert rows == [(str(r), "3", str(r), "3", "mpich") for r in range(3)]
