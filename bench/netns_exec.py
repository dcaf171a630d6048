"""Run a command inside this rank's network namespace of the emulated cluster.

    mpiexec -n 4 python bench/netns_exec.py python bench/allreduce_perf.py ...

The rank comes from the launcher's environment; the namespace is
``$RINGCOMM_NETNS_PREFIX<rank>`` (bench/netns.py builds them). The process keeps its PMI
connection (an inherited descriptor), so MPI starts as usual, then talks TCP over the shaped link.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringcomm.comm.launch import detect


def main() -> None:
    prefix = os.environ.get("RINGCOMM_NETNS_PREFIX", "rcbench")
    namespace = f"{prefix}{detect().rank}"
    os.execvp("ip", ["ip", "netns", "exec", namespace, *sys.argv[1:]])


if __name__ == "__main__":
    main()
