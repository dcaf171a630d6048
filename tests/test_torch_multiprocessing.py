"""The "ringcomm" backend in ranks that multiprocessing starts, as PyTorch's examples,
Lightning's "ddp_fork"/"ddp_notebook" and PyTorch's own distributed tests start them:
``torch.multiprocessing.start_processes(..., start_method=...)`` with a file store.

A process that multiprocessing forks (fork, and forkserver: Python 3.14's default on Linux)
ends with ``os._exit`` when its target returns: no ``atexit`` handler and no MPICH exit
handler run there. The backend's processes, which join one MPI world over ringcomm's PMI
server, must still end as a finished job, not as a rank gone before ``MPI_Finalize`` (whose
server then ends the others with status 1), and a rank that really ends early must still end
the job instead of leaving the others waiting (Lightning's "ddp_fork" on the backend:
tests/test_frameworks.py).

Processes given torchrun's variables by hand (the DDP tutorial's way) have rank 0 host
torch.distributed's store on ``MASTER_PORT``: ``hvd.init()`` must ask all it asks over that
one store.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from exit_checks import run_job
from ports import free_port

pytest.importorskip("torch")

RANKS = 3

SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import ringcomm.torch  # noqa: F401  (registers "ringcomm")
from ringcomm.backends.mpi_process import world_joined


def work(rank, size, out, vanish):
    dist.init_process_group("ringcomm", init_method=f"file://{out}/store", rank=rank,
                            world_size=size)
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    comm = dist.group.WORLD.communicator
    row = {"rank": rank, "sum_ok": bool(torch.equal(t, torch.arange(1000.0) * 6)),
           "transport": comm.backend, "joined": world_joined(), "size": comm.size}
    (out / f"rank{rank}.json").write_text(json.dumps(row))
    if vanish and rank == 1:
        if os.environ.get("VANISH") == "raise":  # multiprocessing prints it, then ends
            raise RuntimeError("rank 1 fails mid-job")
        os._exit(0)  # gone before MPI_Finalize, while the others wait in a collective
    dist.all_reduce(t)
    dist.barrier()


if __name__ == "__main__":
    method, out, vanish = sys.argv[1], sys.argv[2], sys.argv[3] == "vanish"
    from pathlib import Path
    mp.start_processes(work, args=(int(sys.argv[4]), Path(out), vanish),
                       nprocs=int(sys.argv[4]), start_method=method)
    print("all ranks ended well")
"""


def _job(tmp_path: Path, env: dict[str, str], method: str, mode: str, timeout: float = 150):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return run_job([sys.executable, str(script), method, str(tmp_path), mode, str(RANKS)],
                   timeout=timeout, env=env, cwd=tmp_path)


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_ranks_multiprocessing_started_end_as_a_finished_job(tmp_path, subprocess_env, method):
    proc = _job(tmp_path, subprocess_env, method, "finish")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "all ranks ended well" in proc.stdout
    assert "ends the job" not in output and "Traceback" not in output, output[-6000:]
    for row in _rows(tmp_path):
        assert row["sum_ok"] and row["size"] == RANKS, row
        assert row["transport"] == "mpi" and row["joined"], row  # one MPI world of the job


@pytest.mark.timeout(200)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_rank_whose_target_raises_ends_the_job(tmp_path, subprocess_env, method):
    """A rank's target raising mid-job (torch.multiprocessing turns it into ``sys.exit(1)``):
    the job fails within seconds with its traceback, instead of that rank waiting in
    MPI_Finalize's barrier for ranks that wait for it (forked: it ends unfinalized, which the
    server sees; spawned: it aborts at exit)."""
    proc = _job(tmp_path, {**subprocess_env, "VANISH": "raise"}, method, "vanish", timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, -9), output[-6000:]  # failed, not hung
    assert "rank 1 fails mid-job" in output, output[-6000:]
    assert "all ranks ended well" not in proc.stdout


@pytest.mark.timeout(200)
def test_a_forked_rank_gone_before_the_end_still_ends_the_job(tmp_path, subprocess_env):
    proc = _job(tmp_path, subprocess_env, "fork", "vanish")
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, -9), output[-6000:]  # failed, not hung
    assert "all ranks ended well" not in proc.stdout
    assert "the process of rank 1 ended its connection before MPI_Finalize" in output, \
        output[-6000:]


INIT_SCRIPT = r"""
import json, os, sys
import torch
import torch.multiprocessing as mp


def work(rank, size, out, port):
    # The DDP tutorial's way: the rendezvous's variables set by hand, rank 0 hosting the store.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import ringcomm.torch as hvd
    if rank == 0:  # busy with other work too (a data loader, say): slower between the stores
        import threading
        threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(int, 1)],
                         daemon=True).start()
    hvd.init()
    total = hvd.allreduce(torch.full((100,), float(rank + 1)), op=hvd.Sum)
    import torch.distributed as dist
    row = {"rank": rank, "size": hvd.size(), "sum": total[0].item(),
           "group": dist.is_initialized() and dist.get_world_size()}
    (out / f"rank{rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    from pathlib import Path
    size = int(sys.argv[3])
    mp.start_processes(work, args=(size, Path(sys.argv[2]), int(sys.argv[4])), nprocs=size,
                       start_method=sys.argv[1])
    print("all ranks ended well")
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_init_where_rank_0_hosts_the_store(tmp_path, subprocess_env, method):
    """``hvd.init()`` (``ringcomm.init()`` with backend "auto") in processes given torchrun's
    variables by hand, rank 0 hosting torch.distributed's store on MASTER_PORT: the whole job
    over one store, the default group's (two stores one after the other on that port failed
    3 runs in 5, a rank reaching the first as rank 0 closed it)."""
    script = tmp_path / "init_job.py"
    script.write_text(INIT_SCRIPT)
    port = free_port()
    proc = run_job([sys.executable, str(script), method, str(tmp_path), str(RANKS), str(port)],
                   timeout=150, env=subprocess_env, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "all ranks ended well" in proc.stdout, output[-6000:]
    for row in _rows(tmp_path):
        assert row == {"rank": row["rank"], "size": RANKS, "sum": 6.0, "group": RANKS}, row


