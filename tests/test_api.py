"""Public API in one process: init, ReduceOp, compressor parameters, a size-1 communicator."""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import logging
import subprocess
import sys

import numpy as np
import pytest

import ringcomm
from ringcomm import ReduceOp
from ringcomm.backends import mpi as comm_mpi

# Launcher variables that a test's own environment must not carry into init().
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
                "MV2_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")
_OPTION_VARS = ("RINGCOMM_SEGMENT_BYTES", "RINGCOMM_INLINE_BYTES", "RINGCOMM_CONSISTENCY_CHECK",
                "RINGCOMM_LOG_LEVEL", "RINGCOMM_TIMEOUT")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _LAUNCH_VARS + _OPTION_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def comm():
    c = ringcomm.init("mpi", abort_on_exception=False)
    yield c
    c.close()


def test_public_names():
    for name in ("init", "Communicator", "ReduceOp", "FP16", "BF16", "Int8", "TopK",
                 "ErrorFeedback", "CommStats"):
        assert name in ringcomm.__all__ and hasattr(ringcomm, name)


def test_init_rejects_unknown_backend():
    with pytest.raises(ValueError,
                       match="unknown backend 'tcp'; expected one of auto, mpi, nccl, gloo"):
        ringcomm.init("tcp")


def test_auto_picks_mpi_without_gpu():
    if ringcomm.nccl_available():
        pytest.skip("this machine has a GPU and NCCL")
    c = ringcomm.init(abort_on_exception=False)
    assert c.backend == "mpi" and c.size == 1 and c.rank == 0
    c.close()


def test_env_switches(monkeypatch):
    monkeypatch.setenv("RINGCOMM_CONSISTENCY_CHECK", "0")
    monkeypatch.setenv("RINGCOMM_SEGMENT_BYTES", "4096")
    c = ringcomm.init("mpi", abort_on_exception=False)
    assert not c.consistency_check and c.segment_bytes == 4096
    c.close()
    monkeypatch.setenv("RINGCOMM_CONSISTENCY_CHECK", "maybe")
    with pytest.raises(ValueError, match="RINGCOMM_CONSISTENCY_CHECK must be 0 or 1"):
        ringcomm.init("mpi")


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("RINGCOMM_SEGMENT_BYTES", "1T", "must be a byte count such as 1048576, 512K, 2M or 1G "
     "(K, M, G: KiB, MiB, GiB)"),
    ("RINGCOMM_SEGMENT_BYTES", "1.5M", "must be a byte count such as 1048576"),
    ("RINGCOMM_SEGMENT_BYTES", "2MB", "must be a byte count such as 1048576"),
    ("RINGCOMM_SEGMENT_BYTES", "-4096", "must be a byte count such as 1048576"),
    ("RINGCOMM_SEGMENT_BYTES", "32", "must be from 64 B to 1 GiB, got 32"),
    ("RINGCOMM_SEGMENT_BYTES", "99999999999999999999", "must be from 64 B to 1 GiB, got "
     "99999999999999999999"),
    ("RINGCOMM_SEGMENT_BYTES", "2G", "must be from 64 B to 1 GiB, got 2147483648"),
    ("RINGCOMM_INLINE_BYTES", "lots", "must be a byte count such as 1048576"),
    ("RINGCOMM_INLINE_BYTES", "12", "must be a multiple of 8 bytes from 0 B to 1 MiB, got 12"),
    ("RINGCOMM_INLINE_BYTES", "1G", "must be a multiple of 8 bytes from 0 B to 1 MiB, got "
     "1073741824"),
    ("RINGCOMM_CONSISTENCY_CHECK", "maybe", "must be 0 or 1 (or true/false, yes/no, on/off)"),
    ("RINGCOMM_LOG_LEVEL", "LOUD", "must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("RINGCOMM_TIMEOUT", "30m", "must be a positive number of seconds"),
    ("RINGCOMM_TIMEOUT", "0", "must be a positive number of seconds"),
    ("RINGCOMM_TIMEOUT", "-5", "must be a positive number of seconds"),
    ("RINGCOMM_TIMEOUT", "inf", "must be a positive number of seconds"),
])
def test_bad_env_value_names_the_variable(monkeypatch, name, value, expected):
    """A bad value is raised once the backend is up (by the start-up agreement, on every
    rank), as an InvalidArgumentError naming the rank, the variable and its value."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ringcomm.InvalidArgumentError) as info:
        ringcomm.init("mpi", abort_on_exception=False)
    message = str(info.value)
    assert message.startswith(f"init failed on rank 0: {name} {expected}"), message
    assert info.value.kind == "init" and info.value.ranks == (0,)
    if "got" not in expected:
        assert f"got {value!r}" in message, message


@pytest.mark.parametrize(("name", "value", "attribute", "expected"), [
    ("RINGCOMM_SEGMENT_BYTES", "2M", "segment_bytes", 2 << 20),
    ("RINGCOMM_SEGMENT_BYTES", "512K", "segment_bytes", 512 << 10),
    ("RINGCOMM_SEGMENT_BYTES", "1048576", "segment_bytes", 1 << 20),
    ("RINGCOMM_SEGMENT_BYTES", "4mib", "segment_bytes", 4 << 20),
    ("RINGCOMM_SEGMENT_BYTES", "1G", "segment_bytes", 1 << 30),
    ("RINGCOMM_INLINE_BYTES", "1k", "inline_bytes", 1024),
    ("RINGCOMM_INLINE_BYTES", "0", "inline_bytes", 0),
])
def test_size_suffixes(monkeypatch, name, value, attribute, expected):
    monkeypatch.setenv(name, value)
    with ringcomm.init("mpi", abort_on_exception=False) as c:
        assert getattr(c, attribute) == expected


def test_numpy_integers_are_ints():
    with ringcomm.init("mpi", segment_bytes=np.int64(4096), inline_bytes=np.uint32(64),
                       abort_on_exception=False) as c:
        assert (c.segment_bytes, c.inline_bytes) == (4096, 64)
        assert type(c.segment_bytes) is int


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"segment_bytes": 0}, ValueError, "segment_bytes must be from 64 B to 1 GiB, got 0"),
    ({"segment_bytes": 4096.0}, TypeError, "segment_bytes must be an int .* got float 4096.0"),
    ({"segment_bytes": "2M"}, TypeError, "segment_bytes must be an int .* got str '2M'"),
    ({"inline_bytes": True}, TypeError, "inline_bytes must be an int .* got bool True"),
    ({"consistency_check": "no"}, TypeError, "consistency_check must be True, False or None"),
    ({"timeout": 0}, ValueError, "timeout must be a positive, finite time, got 0"),
    ({"timeout": -1.5}, ValueError, "timeout must be a positive, finite time, got -1.5"),
    ({"timeout": float("nan")}, ValueError, "timeout must be a positive, finite time"),
    ({"timeout": datetime.timedelta(0)}, ValueError, "timeout must be a positive, finite time"),
    ({"timeout": "600"}, TypeError, "timeout must be a datetime.timedelta or a number of seconds"),
])
def test_bad_arguments_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        ringcomm.init("mpi", abort_on_exception=False, **kwargs)


@pytest.fixture
def timeouts(monkeypatch):
    """The ``timeout`` each MPICommunicator init() builds was given."""
    seen = []
    takes_timeout = "timeout" in inspect.signature(comm_mpi.MPICommunicator).parameters

    class Recording(comm_mpi.MPICommunicator):
        def __init__(self, mpi_comm=None, *, timeout, **kwargs):
            seen.append(timeout)
            if takes_timeout:
                kwargs["timeout"] = timeout
            super().__init__(mpi_comm, **kwargs)

    monkeypatch.setattr(comm_mpi, "MPICommunicator", Recording)
    return seen


def test_timeout_reaches_the_backend(monkeypatch, timeouts):
    for kwargs in ({}, {"timeout": datetime.timedelta(minutes=5)}, {"timeout": 42},
                   {"timeout": np.float32(2.5)}):
        ringcomm.init("mpi", abort_on_exception=False, **kwargs).close()
    monkeypatch.setenv("RINGCOMM_TIMEOUT", "12.5")
    ringcomm.init("mpi", abort_on_exception=False).close()
    assert timeouts == [1800.0, 300.0, 42.0, 2.5, 12.5]
    assert all(type(t) is float for t in timeouts)


@pytest.mark.parametrize(("env", "message"), [
    ({"PMI_RANK": "0", "PMI_SIZE": "2"},
     r"PMI_SIZE=2 \(mpich\) but MPI.COMM_WORLD has 1 process: each process is an MPI world of "
     "its own"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
     r"OMPI_COMM_WORLD_SIZE=4 \(openmpi\) but MPI.COMM_WORLD has 1 process"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"},
     r"SLURM_NTASKS=4 \(slurm\) but MPI.COMM_WORLD has 1 process: srun's PMI does not reach"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     r"WORLD_SIZE=2 \(torchrun\) but MPI.COMM_WORLD has 1 process: launch with mpiexec -n 2, "
     "or use backend='auto' or 'gloo' under torchrun"),
])
def test_launcher_size_mismatch_raises(comm, monkeypatch, env, message):
    """A launcher that says 2 or 4 processes, and an MPI world of one: never a size-1 comm.

    (``comm`` starts MPI before the launcher's variables are set, as a foreign launcher would.
    A torch.distributed group of one left by the adapter tests would be the job instead, and
    init would refuse it against these variables: tests/test_torch_initialized.py. Under
    torchrun's variables, ``init("mpi")`` without ``mpi_comm`` first meets the others over
    torch.distributed's store to join one MPI world, and torchrun's store is missing here:
    tests/test_torch_torchrun.py has the real jobs.)
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()  # the adapter tests make it again when they need it
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first = message
    if "RANK" in env and importlib.util.find_spec("torch") is None:
        first = (r"WORLD_SIZE=2 \(torchrun\) but MPI.COMM_WORLD has 1 process; ringcomm "
                 r"connects torchrun's processes over torch.distributed .* PyTorch is not "
                 r"installed: pip install 'ringcomm\[torch\]', or launch with mpiexec -n 2")
    elif "RANK" in env:
        first = (r"WORLD_SIZE=2 \(torchrun\), but torch.distributed could not start from "
                 r"torchrun's environment \(MASTER_ADDR=None, MASTER_PORT=None\)")
    with pytest.raises(RuntimeError, match=first):
        ringcomm.init("mpi", abort_on_exception=False)
    from mpi4py import MPI

    with pytest.raises(RuntimeError, match=message):
        ringcomm.init("mpi", mpi_comm=MPI.COMM_WORLD, abort_on_exception=False)
    # A communicator on part of the job is the caller's choice, and not checked.
    ringcomm.init("mpi", mpi_comm=MPI.COMM_SELF, abort_on_exception=False).close()


def _init_error(backend: str, env: dict[str, str]) -> str:
    """The error ``ringcomm.init(backend)`` raises in a fresh process with ``env`` added (a
    fresh one: tests in this process may have started torch.distributed already)."""
    code = ("import ringcomm\n"
            "try:\n"
            f"    ringcomm.init({backend!r}, abort_on_exception=False)\n"
            "except RuntimeError as err:\n"
            "    print(err)\n"
            "else:\n"
            "    print('no error')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**_child_env(), **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_auto_under_torchrun_env_without_a_store_raises():
    """torchrun's rank and size but no MASTER_ADDR: auto goes to gloo, which says what is missing
    instead of falling back to a one-process MPI communicator."""
    pytest.importorskip("torch")
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    for backend in ("auto", "gloo"):
        assert ("WORLD_SIZE=2 (torchrun), but torch.distributed could not start from torchrun's "
                "environment (MASTER_ADDR=None") in _init_error(backend, env)


def test_gloo_takes_no_mpi_comm():
    with pytest.raises(ValueError, match=r"mpi_comm is for the mpi and nccl backends; backend "
                       r"'gloo' runs over torch.distributed's default group, got mpi_comm=1"):
        ringcomm.init("gloo", mpi_comm=1)


def test_gloo_without_torch_distributed_or_torchrun_raises():
    pytest.importorskip("torch")
    assert ("backend 'gloo' runs over torch.distributed, which is not initialized, and this "
            "process has no torchrun environment") in _init_error("gloo", {})


def test_loggers_are_silent_by_default():
    root = logging.getLogger("ringcomm")
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    assert logging.getLogger("ringcomm.init").parent is root
    code = "import ringcomm; ringcomm.init('mpi', abort_on_exception=False).close()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=_child_env())
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("level", ["INFO", "debug"])
def test_log_level_prints_the_init_line(level):
    # Twice: the second init reuses the stderr handler instead of adding one.
    code = ("import ringcomm\nfor _ in range(2):\n"
            "    ringcomm.init(abort_on_exception=False, segment_bytes=4096).close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**_child_env(), "RINGCOMM_LOG_LEVEL": level})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if " INFO " in line]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr
    assert lines[0].startswith("[ringcomm rank 0/1] INFO ringcomm.init: backend "), lines[0]
    assert "(auto: one process" in lines[0] and "launcher none;" in lines[0], lines[0]
    assert "rank 0 of 1, 1 rank on this node; segment_bytes 4096, inline_bytes 4096, " \
           "consistency check on, timeout 1800 s" in lines[0], lines[0]
    assert ("DEBUG ringcomm.init: starting backend" in proc.stderr) == (level == "debug")


def _child_env() -> dict[str, str]:
    import os

    drop = _LAUNCH_VARS + _OPTION_VARS
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_"))}


def test_inline_bytes_option(monkeypatch):
    c = ringcomm.init("mpi", inline_bytes=0, abort_on_exception=False)
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(c.allreduce(x), x)
    assert c.inline_bytes == 0
    c.close()
    monkeypatch.setenv("RINGCOMM_INLINE_BYTES", "1024")
    c = ringcomm.init("mpi", abort_on_exception=False)
    assert c.inline_bytes == 1024
    c.close()
    with pytest.raises(ValueError,
                       match="inline_bytes must be a multiple of 8 bytes from 0 B to 1 MiB, got 5"):
        ringcomm.init("mpi", inline_bytes=5)


def test_segment_bytes_checked():
    with pytest.raises(ValueError, match="segment_bytes must be from 64 B to 1 GiB, got 8"):
        ringcomm.init("mpi", segment_bytes=8)
    with pytest.raises(ValueError,
                       match="inline_bytes must be a multiple of 8 bytes from 0 B to 1 MiB, "
                             "got -8"):
        ringcomm.init("mpi", inline_bytes=-8)


@pytest.mark.parametrize(("text", "op"), [("sum", ReduceOp.SUM), ("AVG", ReduceOp.AVG),
                                          (ReduceOp.MAX, ReduceOp.MAX), ("prod", ReduceOp.PROD)])
def test_reduce_op_parse(text, op):
    assert ReduceOp.parse(text) is op


def test_reduce_op_unknown():
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        ReduceOp.parse("mean")


def test_size_one(comm):
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_array_equal(comm.allreduce(x, op="avg"), x)
    np.testing.assert_array_equal(comm.reduce_scatter(x), x.reshape(-1))
    np.testing.assert_array_equal(comm.allgather(x), x)
    np.testing.assert_array_equal(comm.broadcast(x.copy()), x)
    y = comm.allreduce(x, compression=ringcomm.Int8(), feedback=ringcomm.ErrorFeedback(),
                       name="x")
    np.testing.assert_array_equal(y, x)  # nothing travels, nothing is lost


def test_repr_and_context_manager():
    with ringcomm.init("mpi", abort_on_exception=False) as c:
        assert "rank 0 of 1" in repr(c)
    assert "closed" in repr(c)
    assert "calls=0" in repr(ringcomm.CommStats())
