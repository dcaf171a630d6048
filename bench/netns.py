"""An emulated cluster on one machine: one network namespace per rank, joined by a bridge.

Each rank's namespace ``<prefix><r>`` holds one end of a veth pair (``eth0``, address
10.213.0.<r+1>/24, a private test subnet that exists only inside these namespaces); the other
end sits in the switch namespace ``<prefix>sw`` on a bridge. Both ends are shaped with
``tc qdisc ... tbf rate R``, so every rank has a full-duplex link of rate R to the switch. The
host's own network namespace is never touched. Needs root (or CAP_NET_ADMIN) and iproute2.

``Cluster`` is a context manager that removes everything it created on exit, also on Ctrl-C
and SIGTERM; ``remove_stale`` removes what an earlier, killed run left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

__all__ = ["Cluster", "ClusterError", "commands_down", "commands_up", "parse_rate", "preflight",
           "remove_stale", "unavailable"]

SUBNET = "10.213.0"
PREFIX = "rcbench"
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


def _tbf(ns: str, dev: str, rate: str) -> list[str]:
    bits = parse_rate(rate) or 0
    # The bucket must hold at least one timer tick of traffic, or tbf cannot reach the rate.
    burst = max(64 * 1024, int(bits / 8 / 250))
    return ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", rate, "burst", str(burst), "latency", "100ms"]


def commands_up(n: int, rate: str | None, prefix: str = PREFIX) -> list[list[str]]:
    """The commands that build an n-rank cluster (in order)."""
    sw = f"{prefix}sw"
    cmds = [["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for r in range(n):
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


def commands_down(n: int, prefix: str = PREFIX) -> list[list[str]]:
    """The commands that remove an n-rank cluster (deleting a namespace deletes its links)."""
    return [["ip", "netns", "del", f"{prefix}{r}"] for r in range(n)] + [
        ["ip", "netns", "del", f"{prefix}sw"]]


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise ClusterError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


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
    """Delete every namespace left by an earlier run; returns their names."""
    names = existing(prefix)
    for name in names:
        _run(["ip", "netns", "del", name], check=False)
    return names


@dataclass
class Cluster:
    """An n-rank emulated cluster whose links run at ``rate`` ("1gbit", ..., None: unshaped)."""

    n: int
    rate: str | None
    prefix: str = PREFIX
    _handlers: dict[int, Any] = field(default_factory=dict, repr=False)
    _up: bool = False

    def __enter__(self) -> Cluster:
        preflight()
        remove_stale(self.prefix)
        self._trap_signals()
        self._up = True
        try:
            for cmd in commands_up(self.n, self.rate, self.prefix):
                _run(cmd)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace (and with them every link and qdisc); idempotent."""
        if self._up:
            for cmd in commands_down(self.n, self.prefix):
                _run(cmd, check=False)
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

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def tx_bytes(self) -> list[int]:
        """Bytes each rank's eth0 has sent (its qdisc counter when shaped, else the link's)."""
        return [self._counter(r) for r in range(self.n)]

    def _counter(self, rank: int) -> int:
        ns = self.namespace(rank)
        if self.rate and self.rate != "none":
            out = _run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev",
                        "eth0"]).stdout
            m = re.search(r"Sent (\d+) bytes", out)
        else:
            out = _run(["ip", "-n", ns, "-s", "link", "show", "eth0"]).stdout
            m = re.search(r"TX:.*?\n\s*(\d+)", out)
        if not m:
            raise ClusterError(f"no byte counter for {ns}/eth0 in: {out!r}")
        return int(m.group(1))

    def mpi_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for MPICH to talk TCP over eth0 instead of shared memory."""
        env = dict(os.environ if base is None else base)
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", MPIR_CVAR_NOLOCAL="1", FI_PROVIDER="tcp",
                   FI_TCP_IFACE="eth0", RINGCOMM_NETNS_PREFIX=self.prefix)
        return env

