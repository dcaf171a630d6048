#!/usr/bin/env python3
"""Stand-in for ssh that lets MPICH's mpiexec start one proxy per emulated node, on this host.

    mpiexec -hosts rchiernode0:2,rchiernode1:2 -launcher ssh \\
        -launcher-exec bench/netns_ssh.py -n 4 python bench/netns_exec.py ...

Hydra calls it as ``netns_ssh.py [ssh options] HOST COMMAND...``; it drops the options and the
host and runs the command here, in the host's network namespace, where the proxy reaches
mpiexec. Hydra then tells each rank which ranks share its "host", so MPICH joins the ranks of one
node by shared memory and the others by its network module; bench/netns_exec.py moves each rank
into its node's namespace.
"""

from __future__ import annotations

import os
import sys

__all__ = ["command"]

_WITH_VALUE = {"-o", "-p", "-l", "-i", "-F"}


def command(argv: list[str]) -> str:
    """The remote command of an ssh command line (options and host dropped)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in _WITH_VALUE else 1
    if i + 1 >= len(argv):
        raise SystemExit(f"netns_ssh: no host and command in {argv!r}")
    return " ".join(argv[i + 1:])


if __name__ == "__main__":
    os.execvp("sh", ["sh", "-c", command(sys.argv[1:])])
