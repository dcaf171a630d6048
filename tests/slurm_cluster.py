"""A private one-node Slurm cluster for the tests: Slurm's own slurmctld and slurmd (Debian's
slurm-wlm), started as root with a configuration of their own under a temporary directory
(their own ports, state and logs; nothing in /etc is read or changed), and stopped with every
job they ran.

``make slurm`` installs Slurm where it is missing (root, apt). The node declares 8 CPUs
(``SlurmdParameters=config_overrides``), so that jobs of 2-4 tasks start on this 2-core
machine; ``--mpi=pmi2`` gives the tasks srun's PMI-2 server, whose PMI-1 wire protocol the
mpich wheel's MPI speaks. ``MinJobAge=6``: ``sbatch --wait`` polls every 2 s where a
finished job's record may go within 6 s; under the default (300 s) it waited 2, then 8, then
10 s between polls, so a 28 s job returned at 42 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")


def missing() -> str | None:
    """Why no cluster can start here (None if one can)."""
    for tool in (*DAEMONS, "srun", "sbatch", "sinfo", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            return f"Slurm's {tool} is not installed (make slurm installs Slurm)"
    if os.geteuid() != 0:
        return "Slurm's daemons need root here"
    return None


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """One node, one partition; ``env`` is what a client (srun, sbatch) needs to find it."""

    def __init__(self, root: Path, cpus: int = 8) -> None:
        self.root = root
        self.host = socket.gethostname()
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, node_port = _free_ports(2)
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""\
ClusterName=ringcomm
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
MinJobAge=6
AccountingStorageType=accounting_storage/none
NodeName={self.host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Start both daemons and wait until the node takes jobs."""
        env = {**os.environ, **self.env}
        for daemon in DAEMONS:
            subprocess.run([daemon, "-c", "-f", str(self.conf)], env=env, check=True,
                           capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                   text=True, timeout=30).stdout.split()
            if state and state[0] in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Slurm node did not come up in {timeout} s: {self.logs()}")

    def logs(self) -> str:
        """The daemons' logs' last lines."""
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            for log in sorted((self.root / "log").glob("*.log")))

    def cancel_all(self) -> None:
        """Cancel every job (their tasks with them): srun killed by a test's timeout leaves
        its tasks to slurmstepd, which keeps them."""
        subprocess.run(["scancel", "--full", "--quiet", "-u", "root"],
                       env={**os.environ, **self.env}, capture_output=True, timeout=30)

    def stop(self) -> None:
        """Cancel every job, then end both daemons (from their pid files)."""
        self.cancel_all()
        for daemon in DAEMONS:
            pidfile = self.root / f"{daemon}.pid"
            try:
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
