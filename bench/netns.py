"""An emulated cluster on one machine: one network namespace per node, joined by a bridge.

Each node's namespace ``<prefix><k>`` holds one end of a veth pair (``eth0``, address
10.213.0.<k+1>/24, a private test subnet that exists only inside these namespaces); the other
end sits in the switch namespace ``<prefix>sw`` on a bridge. Both ends are shaped with
``tc qdisc ... tbf rate R``, so every node has a full-duplex NIC of rate R to the switch. The
host's own network namespace is never touched. Needs root (or CAP_NET_ADMIN) and iproute2.

A node holds ``ranks_per_node`` ranks (default 1: one namespace per rank). Ranks of one node
share its namespace and reach each other over its local route (``lo``: fast, unshaped), or with
``intra="shm"`` through MPICH's shared memory (one Hydra proxy per node, as on a real cluster);
ranks of different nodes go through the shaped NICs. With more than one rank per node every
node also gets its own host name, ``<prefix>node<k>`` (bench/netns_exec.py gives each rank a UTS
namespace with that name), resolvable inside the cluster through ``/etc/netns/<ns>/hosts``,
which ``ip netns exec`` mounts over ``/etc/hosts``.

``Cluster`` is a context manager that removes everything it created on exit, also on Ctrl-C
and SIGTERM; ``remove_stale`` removes what an earlier, killed run left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["Cluster", "ClusterError", "commands_down", "commands_up", "hostname", "hosts_file",
           "node_count", "parse_rate", "preflight", "remove_stale", "tbf_burst", "unavailable"]

SUBNET = "10.213.0"
PREFIX = "rcbench"
ETC_NETNS = Path("/etc/netns")
#: How ranks of one node talk: TCP over the node's loopback, or MPICH's shared memory.
INTRA = ("tcp", "shm")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built here (not root, no iproute2, no namespaces)."""


def parse_rate(rate: str | None) -> float | None:
    """'1gbit' -> 1e9 bits/s; None or 'none' -> None (unshaped)."""
    if rate is None or rate == "none":
        return None
    m = _RATE.match(rate.lower())
    if not m:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 10gbit, got {rate!r}")
    return float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


TBF_LATENCY = "100ms"


def tbf_burst(rate: str) -> int:
    """The tbf bucket (bytes) used at ``rate``."""
    bits = parse_rate(rate) or 0
    # The bucket must hold at least one timer tick of traffic, or tbf cannot reach the rate.
    return max(64 * 1024, int(bits / 8 / 250))


def _tbf(ns: str, dev: str, rate: str) -> list[str]:
    return ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", rate, "burst", str(tbf_burst(rate)), "latency", TBF_LATENCY]


def node_count(n: int, ranks_per_node: int = 1) -> int:
    """How many nodes n ranks fill, ``ranks_per_node`` to a node."""
    if ranks_per_node < 1 or n < 1 or n % ranks_per_node:
        raise ValueError(f"expected n ({n}) a positive multiple of ranks_per_node "
                         f"({ranks_per_node})")
    return n // ranks_per_node


def commands_up(n: int, rate: str | None, prefix: str = PREFIX,
                ranks_per_node: int = 1) -> list[list[str]]:
    """The commands that build a cluster of n ranks, ``ranks_per_node`` to a node (in order)."""
    sw = f"{prefix}sw"
    cmds = [["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for r in range(node_count(n, ranks_per_node)):
        ns = f"{prefix}{r}"
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{r}",
             "netns", sw],
            ["ip", "-n", sw, "link", "set", f"p{r}", "master", "br0"],
            ["ip", "-n", sw, "link", "set", f"p{r}", "up"],
            ["ip", "-n", ns, "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
        if rate and rate != "none":
            cmds += [_tbf(ns, "eth0", rate), _tbf(sw, f"p{r}", rate)]
    return cmds


def commands_down(n: int, prefix: str = PREFIX, ranks_per_node: int = 1) -> list[list[str]]:
    """The commands that remove the cluster (deleting a namespace deletes its links)."""
    return [["ip", "netns", "del", f"{prefix}{r}"]
            for r in range(node_count(n, ranks_per_node))] + [
        ["ip", "netns", "del", f"{prefix}sw"]]


def hostname(node: int, prefix: str = PREFIX) -> str:
    """The host name of node ``node`` (what ``socket.gethostname()`` gives its ranks)."""
    return f"{prefix}node{node}"


def hosts_file(nodes: int, prefix: str = PREFIX) -> str:
    """The /etc/hosts every node sees: localhost and every node's name at its NIC's address."""
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{SUBNET}.{k + 1} {hostname(k, prefix)}" for k in range(nodes)]
    return "\n".join(lines) + "\n"


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise ClusterError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def load_average() -> str:
    """The 1, 5 and 15-minute load averages."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def preflight() -> None:
    """Raise ClusterError saying why a cluster cannot be built here, or return."""
    if os.geteuid() != 0:
        raise ClusterError("building network namespaces needs root (run with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} not found: install iproute2")
    probe = f"{PREFIX}probe{os.getpid()}"
    if _run(["ip", "netns", "add", probe], check=False).returncode:
        raise ClusterError("this machine does not allow new network namespaces")
    _run(["ip", "netns", "del", probe], check=False)


def unavailable() -> str | None:
    """Why no cluster can be built here (what ``preflight`` raises), or None when one can."""
    try:
        preflight()
    except ClusterError as err:
        return str(err)
    return None


def existing(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix``."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace (and its /etc/netns files) left by an earlier run; returns their
    names."""
    names = existing(prefix)
    for name in names:
        _run(["ip", "netns", "del", name], check=False)
    if ETC_NETNS.is_dir():
        for path in ETC_NETNS.glob(f"{prefix}*"):
            shutil.rmtree(path, ignore_errors=True)
    return names


@dataclass
class Cluster:
    """An emulated cluster of n ranks, ``ranks_per_node`` to a node, whose NICs run at ``rate``
    ("1gbit", ..., None: unshaped)."""

    n: int
    rate: str | None
    prefix: str = PREFIX
    ranks_per_node: int = 1
    intra: str = "tcp"
    _handlers: dict[int, Any] = field(default_factory=dict, repr=False)
    _up: bool = False

    def __post_init__(self) -> None:
        node_count(self.n, self.ranks_per_node)  # raises on a shape that does not divide
        if self.intra not in INTRA:
            raise ValueError(f"intra must be one of {INTRA}, got {self.intra!r}")

    @property
    def nodes(self) -> int:
        """How many nodes (network namespaces with a NIC) the cluster has."""
        return node_count(self.n, self.ranks_per_node)

    @property
    def named_hosts(self) -> bool:
        """Whether every node has a host name of its own (more than one rank per node)."""
        return self.ranks_per_node > 1

    def __enter__(self) -> Cluster:
        preflight()
        remove_stale(self.prefix)
        self._trap_signals()
        self._up = True
        try:
            for cmd in commands_up(self.n, self.rate, self.prefix, self.ranks_per_node):
                _run(cmd)
            if self.named_hosts:
                self._write_hosts()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace (and with them every link and qdisc) and the node's
        /etc/netns files; idempotent."""
        if self._up:
            for cmd in commands_down(self.n, self.prefix, self.ranks_per_node):
                _run(cmd, check=False)
            for node in range(self.nodes):
                shutil.rmtree(ETC_NETNS / f"{self.prefix}{node}", ignore_errors=True)
            with contextlib.suppress(OSError):  # only when empty: others' files stay
                ETC_NETNS.rmdir()
            self._up = False
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()

    def _trap_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.close()
            raise KeyboardInterrupt(f"interrupted by signal {signum}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._handlers[sig] = signal.signal(sig, on_signal)

    def _write_hosts(self) -> None:
        text = hosts_file(self.nodes, self.prefix)
        for node in range(self.nodes):
            folder = ETC_NETNS / f"{self.prefix}{node}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(text)

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank`` (ranks fill nodes in order)."""
        return rank // self.ranks_per_node

    def namespace(self, rank: int) -> str:
        """The network namespace ``rank`` runs in (its node's)."""
        return f"{self.prefix}{self.node_of(rank)}"

    def address(self, rank: int) -> str:
        """The address of ``rank``'s node NIC."""
        return f"{SUBNET}.{self.node_of(rank) + 1}"

    def hostname(self, rank: int) -> str:
        """The host name ``rank`` sees (only set when ``named_hosts``)."""
        return hostname(self.node_of(rank), self.prefix)

    def tx_bytes(self) -> list[int]:
        """Bytes each node's NIC (eth0) has sent: its qdisc counter when shaped, else the
        link's. One entry per node, that is per rank with one rank per node."""
        return [self._counter(k) for k in range(self.nodes)]

    def local_bytes(self) -> list[int]:
        """Bytes each node's loopback has carried: the traffic between ranks of one node."""
        return [self._link_tx(f"{self.prefix}{k}", "lo") for k in range(self.nodes)]

    def _counter(self, node: int) -> int:
        ns = f"{self.prefix}{node}"
        if not self.rate or self.rate == "none":
            return self._link_tx(ns, "eth0")
        out = _run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
        m = re.search(r"Sent (\d+) bytes", out)
        if not m:
            raise ClusterError(f"no byte counter for {ns}/eth0 in: {out!r}")
        return int(m.group(1))

    @staticmethod
    def _link_tx(ns: str, dev: str) -> int:
        out = _run(["ip", "-n", ns, "-s", "link", "show", dev]).stdout
        m = re.search(r"TX:.*?\n\s*(\d+)", out)
        if not m:
            raise ClusterError(f"no byte counter for {ns}/{dev} in: {out!r}")
        return int(m.group(1))

    def mpi_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for MPICH to talk TCP over eth0; with ``intra="tcp"`` between every
        pair of ranks (ranks of one node reach each other's eth0 address over the node's
        loopback), with "shm" through shared memory inside a node (see ``launch_args``)."""
        env = dict(os.environ if base is None else base)
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp", FI_TCP_IFACE="eth0",
                   RINGCOMM_NETNS_PREFIX=self.prefix)
        if self.intra == "tcp":
            env["MPIR_CVAR_NOLOCAL"] = "1"
        else:
            env.pop("MPIR_CVAR_NOLOCAL", None)
        if self.named_hosts:
            env["RINGCOMM_NETNS_RANKS_PER_NODE"] = str(self.ranks_per_node)
        return env

    def launch_args(self) -> list[str]:
        """mpiexec options before ``-n``: none with ``intra="tcp"``; with "shm", one Hydra
        proxy per node (started on this host by bench/netns_ssh.py), so that MPICH knows which
        ranks share a node."""
        if self.intra == "tcp":
            return []
        hosts = ",".join(f"{hostname(k, self.prefix)}:{self.ranks_per_node}"
                         for k in range(self.nodes))
        return ["-hosts", hosts, "-launcher", "ssh", "-launcher-exec",
                str(Path(__file__).resolve().parent / "netns_ssh.py")]
