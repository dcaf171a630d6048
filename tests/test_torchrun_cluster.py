"""torchrun across nodes: two nodes of an emulated cluster (network namespaces, each with a host
name and a NIC of its own, bench/netns.py), one torchrun per node, as on a real cluster. The
"ringcomm" backend's processes join one MPI world over ringcomm's PMI server, reached over the
nodes' network: MPICH is told which ranks share a node (shared memory there) and talks TCP
across. Root only; skipped elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import netns  # noqa: E402

REASON = netns.unavailable()

JOB = r"""
import json, os, socket, sys
import numpy as np
import torch, torch.distributed as dist

dist.init_process_group("ringcomm")
r, n = dist.get_rank(), dist.get_world_size()
for size in (7, 300_000):                   # inline in the agreement, and the ring
    t = torch.arange(size, dtype=torch.float64) + r
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(size, dtype=torch.float64) * n + sum(range(n))), size
comm = dist.group.WORLD.communicator
big = comm.allreduce(np.full(1 << 20, r + 1.0, np.float32))   # 4 MiB: across the NICs
assert (big == sum(range(1, n + 1))).all()
from mpi4py import MPI
world = MPI.COMM_WORLD
report = {"rank": r, "communicator": comm.backend, "size": comm.size, "mpi": world.Get_rank(),
          "shared": world.Split_type(MPI.COMM_TYPE_SHARED).Get_size(),
          "host": socket.gethostname(), "digest": big.sum().item()}
with open(os.path.join(sys.argv[1], f"report_{r}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(REASON is not None, reason=f"cannot build namespaces: {REASON}")
def test_torchrun_on_two_nodes_joins_one_mpi_world(tmp_path, subprocess_env):
    prefix = f"rctr{os.getpid()}x"
    job = tmp_path / "job.py"
    job.write_text(JOB)
    with netns.Cluster(4, "1gbit", prefix=prefix, ranks_per_node=2, intra="shm") as cluster:
        env = cluster.mpi_env(subprocess_env)
        before = cluster.tx_bytes()
        procs = []
        for node in range(2):
            rank = 2 * node
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                        "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr",
                        cluster.address(0), "--master-port", "29531", str(job), str(tmp_path)]
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", cluster.namespace(rank), "unshare", "--uts", "sh", "-c",
                 f'hostname {cluster.hostname(rank)} && exec "$@"', "sh", *torchrun],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        try:
            outputs = [p.communicate(timeout=180)[0] for p in procs]
        finally:
            for p in procs:  # torchrun, its workers and the PMI server, whatever happened
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
        sent = [b - a for a, b in zip(before, cluster.tx_bytes(), strict=True)]
    reports = sorted((json.loads(p.read_text()) for p in tmp_path.glob("report_*.json")),
                     key=lambda row: row["rank"])
    assert [row["rank"] for row in reports] == [0, 1, 2, 3], reports
    for row in reports:
        node = row["rank"] // 2
        assert (row["communicator"], row["size"], row["mpi"]) == ("mpi", 4, row["rank"]), row
        assert row["shared"] == 2, row                # MPICH knows which ranks share a node
        assert row["host"] == cluster.hostname(2 * node), row
        assert row["digest"] == 10.0 * (1 << 20), row
    assert min(sent) >= 1 << 20, sent                  # the 4 MiB call crossed both NICs
