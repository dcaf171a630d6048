"""Which ranks share a node: the job's topology, as the two-level allreduce sees it.

A node is what launchers mean by one: a host name (``socket.gethostname()``), so ranks in
network namespaces with a UTS host name of their own count as separate nodes. Where host names
say the wrong thing (one host standing in for a cluster, or containers sharing a name), a
number of ranks per node gives the nodes as consecutive blocks of ranks (node = rank // k):
``topology=k``, or the environment variable ``RINGCOMM_RANKS_PER_NODE``, which overrides
"auto".

Detection is collective (one ``allgather_object`` of every rank's setting and host name), so
every rank ends with the same topology; a setting that differs between ranks raises the same
error on every rank.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringcomm.core.env import env
from ringcomm.core.types import ArgumentMismatchError, Transport

__all__ = ["RANKS_PER_NODE_ENV", "Topology", "check_topology", "detect", "resolve_topology"]

#: Ranks per node, for a topology of "auto": consecutive blocks of that many ranks.
RANKS_PER_NODE_ENV = "RINGCOMM_RANKS_PER_NODE"


def check_topology(topology: Any) -> str | int:
    """``topology`` if it is "auto" or a number of ranks per node (an int >= 1).

    Raises:
        TypeError: neither a string nor an int.
        ValueError: another string, or a number < 1.
    """
    if isinstance(topology, str):
        if topology != "auto":
            raise ValueError(f"topology must be 'auto' or a number of ranks per node, "
                             f"got {topology!r}")
        return topology
    if isinstance(topology, (bool, np.bool_)) or not isinstance(topology, (int, np.integer)):
        raise TypeError(f"topology must be 'auto' or an int (ranks per node), "
                        f"got {type(topology).__name__} {topology!r}")
    if topology < 1:
        raise ValueError(f"topology (ranks per node) must be >= 1, got {topology}")
    return int(topology)


def resolve_topology(topology: Any) -> str | int:
    """The topology setting in force: ``topology`` checked, with "auto" replaced by
    ``RINGCOMM_RANKS_PER_NODE`` when that is set.

    Raises:
        TypeError, ValueError: as ``check_topology``, or the variable is not an int >= 1
            (the message names it).
    """
    chosen = check_topology(topology)
    raw = env(RANKS_PER_NODE_ENV)
    if chosen != "auto" or raw is None:
        return chosen
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{RANKS_PER_NODE_ENV} must be a number of ranks per node >= 1, "
                         f"got {raw!r}")
    return value


@dataclass(frozen=True)
class Topology:
    """The nodes of a job: ``nodes[i]`` holds the ranks of node ``i``, ascending; nodes are
    numbered in the order of their lowest rank.

    Attributes:
        nodes: the ranks of every node.
        source: how the nodes were found ("host names" or "k ranks per node").
        hosts: every rank's host name, in rank order.
    """

    nodes: tuple[tuple[int, ...], ...]
    source: str
    hosts: tuple[str, ...]

    @property
    def uniform(self) -> bool:
        """Whether every node holds the same number of ranks."""
        return len({len(ranks) for ranks in self.nodes}) == 1

    @property
    def local_size(self) -> int:
        """Ranks per node (of the first node, when the nodes are uneven)."""
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        """The node holding ``rank``."""
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        """``rank``'s position among the ranks of its node."""
        return self.nodes[self.node_of(rank)].index(rank)

    def describe(self) -> str:
        """'2 nodes of 4 ranks (host names)', or the size of every node where they differ."""
        count = len(self.nodes)
        plural = "s" if count != 1 else ""
        if self.uniform:
            sizes = f"{self.local_size} rank{'s' if self.local_size != 1 else ''}"
            return f"{count} node{plural} of {sizes} ({self.source})"
        sizes = ", ".join(str(len(ranks)) for ranks in self.nodes)
        return f"{count} node{plural} of {sizes} ranks ({self.source})"


def detect(t: Transport, topology: str | int) -> Topology:
    """The topology of ``t``'s ranks under the setting ``topology`` (from
    ``resolve_topology``); collective over ``t``.

    Raises:
        ArgumentMismatchError: the setting differs between ranks (on every rank).
    """
    everyone = t.allgather_object((topology, socket.gethostname()))
    settings = [s for s, _ in everyone]
    hosts = tuple(h for _, h in everyone)
    if len(set(settings)) > 1:
        per_rank = "; ".join(f"{s!r} on rank {r}" for r, s in enumerate(settings))
        raise ArgumentMismatchError(
            f"the topology differs between ranks: {per_rank}; pass the same topology (or "
            f"{RANKS_PER_NODE_ENV}) to every rank", kind="topology",
            ranks=tuple(range(t.size)), differences={"topology": tuple(settings)})
    if isinstance(topology, int):
        keys: list[Any] = [r // topology for r in range(t.size)]
        source = f"{topology} rank{'s' if topology != 1 else ''} per node"
    else:
        keys, source = list(hosts), "host names"
    nodes: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return Topology(tuple(tuple(ranks) for ranks in nodes.values()), source, hosts)
