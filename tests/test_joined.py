"""A process started by a process of a launched job inherits the launcher's variables: it is
refused as it asks to join (``ringcomm.core.joined``), and a job of another launch is not."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from ringcomm.core import joined
from ringcomm.core.launch import detect

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "localhost", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc",
            "TORCHELASTIC_RESTART_COUNT": "0"}
HOROVODRUN = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
              "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
              "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000"}
LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
             "PMI_FD", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_RANK",
             "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS",
             "TORCHELASTIC_RUN_ID", joined.JOINED, *HOROVODRUN)


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables (and nothing of another's) in this process."""
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)

    def set_env(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_env


def _marked_by_parent(monkeypatch) -> None:
    """What a process of the job leaves in the environment it hands a program it starts."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    joined.mark_joined(detect())
    monkeypatch.setattr(os, "getpid", lambda: 4243)  # the program it started


@pytest.mark.parametrize("variables", [TORCHRUN, HOROVODRUN], ids=["torchrun", "horovodrun"])
def test_a_child_of_a_joined_process_is_refused(launched, monkeypatch, variables):
    launched(variables)
    _marked_by_parent(monkeypatch)
    assert os.environ[joined.JOINED].startswith("4242 ")
    with pytest.raises(RuntimeError, match=r"inherited from process 4242, which already joined "
                       r"the job as rank \d: this process, started by it, is not one of the "
                       r"job's\. Remove \w+"):
        joined.refuse_inherited(detect())


@pytest.mark.parametrize("variables", [TORCHRUN, HOROVODRUN], ids=["torchrun", "horovodrun"])
def test_the_joined_process_itself_may_call_again(launched, variables):
    launched(variables)
    joined.mark_joined(detect())
    assert os.environ[joined.JOINED].startswith(f"{os.getpid()} ")
    joined.refuse_inherited(detect())


@pytest.mark.parametrize("change", [{"MASTER_PORT": "29500"}, {"RANK": "0"},
                                    {"TORCHELASTIC_RUN_ID": "other"},
                                    {"TORCHELASTIC_RESTART_COUNT": "1"}])
def test_a_job_of_another_launch_may_join(launched, monkeypatch, change):
    """A torchrun started by a process of the job gives its own processes another port or run
    id, or other ranks: they are processes of that job, and join it."""
    launched(TORCHRUN)
    _marked_by_parent(monkeypatch)
    launched(change)
    joined.refuse_inherited(detect())


def test_one_process_jobs_and_other_launchers_are_not_marked(launched):
    launched({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
              "LOCAL_WORLD_SIZE": "1"})
    joined.mark_joined(detect())
    assert joined.JOINED not in os.environ
    for name in TORCHRUN:
        os.environ.pop(name, None)
    launched({"PMI_RANK": "0", "PMI_SIZE": "2"})
    joined.mark_joined(detect())
    assert joined.JOINED not in os.environ


@pytest.fixture
def no_mpi_yet(monkeypatch):
    """This process as before MPI started (mpi4py.MPI not imported)."""
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_mpiexec_connection_closed_is_refused(launched, no_mpi_yet, tmp_path):
    """Hydra's PMI_FD is an open socket in every process mpiexec starts; in one that such a
    process started it is closed (subprocess closes it) or names something else."""
    launched({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "987"})
    with pytest.raises(RuntimeError, match=r"PMI_SIZE=2 \(mpich\), but PMI_FD=987, mpiexec's "
                       r"connection to this process, is not open here: .* Remove PMI_RANK, "
                       r"PMI_SIZE and PMI_FD from its environment"):
        joined.refuse_inherited(detect())
    with open(tmp_path / "file", "w") as f:    # an fd of the same number, but no socket
        os.environ["PMI_FD"] = str(f.fileno())
        with pytest.raises(RuntimeError, match="is not open here"):
            joined.refuse_inherited(detect())


def test_mpiexec_connection_open_is_accepted(launched, no_mpi_yet):
    left, right = socket.socketpair()
    with left, right:
        launched({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": str(left.fileno())})
        joined.refuse_inherited(detect())


def test_mpiexec_connection_is_not_asked_once_mpi_started(launched, monkeypatch):
    """MPI's start has used the connection; what it is now is MPI's business."""
    launched({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "987"})
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())
    joined.refuse_inherited(detect())


def test_torchrun_worker_under_mpiexec_is_not_asked_for_the_agents_connection(launched,
                                                                             no_mpi_yet):
    """torchrun's workers under mpiexec inherit the agent's PMI variables, which ringcomm
    never uses for them (``launch.mpi_launched``): not a reason to refuse."""
    launched({**TORCHRUN, "PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "987"})
    joined.refuse_inherited(detect())
