"""Run one mpiexec job over an emulated cluster of shaped links (as root).

    sudo .venv/bin/python bench/netns_run.py --ranks 2 --rate 1gbit -- \\
        bench/dist_backend_perf.py -b 1M -e 64M -f 4 --no-ddp
    sudo .venv/bin/python bench/netns_run.py --ranks 2 --rate 1gbit -- \\
        bench/allreduce_perf.py -b 16M -e 64M -f 4 --baseline mpi

One network namespace per rank (bench/netns.py: a bridge, tc tbf on both ends of every NIC),
MPICH over TCP between them, and torch.distributed's rendezvous and gloo on the NICs too
(``MASTER_ADDR`` rank 0's address, ``GLOO_SOCKET_IFNAME`` eth0: without them a torch job
there waits for a store or a peer it cannot reach). Rank 0's output is printed when the job
ends; a job that fails or runs past ``--timeout`` is ended (its ranks too) and raises with
its output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from cluster import run_in_cluster  # noqa: E402


def job_env(cluster: netns.Cluster) -> dict[str, str]:
    """MPICH's settings for the cluster, and torch.distributed's on its NICs."""
    env = cluster.mpi_env()
    env.update(MASTER_ADDR=cluster.address(0), GLOO_SOCKET_IFNAME="eth0")
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="the NICs' rate (tc); none = unshaped")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the job")
    p.add_argument("--prefix", default="rcrun",
                   help="namespace name prefix (give concurrent runs different ones)")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rate = None if args.rate == "none" else args.rate
    with netns.Cluster(args.ranks, rate, prefix=args.prefix) as cluster:
        print(run_in_cluster(cluster, [str(Path(args.script).resolve()), *args.args],
                             args.timeout, env=job_env(cluster)), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
