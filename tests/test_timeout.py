"""Bounded time: a peer that closed, exited or stopped turns a collective into an error.

The MPI jobs run under ``mpiexec -n 2`` with a short timeout. By default a timeout ends the
job (MPI_Abort): every process must be gone, with a non-zero exit status, within the timeout
plus a few seconds, and the surviving rank's stderr names the collective, the peer where one
is known, and the timeout. With ``abort_on_timeout=False`` the error is raised instead, and its
fields are checked. Every rank writes its pid to a file, so that no process outlives a test
whatever happens (a stopped rank included).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from exit_checks import run_bounded

from ringcomm.backends.threads import run_ranks
from ringcomm.comm.base import Communicator
from ringcomm.core.types import CollectiveError, CollectiveTimeoutError

TIMEOUT_S = 3.0
#: How long after the timeout every process must have ended.
GRACE_S = 10.0

pytestmark = pytest.mark.timeout(120)

# argv: how ("close", "exit", "stop"), the pid directory.
DEATH = r"""
import os, signal, sys
import numpy as np
import ringcomm

how, piddir = sys.argv[1], sys.argv[2]
comm = ringcomm.init("mpi")             # the timeout comes from RINGCOMM_TIMEOUT
with open(os.path.join(piddir, f"rank{comm.rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
x = np.ones(1 << 16, dtype=np.float32)  # 256 KiB: past the inline slot, the ring runs
comm.allreduce(x)                       # everyone is up
if comm.rank == 1:
    if how == "close":
        comm.close()
        sys.exit(0)                     # MPI_Finalize, then a clean exit
    if how == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGSTOP)
comm.allreduce(x)
print("unreachable", flush=True)
"""

# argv: the timeout, the pid directory. Prints rank 0's errors as JSON lines.
NO_ABORT = r"""
import json, math, os, sys, time
import numpy as np
from mpi4py import MPI
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.core.types import CollectiveError, CollectiveTimeoutError

timeout, piddir = float(sys.argv[1]), sys.argv[2]
MPI.COMM_WORLD.Barrier()                # every rank has imported: no start-up skew in a wait
for bad in (0, -1.0, math.nan):
    try:
        MPICommunicator(timeout=bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"timeout={bad!r} accepted")
p2p = MPICommunicator(timeout=timeout, abort_on_timeout=False)
coll = MPICommunicator(timeout=timeout, abort_on_timeout=False)
rank = p2p.rank
with open(os.path.join(piddir, f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
small = np.ones(16, np.float32)
coll.allreduce(small)                   # the first call's one-time exchanges are done
MPI.COMM_WORLD.Barrier()


def fields(err):
    return {"type": [type(err).__name__, isinstance(err, CollectiveError),
                     isinstance(err, RuntimeError), isinstance(err, CollectiveTimeoutError)],
            "kind": err.kind, "peer": err.peer, "elapsed": err.elapsed,
            "timeout": err.timeout, "message": str(err)}


if rank == 0:
    for call in (lambda: p2p.sendrecv(np.arange(4.0), 1, np.empty(4), 1),
                 lambda: coll.allreduce(small)):
        try:
            call()
        except CollectiveTimeoutError as err:
            print(json.dumps(fields(err)), flush=True)
        else:
            print(json.dumps({"error": "no timeout"}), flush=True)
else:
    # Joins each call only after rank 0 gave up on it, which completes rank 0's requests
    # that its timeouts left posted, so the job ends cleanly.
    time.sleep(timeout + 1.5)
    p2p.sendrecv(np.arange(4.0), 0, np.empty(4), 0)
    time.sleep(timeout + 1.5)
    coll.allreduce(small)
MPI.COMM_WORLD.Barrier()
"""


def _alive(pid: int, script: Path) -> bool:
    """Whether ``pid`` is a live (not zombie) process running ``script``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and str(script).encode() in cmdline


def _rank_pids(piddir: Path) -> list[int]:
    pids = []
    for f in piddir.glob("rank*.pid"):
        try:
            pids.append(int(f.read_text()))
        except ValueError:  # written while read
            continue
    return pids


def _run_job(launcher: list[str], env: dict[str, str], tmp_path: Path, source: str,
             *args: str, limit: float) -> tuple[subprocess.CompletedProcess[str], float,
                                                 list[int]]:
    """Run ``source`` under ``launcher -n 2``; return the result, its wall time, and the pids
    of the ranks still alive right after it ended. Kills every process of the job on the
    way out, whatever happened (a SIGSTOPped rank ignores everything but SIGKILL)."""
    script, piddir = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(source)
    piddir.mkdir()
    start = time.monotonic()
    proc = subprocess.Popen([*launcher, "-n", "2", sys.executable, str(script), *args,
                             str(piddir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"the job still ran after {limit:.0f} s:\n{out}\n{err}")
        elapsed = time.monotonic() - start
        # The launcher has exited; give the kernel a moment to reap its ranks.
        deadline = time.monotonic() + 2.0
        while (alive := [p for p in _rank_pids(piddir) if _alive(p, script)]) and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), elapsed, alive
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _rank_pids(piddir):
            if _alive(pid, script):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["close", "exit", "stop"])
def test_lost_peer_ends_the_job(mpiexec, subprocess_env, tmp_path, how):
    env = dict(subprocess_env, RINGCOMM_TIMEOUT=str(TIMEOUT_S))
    # A rank that exits before MPI_Finalize makes Hydra kill the others at once (its
    # "auto-cleanup", test_exit_under_auto_cleanup): switched off, the timeout has to act.
    launcher = [mpiexec, "-disable-auto-cleanup"] if how == "exit" else [mpiexec]
    proc, elapsed, alive = _run_job(launcher, env, tmp_path, DEATH, how,
                                    limit=TIMEOUT_S + GRACE_S + 30)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode != 0, report
    assert not alive, f"ranks {alive} outlived the job\n{report}"
    assert elapsed < TIMEOUT_S + GRACE_S, f"the job took {elapsed:.1f} s to end\n{report}"
    assert "unreachable" not in proc.stdout
    assert "allreduce timed out on rank 0 of 2" in proc.stderr, report
    assert "waiting for the other ranks" in proc.stderr, report  # a collective: no one peer
    assert f"The timeout is {TIMEOUT_S:g} s" in proc.stderr, report
    assert "RINGCOMM_TIMEOUT" in proc.stderr, report


# argv: the backend, the pid directory. Rank 1 comes to init long after the timeout.
LATE = r"""
import os, sys, time
from mpi4py import MPI
backend, piddir = sys.argv[1], sys.argv[2]
rank = MPI.COMM_WORLD.Get_rank()
with open(os.path.join(piddir, f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    time.sleep(60)
import ringcomm
ringcomm.init(backend)                  # the timeout comes from RINGCOMM_TIMEOUT
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("backend", ["auto", "mpi"])
def test_a_rank_late_to_init_ends_the_job_at_the_timeout(mpiexec, subprocess_env, tmp_path,
                                                         backend):
    """init's own exchanges wait the timeout too: "auto" asked every rank whether it could run
    NCCL with the default timeout (30 minutes), whatever the one given."""
    env = dict(subprocess_env, RINGCOMM_TIMEOUT=str(TIMEOUT_S))
    proc, elapsed, alive = _run_job([mpiexec], env, tmp_path, LATE, backend,
                                    limit=TIMEOUT_S + GRACE_S + 30)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode != 0, report
    assert not alive, f"ranks {alive} outlived the job\n{report}"
    assert elapsed < TIMEOUT_S + GRACE_S, f"the job took {elapsed:.1f} s to end\n{report}"
    assert "timed out on rank 0 of 2" in proc.stderr, report
    assert f"The timeout is {TIMEOUT_S:g} s" in proc.stderr, report


def test_exit_under_auto_cleanup(mpiexec, subprocess_env, tmp_path):
    """With Hydra's default auto-cleanup the survivors are killed as soon as a rank exits
    before MPI_Finalize. Hydra reports the killed ranks' status as 0 (pmodels/mpich#5930), so
    the job's status is the exited rank's own, here 0: the launcher's choice, not checked."""
    env = dict(subprocess_env, RINGCOMM_TIMEOUT=str(TIMEOUT_S))
    proc, elapsed, alive = _run_job([mpiexec], env, tmp_path, DEATH, "exit",
                                    limit=TIMEOUT_S + GRACE_S + 30)
    assert not alive
    assert elapsed < TIMEOUT_S + GRACE_S
    assert "unreachable" not in proc.stdout


def test_timeout_raises_without_abort(mpiexec, subprocess_env, tmp_path):
    timeout = 1.0
    proc, _, alive = _run_job([mpiexec], subprocess_env, tmp_path, NO_ABORT, str(timeout),
                              limit=60)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert not alive
    p2p, coll = (json.loads(line) for line in proc.stdout.splitlines()
                 if line.startswith("{"))
    for err in (p2p, coll):
        assert err["type"] == ["CollectiveTimeoutError", True, True, True], report
        assert err["timeout"] == timeout
        assert timeout <= err["elapsed"] < timeout + 1.0, err
        assert "ringcomm.init(timeout=...)" in err["message"]
    assert (p2p["kind"], p2p["peer"]) == ("sendrecv", 1)
    assert "sendrecv timed out on rank 0 of 2" in p2p["message"]
    assert "waiting for rank 1" in p2p["message"]
    assert (coll["kind"], coll["peer"]) == ("allreduce", None)
    assert "allreduce timed out on rank 0 of 2" in coll["message"]


def test_thread_timeout_fields():
    """The threads backend raises the same error type, with the same fields."""
    timeout = 0.3

    def collective(t):
        comm = Communicator(t)  # collective: every rank agrees on the settings
        if t.rank == 1:
            comm.allreduce(np.ones(3, np.float32))

    def receive(t):
        if t.rank == 1:
            t.operation = "allreduce"
            t.isendrecv(None, 0, np.empty(1), 0).wait()

    for body, peer, text in ((collective, 0, "timed out after 0.3 s waiting for ranks [0]"),
                             (receive, 0, "receive from rank 0 on the ring channel")):
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            run_ranks(2, body, timeout=timeout)
        err = info.value
        assert isinstance(err, CollectiveError) and isinstance(err, RuntimeError)
        assert (err.kind, err.peer, err.timeout) == ("allreduce", peer, timeout)
        assert timeout * 0.9 <= err.elapsed < timeout + 1.0
        assert math.isfinite(err.elapsed) and time.monotonic() - start < 5
        assert "rank 1: allreduce: " in str(err) and text in str(err)


TWO_LEVEL = r"""
import json, os, numpy as np
from mpi4py import MPI
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.core.types import CollectiveTimeoutError

# Every rank has imported before any wait starts: on a loaded machine one rank's imports
# took longer than the timeout, and the first call timed out.
MPI.COMM_WORLD.Barrier()
# Without the consistency check the call starts in the two-level phases, no agreement first.
comm = MPICommunicator(timeout=2.0, abort_on_timeout=False, consistency_check=False)
comm.topology = 2                                  # nodes of 2 ranks: 2 x 2
x = np.ones(300_000, np.float32)
comm.allreduce(x, algorithm="hierarchical")        # the node-local and cross-node groups exist
MPI.COMM_WORLD.Barrier()
if comm.rank != 3:                                 # rank 3 never joins the next call
    try:
        comm.allreduce(x, algorithm="hierarchical")
        out = {"error": "no timeout"}
    except CollectiveTimeoutError as err:
        out = {"kind": err.kind, "peer": err.peer, "message": str(err)}
    os.write(1, (json.dumps({"rank": comm.rank, **out}) + "\n").encode())
MPI.COMM_WORLD.Barrier()
os._exit(0)     # the timed-out requests stay posted: skip MPI_Finalize
"""


def test_two_level_timeout_names_the_job_s_ranks(mpiexec, subprocess_env, tmp_path):
    """A peer missing from a two-level allreduce (2 nodes x 2 ranks): each waiting rank's
    error names the allreduce, its own and the peer's ranks as the job numbers them, and
    its group (they used to name the sub-group's ranks and "ring exchange")."""
    script = tmp_path / "two_level.py"
    script.write_text(TWO_LEVEL)
    # Every rank ends with os._exit, without MPI_Finalize; Hydra takes the first such end as
    # a failure and kills the ranks still on their way out (status 9, a race a loaded machine
    # loses): with auto clean-up off it waits for each rank's own exit status instead.
    proc = run_bounded([mpiexec, "-disable-auto-cleanup", "-n", "4", sys.executable,
                        str(script)], timeout=120, env=subprocess_env)
    # One JSON line per waiting rank. Anything else on stdout (a blank line mpiexec's
    # forwarding passed on a loaded machine, its banner when a rank failed) is not a row:
    # the assertions below show it.
    report = f"status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = {r["rank"]: r for r in map(json.loads, lines) if "rank" in r}
    assert sorted(rows) == [0, 1, 2], report
    assert proc.returncode == 0, report
    for rank, row in rows.items():
        assert row.get("kind") == "allreduce", row
        assert row["message"].startswith(f"allreduce timed out on rank {rank} of 4 in its "
                                          "group of ranks "), row
        assert row["peer"] in (None, 0, 1, 2, 3)
        if row["peer"] is not None:
            assert f"waiting for rank {row['peer']}" in row["message"], row
    # Rank 2 shares its node with rank 3, whom it waits for in the node-local step.
    assert rows[2]["message"].startswith("allreduce timed out on rank 2 of 4 in its group of "
                                         "ranks 2, 3 "), rows[2]
    assert rows[2]["peer"] in (None, 3), rows[2]


DIST_GROUP = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
import ringcomm.torch  # noqa: F401  (registers the "ringcomm" backend)

dist.init_process_group("ringcomm", timeout=datetime.timedelta(seconds=3))
t = torch.ones(300_000)
dist.all_reduce(t)                                  # the communicator is made
if dist.get_rank() == 0:
    dist.all_reduce(t)                              # rank 1 never comes
else:
    time.sleep(60)
"""


def test_a_ringcomm_groups_timeout_error_names_the_groups_timeout(mpiexec, subprocess_env,
                                                                  tmp_path):
    """The "ringcomm" torch.distributed backend waits its group's timeout: its timeout error
    says to change that one (it named ringcomm.init's and RINGCOMM_TIMEOUT, which it does
    not read)."""
    pytest.importorskip("torch")
    script = tmp_path / "group.py"
    script.write_text(DIST_GROUP)
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, str(script)], timeout=100,
                       env=subprocess_env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert ("allreduce timed out on rank 0 of 2 after 3." in proc.stderr
            and "The timeout is 3 s: change it with the group's timeout, "
            "dist.init_process_group(timeout=...) or dist.new_group(timeout=...)"
            in proc.stderr), proc.stderr[-3000:]
