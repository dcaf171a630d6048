"""Jobs started by torchrun: ringcomm.init() spans the job, over MPI (every process joins one
MPI world over ringcomm's PMI server) or over gloo (RINGCOMM_TORCHRUN_MPI=0, or a rank that
cannot join), the hook and hvd work as under mpiexec, and the gloo transport splits into
sub-groups."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from exit_checks import run_bounded

pytest.importorskip("torch")

SCRIPT = r"""
import os
import torch
import torch.distributed as dist
import ringcomm
import ringcomm.torch as hvd
from ringcomm.torch import RingcommState, ringcomm_hook

torch.set_num_threads(1)
hvd.init()                                  # torchrun's environment: MPI, or gloo if told
rank, size = hvd.rank(), hvd.size()
assert dist.is_initialized() and size == dist.get_world_size() == 2, size
on_gloo = os.environ.get("RINGCOMM_TORCHRUN_MPI") == "0"
assert hvd.gloo_enabled() == on_gloo and hvd.mpi_enabled() != on_gloo and hvd.local_size() == 2

t = torch.full((5,), float(rank))
assert torch.equal(hvd.allreduce(t, op=hvd.Sum), torch.full((5,), 1.0))
assert torch.equal(hvd.allgather(t[: rank + 1]), torch.tensor([0.0, 1.0, 1.0]))
assert torch.equal(hvd.broadcast(t, root_rank=1), torch.ones(5))
big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)     # the ring, not the inline path
assert torch.equal(hvd.allreduce(big, op=hvd.Sum), torch.arange(300_000.0) * 3)
try:
    hvd.allreduce(torch.ones(3 + rank))
    raise AssertionError("no error")
except hvd.HorovodInternalError as err:
    assert "shape differs between ranks" in str(err), err

def train(hooked, compression=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = torch.nn.parallel.DistributedDataParallel(net)
    if hooked:
        model.register_comm_hook(RingcommState(compression=compression, start_iter=1,
                                               min_compress_bytes=0), ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

expected, got = train(False), train(True)
torch.testing.assert_close(got, expected)
int8 = train(True, ringcomm.Int8())
assert torch.equal(hvd.broadcast(int8, root_rank=0), int8)   # identical on both ranks

# DDP's features around a hook: Join over uneven inputs (the rank that ran out calls the hook
# on zero buckets for the other's steps), no_sync() accumulation, gradients as views of the
# buckets, a parameter that never gets one; small buckets, so several calls a step.
class Forked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = (torch.nn.Linear(8, 32), torch.nn.Linear(32, 4),
                                       torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

def train_uneven(hooked, compression=None):
    from torch.distributed.algorithms.join import Join
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        Forked(), find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=0.001)
    if hooked:
        model.register_comm_hook(RingcommState(compression=compression, start_iter=1,
                                               min_compress_bytes=0), ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    with Join([model]):
        for _ in range(5 if rank == 0 else 3):
            opt.zero_grad()
            for micro in range(2):
                x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
                with model.no_sync() if micro == 0 else torch.enable_grad():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

expected, got = train_uneven(False), train_uneven(True)
assert torch.equal(got, expected), (got - expected).abs().max()
int8 = train_uneven(True, ringcomm.Int8())
assert torch.equal(hvd.broadcast(int8, root_rank=0), int8)

def train_sparse(hooked):
    # An embedding's sparse gradient, in a bucket of its own: averaged exactly, as DDP's own.
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Embedding(30, 4, sparse=True), torch.nn.Linear(4, 1)))
    if hooked:
        model.register_comm_hook(RingcommState(), ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randint(0, 10, (8,), generator=gen)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

assert torch.equal(train_sparse(True), train_sparse(False))
print(f"rank {rank} ok", flush=True)
hvd.shutdown()
"""


SPLIT_SCRIPT = r"""
import numpy as np
import torch.distributed as dist
from ringcomm.comm.base import Communicator
from ringcomm.core.types import InvalidArgumentError, InvalidTypeError
from ringcomm.backends.gloo import TorchDistTransport

dist.init_process_group("gloo")
rank = dist.get_rank()
world = TorchDistTransport()
assert (world.backend, world.rank, world.size) == ("gloo", rank, 2)

def data(r, n):
    return (np.arange(n, dtype=np.float32) * 0.37 + r) * (1.0 + 0.01 * r)   # inexact sums

def check(sub, members):
    # sub's ranks are the world ranks in members, in that order
    comm = Communicator(sub)
    assert (comm.rank, comm.size) == (members.index(rank), len(members)), (comm.rank, members)
    assert (sub.local_rank, sub.local_size) == (comm.rank, comm.size)     # one host
    results = []
    for n in (7, 300_000):                  # inline in the agreement, and the pipelined ring
        got = comm.allreduce(data(rank, n))
        want = data(members[0], n)
        for r in members[1:]:
            want = want + data(r, n)
        assert got.tobytes() == want.tobytes(), n
        results.append(got.tobytes())
    gathered = comm.allgatherv(np.full(1 + members.index(rank), rank, np.int64))
    assert gathered.tolist() == [r for i, r in enumerate(members) for _ in range(i + 1)]
    x = np.full(3, float(rank))
    assert (comm.broadcast(x, root=0) == members[0]).all()
    peer = (comm.rank + 1) % comm.size      # the user's channel, beside the ring's
    got = comm.sendrecv(np.full(4, rank, np.int32), peer, np.empty(4, np.int32), peer)
    assert (got == members[peer]).all()
    comm.close()
    return results

# Two 1-rank groups, then one group in reversed order: every rank of a group bit-identical.
check(world.split(rank, 0), [rank])
both = check(world.split(5, -rank), [1, 0])
on_rank = world.allgather_object(both)
assert on_rank[0] == on_rank[1]

# An invalid argument on one rank raises on both, and the transport stays usable.
for color, key, error in ((-1, 0, InvalidArgumentError), (0, "k", InvalidTypeError)):
    try:
        world.split(color if rank == 1 else 0, key if rank == 1 else 0)
        raise AssertionError("no error")
    except error as err:
        assert err.kind == "split" and err.ranks == (1,), err
check(world.split(0, rank), [0, 1])
for _ in range(4):                          # the same members again and again, each closed
    check(world.split(0, rank), [0, 1])
    check(world.split(1, -rank), [1, 0])

# After a group that torch counts on rank 0 only (so that torch would name a group the
# ranks make alone differently on each): the same splits, and a transport over torch's group.
dist.new_group(ranks=[0], backend="gloo")
check(world.split(0, rank), [0, 1])
check(world.split(1, -rank), [1, 0])
again = TorchDistTransport()
check(again.split(0, rank), [0, 1])
again.close()
world.barrier()
world.close()
print(f"rank {rank} ok", flush=True)
dist.destroy_process_group()
"""


INIT_SCRIPT = r"""
import os
import numpy as np
import torch.distributed as dist
import ringcomm

transport = "gloo" if os.environ.get("RINGCOMM_TORCHRUN_MPI") == "0" else "mpi"
comm = ringcomm.init()                      # torchrun's environment: over the whole job
rank = comm.rank
assert (comm.backend, comm.size) == (transport, 2), (comm.backend, comm.size)
assert dist.is_initialized() and dist.get_world_size() == 2 and dist.get_rank() == rank
for n in (5, 300_000):                      # inline in the agreement, and the pipelined ring
    got = comm.allreduce(np.arange(n, dtype=np.float64) + 10.0 * rank)
    assert got.tobytes() == (2 * np.arange(n, dtype=np.float64) + 10.0).tobytes(), n
if transport == "gloo":
    try:
        ringcomm.init("mpi", abort_on_exception=False)
        raise AssertionError("no error")
    except RuntimeError as err:
        assert str(err) == (
            "WORLD_SIZE=2 (torchrun) but MPI cannot start over its processes (ranks 0, 1: "
            "RINGCOMM_TORCHRUN_MPI is off): launch with mpiexec -n 2, or use backend='auto' or "
            "'gloo' under torchrun"), err
else:
    from mpi4py import MPI
    world = MPI.COMM_WORLD                  # one world, numbered as torch numbers the ranks
    assert (world.Get_rank(), world.Get_size()) == (rank, 2)
    assert world.Split_type(MPI.COMM_TYPE_SHARED).Get_size() == 2   # one node: shared memory
    assert not any(k in os.environ for k in ("PMI_PORT", "PMI_ID")), "start-up variables left"
    mpi = ringcomm.init("mpi", abort_on_exception=False)
    assert (mpi.backend, mpi.rank, mpi.size) == ("mpi", rank, 2)
    assert mpi.allreduce(np.full(3, rank + 1.0)).tolist() == [3.0] * 3
    mpi.close()
again = ringcomm.init("gloo", abort_on_exception=False)   # the group is there: reused
assert again.size == 2 and again.allreduce(np.ones(3))[0] == 2.0
again.close()
comm.close()
print(f"rank {rank} ok", flush=True)
dist.destroy_process_group()
"""


def _torchrun(tmp_path: Path, env: dict[str, str], script: str,
              module: bool = False, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (with ``args``) in 2 processes under torchrun (``python -m
    torch.distributed.run`` when ``module``); both must end well and print "ok"."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if module:
        launcher = [sys.executable, "-m", "torch.distributed.run"]
    elif torchrun.exists():
        launcher = [str(torchrun)]
    else:
        pytest.skip("no torchrun next to the interpreter")
    path = tmp_path / "job.py"
    path.write_text(script)
    proc = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", str(path), *args],
                          capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
    return proc


def _torchrun_failing(tmp_path: Path, env: dict[str, str], script: str,
                      args: tuple[str, ...] = ()
                      ) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``script`` (with ``args``) in 2 processes under torchrun, which may fail; the run
    and its time."""
    path = tmp_path / "job.py"
    path.write_text(script)
    start = time.monotonic()
    proc = run_bounded([str(_torchrun_path()), "--standalone", "--nproc-per-node", "2", str(path),
                        *args], timeout=110, env=env)
    return proc, time.monotonic() - start


_TRANSPORTS = pytest.mark.parametrize("transport", ["mpi", "gloo"])


def _on(transport: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` keeping torchrun's processes on gloo for transport "gloo"."""
    return {**env, "RINGCOMM_TORCHRUN_MPI": "0" if transport == "gloo" else "1"}


@pytest.mark.slow
# ``python -m torch.distributed.run`` once: how torchrun was started does not choose the
# transport.
@pytest.mark.parametrize(("module", "transport"), [(False, "mpi"), (False, "gloo"), (True, "mpi")],
                         ids=["torchrun-mpi", "torchrun-gloo", "python-m-mpi"])
def test_init_spans_the_torchrun_job(tmp_path, subprocess_env, module, transport):
    """ringcomm.init() under torchrun: a size-2 communicator whose allreduce sums both ranks,
    over one MPI world of torchrun's processes (shared memory between them; backend="mpi"
    too), or over gloo when told (backend="mpi" then raises on both ranks, saying why);
    RINGCOMM_LOG_LEVEL=INFO says what was chosen."""
    env = {**_on(transport, subprocess_env), "RINGCOMM_LOG_LEVEL": "INFO"}
    proc = _torchrun(tmp_path, env, INIT_SCRIPT, module=module)
    lines = sorted(line for line in proc.stderr.splitlines()
                   if f"INFO ringcomm.init: backend {transport} (auto:" in line)
    assert len(lines) == 2, proc.stderr[-3000:]
    for rank, line in enumerate(lines):
        assert line.startswith(f"[ringcomm rank {rank}/2]"), line
        assert "launcher torchrun (WORLD_SIZE=2); rank" in line, line


def test_torchrun_under_an_mpi_launcher(tmp_path, subprocess_env, mpiexec):
    """torchrun started by mpiexec (one agent): its workers inherit the launcher's PMI
    variables, which describe the agent; ringcomm no longer takes them for its own launch
    (MPI_Init on them ended every worker: "PMIU_write error ... Bad file descriptor") and
    joins the workers into one MPI world as under torchrun alone."""
    proc = _torchrun_under_mpiexec(tmp_path, _on("mpi", subprocess_env), mpiexec,
                                   INIT_SCRIPT, workers=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


def _torchrun_path() -> Path:
    """The torchrun next to the interpreter (the test skipped without it)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("no torchrun next to the interpreter")
    return torchrun


def _torchrun_under_mpiexec(tmp_path: Path, env: dict[str, str], mpiexec: str, script: str,
                            workers: int) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under one torchrun agent of ``workers`` that mpiexec -n 1 starts."""
    path = tmp_path / "job.py"
    path.write_text(script)
    return run_bounded([mpiexec, "-n", "1", str(_torchrun_path()), "--standalone",
                        "--nproc-per-node", str(workers), str(path)], timeout=110, env=env)


PIPES_FIRST = r"""
import multiprocessing
pipes = [multiprocessing.Pipe() for _ in range(4)]  # Unix socket pairs, numbered as PMI_FD may be
""" + INIT_SCRIPT


def test_torchrun_under_an_mpi_launcher_with_sockets_of_its_own(tmp_path, subprocess_env,
                                                                  mpiexec):
    """As above, the workers making Unix socket pairs (multiprocessing.Pipe) before init: one
    may take the number of the PMI_FD they inherited, whose other end is then the worker, not
    mpiexec's proxy, and they are no processes of mpiexec's (taken for them, MPI's start
    waited for ever on the socket)."""
    proc = _torchrun_under_mpiexec(tmp_path, _on("mpi", subprocess_env), mpiexec,
                                   PIPES_FIRST, workers=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


def test_torchrun_workers_with_srun_variables_join_one_mpi_world(tmp_path, subprocess_env):
    """torchrun run by srun (one task): its workers inherit srun's variables, which describe
    the agent; they join one MPI world over ringcomm's PMI server, whose PMI_PORT and PMI_ID
    MPI's start must see."""
    env = {**_on("mpi", subprocess_env), "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"}
    _torchrun(tmp_path, env, INIT_SCRIPT)


SUM_SCRIPT = r"""
import numpy as np, ringcomm
comm = ringcomm.init(abort_on_exception=False)
total = int(comm.allreduce(np.array([comm.rank], np.int64))[0])
print(f"backend {comm.backend} rank {comm.rank} of {comm.size} sum {total}", flush=True)
"""


def test_one_torchrun_worker_under_an_mpi_launcher(tmp_path, subprocess_env, mpiexec):
    """mpiexec -n 1 torchrun with one worker: a job of one process whose MPI starts as a world
    of its own, the launcher's variables it inherited from the agent hidden from MPI's start
    (on them, MPICH's start ended the worker with "PMIU_write error ... Bad file
    descriptor")."""
    proc = _torchrun_under_mpiexec(tmp_path, subprocess_env, mpiexec, SUM_SCRIPT, workers=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backend mpi rank 0 of 1 sum 0" in proc.stdout, proc.stdout[-3000:]


def test_an_mpiexec_that_a_torchrun_worker_runs_is_no_job_of_one(tmp_path, subprocess_env,
                                                                   mpiexec):
    """torchrun --no-python mpiexec -n 2: the two processes mpiexec starts inherit torchrun's
    RANK=0 and WORLD_SIZE=1 (and TORCHELASTIC_RUN_ID) with mpiexec's variables; each ran alone
    as rank 0 of 1, every allreduce its own input, exit status 0. They hold mpiexec's
    connection, so mpiexec started them: both raise, saying what the variables are."""
    path = tmp_path / "job.py"
    path.write_text(SUM_SCRIPT)
    proc = run_bounded([str(_torchrun_path()), "--standalone", "--nproc-per-node", "1",
                        "--no-python",
                        mpiexec, "-n", "2", sys.executable, str(path)], timeout=110,
                       env=subprocess_env)
    assert proc.returncode != 0 and "of 1 sum" not in proc.stdout, proc.stdout[-3000:]
    output = proc.stdout + proc.stderr
    assert output.count("RANK=0 and WORLD_SIZE=1 (torchrun's variables) describe a job of 1 "
                        "process, but an MPI launcher started 2 processes") >= 2, output[-3000:]


@pytest.mark.slow
@_TRANSPORTS
def test_hook_and_hvd_under_torchrun(tmp_path, subprocess_env, transport):
    """hvd's collectives and ringcomm's hook under torchrun: the hook's parameters are DDP
    default's, also with Join over uneven inputs, no_sync(), gradient_as_bucket_view and an
    unused parameter; Int8's are the same on both ranks."""
    _torchrun(tmp_path, _on(transport, subprocess_env), SCRIPT)


@pytest.mark.slow
def test_transport_split_under_torchrun(tmp_path, subprocess_env):
    """Sub-groups in any rank order, also after a torch.distributed group of some ranks only."""
    _torchrun(tmp_path, subprocess_env, SPLIT_SCRIPT)


TIMEOUT_SCRIPT = r"""
import json, sys, time
import numpy as np
import ringcomm
from ringcomm.core.types import CollectiveTimeoutError
from ringcomm.backends.gloo import TorchDistCommunicator

comm = ringcomm.init()                      # gloo; RINGCOMM_TIMEOUT from the environment
raising = TorchDistCommunicator(timeout=2.0, abort_on_timeout=False)
big = np.ones(300_000, np.float32)          # past the inline slot: the ring runs
assert raising.allreduce(big)[0] == 2 and comm.allreduce(big)[0] == 2
if comm.rank == 1:
    time.sleep(300)                         # stuck: never joins the next collective
    sys.exit(0)
start = time.monotonic()
try:
    raising.allreduce(big)
    raise AssertionError("no timeout")
except CollectiveTimeoutError as err:
    print(json.dumps({"kind": err.kind, "peer": err.peer, "timeout": err.timeout,
                      "elapsed": err.elapsed, "wall": time.monotonic() - start,
                      "message": str(err)}), flush=True)
comm.allreduce(big)                         # aborts this process: exit status 1
print("unreachable", flush=True)
"""


@pytest.mark.slow
def test_timeout_under_torchrun(tmp_path, subprocess_env):
    """A rank stuck outside the collective: with abort_on_timeout=False the wait raises
    CollectiveTimeoutError naming the collective and the step after the timeout; by default
    the process ends (status 1, the reason on stderr), and torchrun ends the job."""
    env = {**_on("gloo", subprocess_env), "RINGCOMM_TIMEOUT": "3"}
    proc, wall = _torchrun_failing(tmp_path, env, TIMEOUT_SCRIPT)
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "unreachable" not in proc.stdout
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    # The call's first exchange is the agreement's allgather: no one peer to name.
    assert (report["kind"], report["peer"], report["timeout"]) == ("allreduce", None, 2.0)
    assert 2.0 <= report["elapsed"] <= report["wall"] < 2.0 + 10, report
    # (the message gives the time waited, 2.1 s where a loaded machine woke it late)
    assert re.search(r"allreduce timed out on rank 0 of 2 after 2\.\d s waiting for the other "
                     r"ranks \(allgather\)", report["message"]), report
    assert ("ringcomm: CollectiveTimeoutError: allreduce timed out on rank 0 of 2 after "
            in proc.stderr), proc.stderr[-3000:]
    assert "Ending this process (exit status 1)" in proc.stderr
    assert wall < 2.0 + 3.0 + 40, wall     # start-up, both timeouts, torchrun's clean-up


NO_MPI_SCRIPT = r"""
import numpy as np
import torch
import ringcomm
import ringcomm.torch as hvd
from ringcomm.torch import RingcommState, ringcomm_hook

comm = ringcomm.init()                      # auto: gloo, without loading MPI
assert (comm.backend, comm.size) == ("gloo", 2), (comm.backend, comm.size)
assert comm.allreduce(np.ones(300_000, np.float32))[0] == 2
comm.close()
hvd.init()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
model.register_comm_hook(RingcommState(), ringcomm_hook)
model(torch.ones(3, 4)).sum().backward()
print(f"rank {hvd.rank()} ok", flush=True)
hvd.shutdown()
"""


@pytest.mark.slow
def test_torchrun_never_loads_an_mpi_that_ends_its_process(tmp_path, subprocess_env):
    """Under torchrun and no MPI launcher, an mpi4py whose MPI ends the process that loads it
    without its launcher (Open MPI's singletons need a daemon) is never loaded in the job's
    processes, by ringcomm.init(), ringcomm.torch.init() or the hook: it is asked which MPI it
    is in a process of its own, which it ends, and the job keeps gloo, saying why."""
    fake = tmp_path / "fake" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class rc:\n    initialize = finalize = True\n")
    (fake / "MPI.py").write_text("import os, sys\n"
                                 "sys.stderr.write('MPI started without its launcher\\n')\n"
                                 "os._exit(17)\n")
    env = {**subprocess_env, "RINGCOMM_LOG_LEVEL": "INFO", "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "fake"), subprocess_env.get("PYTHONPATH", "")])}
    proc = _torchrun(tmp_path, env, NO_MPI_SCRIPT)
    chosen = [line for line in proc.stderr.splitlines() if "backend gloo (auto:" in line]
    assert len(chosen) == 4, proc.stderr[-3000:]   # ringcomm.init and hvd.init, each rank
    assert ("MPI cannot join them: ranks 0, 1: mpi4py's MPI did not load (MPI started "
            "without its launcher)") in chosen[0], chosen[0]


UNEVEN_SCRIPT = r"""
import os, sys
import numpy as np
rank, case = int(os.environ["RANK"]), sys.argv[1]
if case == "imported" and rank == 1:
    from mpi4py import MPI                  # MPI started in rank 1 alone, before ringcomm
if rank == 1:
    os.environ["RINGCOMM_TORCHRUN_MPI"] = {"flag": "0", "spelled": "true", "bad": "maybe",
                                          "imported": "1"}[case]
import ringcomm
from ringcomm.core.types import ArgumentMismatchError, InvalidArgumentError

try:
    comm = ringcomm.init(abort_on_exception=False)
except ArgumentMismatchError as err:
    assert case == "flag", err
    assert str(err) == ("RINGCOMM_TORCHRUN_MPI differs between ranks: rank 0 '1', rank 1 "
                        "'0'"), err
except InvalidArgumentError as err:
    assert case == "bad", err
    assert str(err) == ("RINGCOMM_TORCHRUN_MPI must be 0, 1 (or true/false, yes/no, on/off) "
                        "or auto, got rank 1 'maybe'"), err
else:
    expected = "gloo" if case == "imported" else "mpi"     # "true" is on, as "1" is
    assert case in ("imported", "spelled")
    assert (comm.backend, comm.size) == (expected, 2), (comm.backend, comm.size)
    assert comm.allreduce(np.arange(4.0) + rank).tolist() == [1.0, 3.0, 5.0, 7.0]
    comm.close()
print(f"rank {rank} ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["imported", "flag", "spelled", "bad"])
def test_ranks_that_differ_take_one_path(tmp_path, subprocess_env, case):
    """Where one rank cannot join MPI's world (it started MPI alone before) every rank stays on
    gloo, told which rank and why; where RINGCOMM_TORCHRUN_MPI differs, or is no yes/no on a
    rank, every rank raises the same error naming each rank's value ("true" against "1" is no
    difference). Never a hang, nor a world of one."""
    env = {**subprocess_env, "RINGCOMM_TORCHRUN_MPI": "1", "RINGCOMM_LOG_LEVEL": "INFO"}
    proc = _torchrun(tmp_path, env, UNEVEN_SCRIPT, args=(case,))
    if case == "imported":
        chosen = [line for line in proc.stderr.splitlines() if "backend gloo (auto:" in line]
        assert len(chosen) == 2, proc.stderr[-3000:]
        assert all("MPI cannot join them: rank 1: mpi4py.MPI was imported before" in line
                   for line in chosen), chosen


APART_SCRIPT = r"""
import os, time
import numpy as np
import ringcomm

comm = ringcomm.init()                      # MPI, joined over ringcomm's PMI server
assert (comm.backend, comm.size) == ("mpi", 2), comm.backend
assert comm.allreduce(np.full(300_000, comm.rank + 1.0))[0] == 3.0
comm.close()
if comm.rank == 1:
    time.sleep(14)                          # still at work long after rank 0 is done
print(f"rank {comm.rank} ok", flush=True)
"""


@pytest.mark.slow
def test_ranks_that_end_apart_end_well(tmp_path, subprocess_env):
    """MPI_Finalize waits for the slowest rank however long its work takes, as under mpiexec:
    rank 1 ends 14 s after rank 0, past the timeout (10 s, which bounds MPI's start only: on
    a loaded machine one worker's imports may finish seconds after the other's)."""
    env = {**_on("mpi", subprocess_env), "RINGCOMM_TIMEOUT": "10"}
    proc = _torchrun(tmp_path, env, APART_SCRIPT)
    assert "PMI" not in proc.stderr, proc.stderr[-3000:]


ABORT_SCRIPT = r"""
import time
import numpy as np
import ringcomm

comm = ringcomm.init(abort_on_exception=False)
assert comm.backend == "mpi", comm.backend
if comm.rank == 1:
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(3)                 # MPICH returns here: the launcher ends the job
    time.sleep(1)
    print("rank 1 went on after MPI_Abort", flush=True)
comm.allreduce(np.ones(300_000))            # rank 0 waits for rank 1, which never comes
print("rank 0 went on", flush=True)
"""


@pytest.mark.slow
def test_an_abort_ends_every_rank_as_mpiexec_would(tmp_path, subprocess_env):
    """MPI_Abort(3) on rank 1 ends both processes at once, with status 3, as mpiexec ends a
    job (MPICH's MPI_Abort returns, leaving that to its launcher): rank 1 goes no further,
    and rank 0 does not wait in its collective for the timeout (300 s here)."""
    env = {**_on("mpi", subprocess_env), "RINGCOMM_TIMEOUT": "300"}
    proc, wall = _torchrun_failing(tmp_path, env, ABORT_SCRIPT)
    assert proc.returncode != 0 and wall < 60
    assert "went on" not in proc.stdout, proc.stdout
    # Rank 1 ends on the server's word; rank 0 on it too, or on torchrun's SIGTERM if that
    # came first (a loaded machine), never after the timeout.
    ended = [line for line in proc.stderr.splitlines() if "ending this process" in line]
    assert 1 <= len(ended) <= 2, proc.stderr[-3000:]
    assert all("rank 1 called MPI_Abort with status 3; ending this process (exit status 3)"
               in line for line in ended), ended


GLOO_RAISE_SCRIPT = r"""
import sys
import numpy as np
import ringcomm

comm = ringcomm.init("gloo")
comm.allreduce(np.ones(8))
print(f"rank {comm.rank}: mpi4py.MPI loaded: {'mpi4py.MPI' in sys.modules}", flush=True)
if comm.rank == 1:
    raise RuntimeError("rank 1 fails")
comm.barrier()
"""


@pytest.mark.slow
def test_an_uncaught_exception_on_gloo_starts_no_mpi(tmp_path, subprocess_env):
    """The abort hook ends an MPI job on an uncaught exception; on a gloo communicator it
    leaves MPI alone (it imported mpi4py.MPI, which started MPI as a world of one process
    and aborted it, leaving MPICH's shared memory behind; an MPI that needs its launcher
    would have ended the process)."""
    proc, wall = _torchrun_failing(tmp_path, _on("gloo", subprocess_env), GLOO_RAISE_SCRIPT)
    assert proc.returncode != 0 and wall < 100
    assert "rank 1: mpi4py.MPI loaded: False" in proc.stdout, proc.stdout
    assert "RuntimeError: rank 1 fails" in proc.stderr, proc.stderr[-3000:]
    assert "MPI_Abort" not in proc.stderr, proc.stderr[-3000:]


AUTO_SCRIPT = r"""
import os
import torch
import ringcomm

comm = ringcomm.init()
gpu = torch.cuda.is_available()
assert comm.backend == ("gloo" if gpu else "mpi"), (comm.backend, gpu)
print(f"rank {comm.rank} ok", flush=True)
"""


@pytest.mark.slow
def test_auto_joins_where_no_gpu_is_seen(tmp_path, subprocess_env):
    """RINGCOMM_TORCHRUN_MPI unset ("auto"): torchrun's processes join one MPI world where
    PyTorch sees no GPU; where it sees one they keep gloo (whose GPU path is the measured one),
    saying so."""
    env = {k: v for k, v in subprocess_env.items() if k != "RINGCOMM_TORCHRUN_MPI"}
    _torchrun(tmp_path, {**env, "RINGCOMM_LOG_LEVEL": "INFO"}, AUTO_SCRIPT)



@pytest.mark.slow
@_TRANSPORTS
def test_a_process_started_by_a_rank_is_not_one_of_the_job(tmp_path, subprocess_env, transport):
    """A rank runs a script of its own, which inherits torchrun's variables and calls
    ringcomm.init(): it fails at once, saying so, and the job goes on. (It joined
    torch.distributed's group as a second process of that rank, then waited in MPI's start-up
    forever, spinning, after the job had ended.)"""
    _torchrun(tmp_path, _on(transport, subprocess_env),
              (Path(__file__).parent / "inherited_child.py").read_text())
    for rank in range(2):
        line = (tmp_path / f"job.py.{rank}").read_text()
        assert line.startswith("0 RuntimeError: WORLD_SIZE=2 (torchrun), inherited from "
                               "process "), line
        assert (f"which already joined the job as rank {rank}: this process, started by it, "
                "is not one of the job's. Remove RANK, WORLD_SIZE and LOCAL_RANK") in line, line


BACKENDS_SCRIPT = r"""
import sys
import time
import torch.distributed as dist
import ringcomm

rank = int(__import__("os").environ["RANK"])
if sys.argv[3] == "up":
    dist.init_process_group("gloo")
start = time.monotonic()
try:
    ringcomm.init(backend=sys.argv[1 + rank], timeout=60)
    outcome = "started"
except ringcomm.ArgumentMismatchError as err:
    outcome = f"ArgumentMismatchError: {err}"
with open(f"{__file__}.{rank}", "w") as f:
    f.write(f"{time.monotonic() - start:.1f} {outcome}")
print(f"rank {rank} ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("backends", "group"), [(("auto", "mpi"), "down"),
                                                 (("gloo", "auto"), "down"),
                                                 (("nccl", "gloo"), "down"),
                                                 (("nccl", "mpi"), "up")])
def test_ranks_asking_for_different_backends_are_told(tmp_path, subprocess_env, backends, group):
    """Ranks of a torchrun job asking ringcomm.init() for different backends raise the same
    ArgumentMismatchError at once, naming the backends, as under mpiexec (each waited in a
    start-up of its own until the timeout, then raised an error of its own). "nccl" with the
    group down is compared over torchrun's agent store before any start-up (it was not: its
    rank waited in NCCL's rendezvous, the other in the group's, until the timeout)."""
    _torchrun(tmp_path, _on("mpi", subprocess_env), BACKENDS_SCRIPT, args=(*backends, group))
    texts = [(tmp_path / f"job.py.{rank}").read_text() for rank in range(2)]
    for text in texts:
        seconds, outcome = text.split(" ", 1)
        assert outcome == (f"ArgumentMismatchError: init: backend differs between ranks: "
                           f"{backends[0]} on rank 0; {backends[1]} on rank 1. Every rank must "
                           "ask for the same backend"), text
        assert float(seconds) < 30, text


ORDERS_SCRIPT = r"""
import sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import ringcomm
from ringcomm.torch import RingcommState, register_ddp_hook

dist.init_process_group("gloo")
r = dist.get_rank()
torch.manual_seed(0)
a, b = DDP(torch.nn.Linear(4, 4)), DDP(torch.nn.Linear(4, 4))
if sys.argv[1] == "hooked":  # the states register_ddp_hook makes share a communicator
    assert register_ddp_hook(a).comm is register_ddp_hook(b).comm
else:  # a communicator each
    register_ddp_hook(a, RingcommState(comm=ringcomm.init()))
    register_ddp_hook(b, RingcommState(comm=ringcomm.init()))
first, second = (a, b) if r == 0 else (b, a)  # a rank-dependent order: a bug of the script
try:
    first(torch.ones(2, 4)).sum().backward()
    second(torch.ones(2, 4)).sum().backward()
except RuntimeError as err:
    assert "the calls that met come from different threads" in str(err), err
    assert "run the hooked models' backward passes one at a time, in the same order" in str(err)
    print(f"rank {r} ok", flush=True)
"""


@_TRANSPORTS
def test_two_hooked_models_in_different_orders_are_told(tmp_path, subprocess_env, transport):
    """Two DDP models whose backward passes run in different orders on the two ranks: hooked
    by register_ddp_hook (one communicator) the mismatch raises at once on both ranks; on a
    communicator each the ranks wait on each other's communicator, and the timeout says why a
    DDP hook's call may wait so (the hook's states, the order, a shared communicator)."""
    env = {**_on(transport, subprocess_env), "RINGCOMM_TIMEOUT": "5"}
    path = tmp_path / "orders"
    path.mkdir()
    _torchrun(path, env, ORDERS_SCRIPT, args=("hooked",))
    proc, seconds = _torchrun_failing(tmp_path, env, ORDERS_SCRIPT, args=("own",))
    assert proc.returncode != 0 and seconds < 60, (seconds, proc.stdout + proc.stderr)
    told = [line for line in proc.stderr.splitlines()
            if "CollectiveTimeoutError" in line and "This call is the DDP hook's of a "
            "RingcommState ('ringcomm-hook-0'): where several DDP models are hooked" in line]
    assert told, proc.stderr[-3000:]


SHARED_SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import ringcomm
from ringcomm.torch import register_ddp_hook

def fds():
    return len(os.listdir("/proc/self/fd"))

def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 64, generator=gen)).pow(2).sum().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

def averaged(steps, **kwargs):
    # The hooked model's parameters: DDP's own uncompressed, identical on both ranks always.
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    state = register_ddp_hook(model, **kwargs)
    got = train(model, steps)
    every = [torch.empty_like(got) for _ in range(2)]
    dist.all_gather(every, got)
    assert torch.equal(every[0], every[1])
    if state.compression is None:
        torch.manual_seed(0)
        want = train(DDP(torch.nn.Linear(64, 64)), steps)
        assert torch.equal(got, want), (got - want).abs().max()
    return state

dist.init_process_group("gloo")
a = averaged(2)
comm, calls, sent = a.comm, a.comm.stats.calls, a.comm.stats.bytes_sent
b, c = averaged(3), averaged(1, compression=ringcomm.Int8(), start_iter=0, min_compress_bytes=0)
assert b.comm is comm and c.comm is comm
# Each state counts its own calls (one bucket a step); the communicator counts them all.
assert (a.stats.calls, b.stats.calls, c.stats.calls) == (2, 3, 1), (a.stats, b.stats, c.stats)
assert comm.stats.calls - calls == 4, comm.stats
assert 2 * b.stats.bytes_sent == 3 * a.stats.bytes_sent > 0  # a's 2 steps, b's 3, alike
assert b.stats.bytes_sent + c.stats.bytes_sent <= comm.stats.bytes_sent - sent
assert c.stats.bytes_sent < b.stats.bytes_sent / 3  # int8 moves a quarter of float32's bytes
# Models hooked one after another open nothing new (a gloo group is 5 file descriptors).
before = fds()
for _ in range(12):
    assert averaged(1).comm is comm
assert fds() <= before + 2, (before, fds())
# A default group destroyed and made again: a communicator over the new one. (Over a store
# of its own: torchrun's keeps the keys of the groups destroyed, whose names torch gives the
# new groups again, and a gloo group made then may wait on the old ones' addresses.)
rank = dist.get_rank()
dist.destroy_process_group()
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=rank, world_size=2)
again = averaged(2)
assert again.comm is not comm and again.stats.calls == 2
print(f"rank {dist.get_rank()} ok", flush=True)
"""


@_TRANSPORTS
def test_states_register_ddp_hook_makes_share_one_communicator(tmp_path, subprocess_env,
                                                              transport):
    """register_ddp_hook's states share one communicator over the default group: each
    state's ``stats`` counts its own calls and bytes, models hooked one after another open no
    file descriptors (over gloo each communicator was a group of 5), and a default group made
    again gets a communicator of its own; every model's parameters are DDP's own."""
    _torchrun(tmp_path, _on(transport, subprocess_env), SHARED_SCRIPT,
              args=(str(tmp_path / "store"),))
