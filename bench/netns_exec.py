"""Run a command inside this rank's network namespace of the emulated cluster.

    mpiexec -n 4 python bench/netns_exec.py python bench/allreduce_perf.py ...

The rank comes from the launcher's environment; the namespace is that of the rank's node,
``$RINGCOMM_NETNS_PREFIX<node>`` (bench/netns.py builds them), where node = rank // ranks per
node. With ``RINGCOMM_NETNS_RANKS_PER_NODE`` set (more than one rank per node) the rank also gets
a UTS namespace of its own carrying its node's host name, and the launcher's local rank and
local size variables describe its place on that node, as a launcher would on a real cluster.
The process keeps its PMI connection (an inherited descriptor), so MPI starts as usual, then
talks TCP over the shaped NIC (or the node's loopback, to a rank of its own node).
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringcomm.core.launch import detect

__all__ = ["main", "placement", "set_hostname"]

_CLONE_NEWUTS = 0x04000000


def set_hostname(name: str) -> None:
    """Give this process (and what it execs) a UTS namespace whose host name is ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    socket.sethostname(name)


def placement(env: Mapping[str, str], rank: int) -> tuple[str, str | None, dict[str, str]]:
    """Where ``rank`` runs: its node's namespace, its host name (None: leave it) and the
    launcher variables to set, read from the cluster's variables in ``env``."""
    prefix = env.get("RINGCOMM_NETNS_PREFIX", "rcbench")
    per_node = int(env.get("RINGCOMM_NETNS_RANKS_PER_NODE", "1"))
    node = rank // per_node
    if "RINGCOMM_NETNS_RANKS_PER_NODE" not in env:
        return f"{prefix}{node}", None, {}
    local = {"MPI_LOCALRANKID": str(rank % per_node), "MPI_LOCALNRANKS": str(per_node)}
    return f"{prefix}{node}", f"{prefix}node{node}", local  # bench/netns.py's hostname()


def main() -> None:
    namespace, host, local = placement(os.environ, detect().rank)
    if host is not None:
        set_hostname(host)
        os.environ.update(local)
    os.execvp("ip", ["ip", "netns", "exec", namespace, *sys.argv[1:]])


if __name__ == "__main__":
    main()
