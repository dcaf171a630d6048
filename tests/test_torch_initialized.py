"""ringcomm.init() where torch.distributed is already up, and under Lightning's launcher.

What frameworks do before user code runs: a default process group initialized with explicit
ranks (no RANK/WORLD_SIZE variables at all, as torch.multiprocessing.spawn scripts do), or
under mpiexec with torch.distributed's ranks numbered otherwise than MPI's. ``init()`` must
span that group (it used to return a one-process communicator on each rank), and a process of
Lightning's launcher (WORLD_SIZE, LOCAL_RANK, no RANK) must get a clear error before
torch.distributed is up, never size 1.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from exit_checks import run_bounded
from ports import free_port

pytest.importorskip("torch")

# Each rank: a gloo group from explicit arguments, then ringcomm.init() with backend "auto".
SPAWNED = r"""
import os, sys, numpy as np, torch.distributed as dist, ringcomm
rank, port = int(sys.argv[1]), sys.argv[2]
assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
comm = ringcomm.init()
info = ringcomm.launch_info()
y = comm.allreduce(np.full(300_000, rank + 1.0, np.float32))     # the ring
z = comm.allreduce(np.full(3, rank + 1.0))                       # the agreement's slot
print(f"<{rank}|{comm.backend} {comm.rank} {comm.size} {info.launcher} {y[0]} {y[-1]} {z[0]}>",
      flush=True)
comm.close()

# A state over a one-process communicator (made as if before the group was up): the hook
# refuses it at the first bucket instead of letting each rank train its own model. (On gloo
# only: once the processes joined one MPI world, MPI's is the whole job's.)
if comm.backend != "gloo":
    print(f"<{rank + 2}|joined>", flush=True)
    raise SystemExit
import torch
from ringcomm.backends.mpi import MPICommunicator
from ringcomm.torch import RingcommState, ringcomm_hook
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
lone = MPICommunicator()
model.register_comm_hook(RingcommState(comm=lone), ringcomm_hook)
try:
    model(torch.ones(3, 4)).sum().backward()
    refused = "no error"
except RuntimeError as err:
    refused = "refused" if "1 process but torch.distributed's group has 2" in str(err) else err
print(f"<{rank + 2}|{refused}>", flush=True)
lone.close()
dist.destroy_process_group()
"""

# Under mpiexec: torch.distributed numbers the ranks in reverse of MPI's.
REVERSED = r"""
import os, numpy as np, torch.distributed as dist, ringcomm
from mpi4py import MPI
world = MPI.COMM_WORLD
rank = world.Get_size() - 1 - world.Get_rank()
port = world.bcast(os.environ.get("PORT"), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world.Get_size())
comm = ringcomm.init(os.environ["BACKEND"], abort_on_exception=False)
y = comm.allgather(np.array([dist.get_rank()]))
root = np.array([float(dist.get_rank())])
comm.broadcast(root, root=0)
os.write(1, f"<{world.Get_rank()}|{comm.backend} {comm.rank} {comm.size} {y.tolist()} "
            f"{root[0]}>\n".encode())
comm.close()
dist.destroy_process_group()
"""



def _lines(text: str) -> dict[int, str]:
    return {int(r): line for r, line in re.findall(r"<(\d)\|(.*?)>", text)}


def _run_pair(script: str, subprocess_env: dict[str, str], transport: str,
              *args: str) -> dict[int, str]:
    """Run ``script`` in two processes without launcher variables (argv: the rank, then
    ``args``), their processes joined over MPI or left on gloo (``transport``), each within
    120 s; the lines they printed, by the number each line names."""
    env = {k: v for k, v in subprocess_env.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["RINGCOMM_TORCHRUN_MPI"] = "1" if transport == "mpi" else "0"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    return _lines("".join(outs))


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_init_spans_an_initialized_group_without_launcher_variables(subprocess_env, transport):
    """The group is the job: its processes join one MPI world over its store (or, told,
    stay on gloo), never a communicator of one."""
    lines = _run_pair(SPAWNED, subprocess_env, transport, str(free_port()))
    hook = "refused" if transport == "gloo" else "joined"
    assert lines == {0: f"{transport} 0 2 torch.distributed 3.0 3.0 3.0",
                     1: f"{transport} 1 2 torch.distributed 3.0 3.0 3.0",
                     2: hook, 3: hook}, lines


# Two runs in one process: the group destroyed after the first and made again, its ranks
# numbered the other way round (as a script making its group per run may). hvd.init() again
# starts over the new group; a communicator made over the old one still works over MPI and,
# over gloo, says that torch.distributed let its group go.
REMADE = r"""
import sys, numpy as np, torch, torch.distributed as dist, ringcomm, ringcomm.torch as hvd
rank, port, port2 = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
hvd.init()
old = ringcomm.init()
print(f"<{rank}|{hvd.rank()} {hvd.size()} {old.rank}>", flush=True)
dist.destroy_process_group()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=1 - rank,
                        world_size=2)
hvd.init()
root = hvd.broadcast(torch.tensor([float(dist.get_rank())]), root_rank=0).item()
total = hvd.allreduce(torch.tensor([dist.get_rank() + 1.0]), op=hvd.Sum).item()
print(f"<{rank + 2}|{dist.get_rank()} {hvd.rank()} {hvd.size()} {root} {total}>", flush=True)
try:
    said = old.broadcast(np.array([float(rank)]), root=0)[0]
except RuntimeError as err:
    said = "let go" if "torch.distributed no longer holds" in str(err) else err
print(f"<{rank + 4}|{said}>", flush=True)
hvd.shutdown()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_hvd_init_starts_again_over_a_group_made_again(subprocess_env, transport):
    """hvd.init() after destroy_process_group() and init_process_group() with the ranks
    renumbered: hvd's ranks are the new group's (they stayed the old group's before, without
    a word: hvd.rank() 0 was torch's rank 1, and a broadcast from root 0 sent its data)."""
    lines = _run_pair(REMADE, subprocess_env, transport, str(free_port()),
                      str(free_port()))
    # Over MPI the old communicator keeps its numbering (root 0 is the first process).
    old = ["0.0", "0.0"] if transport == "mpi" else ["let go", "let go"]
    assert lines == {0: "0 2 0", 1: "1 2 1",
                     2: "1 1 2 0.0 3.0", 3: "0 0 2 0.0 3.0",
                     4: old[0], 5: old[1]}, lines


@pytest.mark.parametrize("backend", ["auto", "mpi"])
def test_init_follows_torch_numbering_under_mpiexec(mpiexec, subprocess_env, backend):
    """MPI's world numbers the processes otherwise than torch.distributed's group: "auto"
    runs over torch.distributed (gloo), "mpi" over MPI's world renumbered as the group, so
    ringcomm's ranks are the group's and a broadcast from root 0 sends torch's rank 0's data
    ("mpi" kept MPI's numbering before: root 0 sent torch's rank 1's data, without a word)."""
    env = {**subprocess_env, "PORT": str(free_port()), "BACKEND": backend}
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", REVERSED],
                       timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    used = "gloo" if backend == "auto" else "mpi"
    assert _lines(proc.stdout) == {0: f"{used} 1 2 [0, 1] 0.0",
                                   1: f"{used} 0 2 [0, 1] 0.0"}, proc.stdout


# Rank 0 alone calls ringcomm.init() (as register_ddp_hook(model) without comm= does on the
# members of a sub-group only); rank 1 goes on elsewhere. (torch's env:// rendezvous takes
# rank and size from MPI: ringcomm's entry point wraps it.)
ONE_RANK_INIT = r"""
import os, time, torch.distributed as dist, ringcomm
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    ringcomm.init(os.environ["BACKEND"])
time.sleep(60)
"""


@pytest.mark.parametrize("backend", ["auto", "mpi"])
def test_init_on_one_rank_only_ends_at_the_timeout(mpiexec, subprocess_env, backend):
    """init() on some ranks only, torch.distributed up under mpiexec: the question whether
    MPI numbers the processes as torch.distributed does waits the timeout, then ends the job
    saying so; it waited in a blocking MPI allreduce for good, whatever the timeout."""
    env = {**subprocess_env, "BACKEND": backend, "RINGCOMM_TIMEOUT": "5"}
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", ONE_RANK_INIT],
                       timeout=50, env=env)
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    # (the time waited, 5.0 s, may read 5.1 s where a loaded machine woke the wait late)
    assert re.search(r"CollectiveTimeoutError: init timed out on rank 0 of 2 after 5\.\d s "
                     r"waiting for the other ranks \(whether MPI numbers the processes as "
                     r"torch\.distributed does\)", proc.stderr), proc.stderr[-3000:]


# Under torchrun, torch.distributed up with a group timeout far above ringcomm's: rank 0
# alone calls ringcomm.init(timeout=5); rank 1 waits in a barrier of torch's meanwhile.
ONE_RANK_INIT_TORCHRUN = r"""
import datetime, os, sys, time, torch.distributed as dist, ringcomm
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
if dist.get_rank() == 0:
    start = time.monotonic()
    try:
        ringcomm.init(os.environ["BACKEND"], timeout=5, abort_on_exception=False)
        print("<0|returned>", flush=True)
    except Exception as err:
        print(f"<0|{type(err).__name__} {time.monotonic() - start:.0f} {err}>", flush=True)
dist.barrier()
"""


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_init_on_one_rank_under_torchrun_ends_at_its_timeout(tmp_path, subprocess_env, backend):
    """The store of a group torch.distributed made waits the group's timeout: the start-up's
    exchanges over it wait ringcomm's own (they waited the group's 90 s, not 5)."""
    job = tmp_path / "one_rank.py"
    job.write_text(ONE_RANK_INIT_TORCHRUN)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = run_bounded([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
                        str(job)], timeout=120, env={**subprocess_env, "BACKEND": backend})
    line = _lines(proc.stdout).get(0, proc.stdout[-2000:] + proc.stderr[-2000:])
    kind, seconds, _ = line.split(" ", 2)
    assert kind == "CollectiveTimeoutError" and int(seconds) < 15, line
    assert backend == "gloo" or "waiting for rank 1" in line, line


LIGHTNING_CHILD = ("import ringcomm\n"
                   "try:\n    c = ringcomm.init()\n    print('size', c.size)\n"
                   "except RuntimeError as err:\n    print(err)\n")


@pytest.mark.parametrize("backend", ["auto", "mpi", "gloo"], ids=lambda b: f"backend-{b}")
def test_lightning_launcher_without_a_group_raises(subprocess_env, backend):
    """A child of Lightning's launcher (WORLD_SIZE, LOCAL_RANK, NODE_RANK; no RANK) before
    torch.distributed is up: a clear error on every backend (it used to be size 1)."""
    env = {**subprocess_env, "WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("RANK", None)
    code = LIGHTNING_CHILD.replace("ringcomm.init()", f"ringcomm.init({backend!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "WORLD_SIZE=2 without RANK (PyTorch Lightning's launcher): this process's global rank "
        "is known only once Lightning has initialized torch.distributed"), proc.stdout
    assert "ringcomm.torch.lightning.RingcommDDPStrategy" in proc.stdout


CONTRADICTED = r"""
import torch.distributed as dist, ringcomm
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
try:
    ringcomm.init()
    print("size 1 returned")
except RuntimeError as err:
    print(err)
"""


def test_a_group_of_one_in_a_launch_of_two_raises(subprocess_env):
    """torch.distributed initialized with one process where the launcher says two: neither
    size is taken silently."""
    env = {**subprocess_env, "PMI_RANK": "0", "PMI_SIZE": "2"}
    code = CONTRADICTED.replace("{port}", str(free_port()))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.stdout.startswith("torch.distributed's default group has 1 process but "
                                  "PMI_SIZE=2 (mpich): initialize torch.distributed over the "
                                  "processes the launcher started"), (proc.stdout, proc.stderr)
