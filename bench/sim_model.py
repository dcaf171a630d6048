"""The cost model of the simulated cluster: links, node NICs, codec compute, collectives.

Everything here is arithmetic on virtual seconds; :mod:`sim_transport` applies it to the
messages and array operations of ringcomm's real algorithms.

Topology: rank ``g`` lives on node ``g // ranks_per_node``. Two ranks of one node talk over an
intra-node link (NVLink-like); ranks of different nodes go through their nodes' NICs.

Link model (one message of ``b`` real bytes posted at the sender's virtual time ``t``; the time
charged is for ``w = b * scale / efficiency`` bytes, so a small real array stands for a large
gradient, and ``efficiency`` (payload over bytes on the wire) covers protocol headers):

- intra-node: the sender's outgoing port is busy until ``port[g]``; the transfer starts at
  ``s = max(t, port[g])``, lasts ``w / intra_bw``, and arrives ``intra_alpha`` after it ends.
- inter-node: each node has one NIC, a shared resource with a busy-until time per direction.
  The transfer starts at ``s = max(t, nic_out[src node], nic_in[dst node])``, holds both for
  ``w / inter_bw`` (first come, first served in virtual time: concurrent cross-node messages of
  a node's ranks queue behind each other instead of sharing the bandwidth packet by packet; for
  a stream of equal messages both give the same throughput), and arrives ``inter_alpha`` later.

``alpha`` is everything a message pays once (software, propagation, switch), ``bw`` the bytes
per second of one direction. The sender's request completes when its last byte has left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CostModel", "LinkModel", "NetworkState", "alpha_beta_bound", "collective_seconds",
           "ring_time"]


@dataclass(frozen=True)
class LinkModel:
    """Links and topology of a simulated cluster (bandwidths in bytes per second).

    Attributes:
        ranks_per_node: ranks sharing a node (and its NIC).
        intra_bw, intra_alpha: one direction of a rank's intra-node port; per-message cost.
        inter_bw, inter_alpha: one direction of a node's NIC; per-message cost.
        scale: bytes charged per real byte sent.
        efficiency: payload bytes per byte on the wire (1 - header overhead).
    """

    ranks_per_node: int = 8
    intra_bw: float = 300e9
    intra_alpha: float = 2e-6
    inter_bw: float = 400e9 / 8
    inter_alpha: float = 5e-6
    scale: float = 1.0
    efficiency: float = 1.0

    def node(self, g: int) -> int:
        """The node of global rank ``g``."""
        return g // self.ranks_per_node

    def wire_seconds(self, nbytes: float, inter: bool) -> float:
        """Seconds one direction of a link needs for ``nbytes`` real bytes (scaled)."""
        bw = self.inter_bw if inter else self.intra_bw
        return nbytes * self.scale / self.efficiency / bw

    def alpha(self, inter: bool) -> float:
        """The per-message cost of an inter- or intra-node message."""
        return self.inter_alpha if inter else self.intra_alpha


@dataclass
class NetworkState:
    """Busy-until times of every rank's intra-node port and every node's NIC directions."""

    model: LinkModel
    port: dict[int, float] = field(default_factory=dict)
    nic_out: dict[int, float] = field(default_factory=dict)
    nic_in: dict[int, float] = field(default_factory=dict)

    def transmit(self, src: int, dst: int, nbytes: int, t: float) -> tuple[float, float]:
        """Send ``nbytes`` from global rank ``src`` to ``dst`` at ``t``.

        Returns:
            (the time the last byte left, the time it arrived). Callers must post in
            nondecreasing ``t`` for the queues to be first come, first served.
        """
        m = self.model
        a, b = m.node(src), m.node(dst)
        inter = a != b
        dur = m.wire_seconds(nbytes, inter)
        if inter:
            start = max(t, self.nic_out.get(a, 0.0), self.nic_in.get(b, 0.0))
            self.nic_out[a] = self.nic_in[b] = start + dur
        else:
            start = max(t, self.port.get(src, 0.0))
            self.port[src] = start + dur
        return start + dur, start + dur + m.alpha(inter)


#: Elements an operation of ringcomm.ops works on: the index of the array argument that says.
_SIZE_ARG = {
    "reduce": 1, "divide": 0, "copy": 0, "compensate": 0, "zeros": 0, "zero_nonfinite": 0,
    "int8_encode": 0, "int8_decode": 1, "int8_hop": 1, "cast_encode": 0, "cast_decode": 1,
    "cast_hop": 1, "topk": 0, "scatter_add": 1, "sparse_residual": 0,
}


def _variant(name: str, kwargs: dict[str, Any]) -> str:
    """The rate key of a call: the op, "+error" with error feedback, "+stochastic"."""
    key = name
    if kwargs.get("stochastic"):
        key += "+stochastic"
    if kwargs.get("error") is not None:
        key += "+error"
    if name == "topk" and kwargs.get("approximate"):
        key += "+approximate"
    return key


@dataclass
class CostModel:
    """Virtual seconds of the array operations the algorithms call.

    An operation on ``e`` real elements costs ``fixed + e * scale * rate`` where ``rate``
    (seconds per element) comes from the most specific key of ``rates`` that exists:
    "int8_hop+error", then "int8_hop". Operations without a rate (``empty``, views) are free.

    Attributes:
        rates: seconds per element, by op (and variant).
        fixed: seconds every charged call costs (a kernel launch, a Python call).
        scale: elements charged per real element.
        slowdown: factor on everything (ranks sharing a core).
        source: where the rates come from, for the report.
    """

    rates: dict[str, float]
    fixed: float = 0.0
    scale: float = 1.0
    slowdown: float = 1.0
    source: str = ""

    def charges(self, name: str) -> bool:
        """Whether op ``name`` costs time."""
        return name in _SIZE_ARG and any(k.split("+")[0] == name for k in self.rates)

    def rate(self, name: str, kwargs: dict[str, Any]) -> float:
        """Seconds per element of a call of ``name`` with ``kwargs``."""
        key = _variant(name, kwargs)
        while key not in self.rates and "+" in key:
            key = key.rsplit("+", 1)[0]
        return self.rates.get(key, 0.0)

    def seconds(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        """Virtual seconds of the call ``name(*args, **kwargs)``."""
        arg = args[_SIZE_ARG[name]]
        if name == "zeros":
            elems = math.prod(arg) if isinstance(arg, tuple) else int(arg)
        else:
            elems = int(getattr(arg, "size", 0))
        return self.slowdown * (self.fixed + elems * self.scale * self.rate(name, kwargs))

    @classmethod
    def free(cls) -> CostModel:
        """A model in which computing costs nothing (communication only)."""
        return cls({}, source="no compute charged")


def ring_time(n: int, nbytes: float, alpha: float, bw: float) -> float:
    """The textbook ring allreduce: 2(n-1) steps, each alpha + S/(n bw)."""
    return 2 * (n - 1) * (alpha + nbytes / (n * bw)) if n > 1 else 0.0


def alpha_beta_bound(nodes: int, nbytes: float, alpha: float, nic_bw: float) -> float:
    """A lower bound on an allreduce of ``nbytes`` over ``nodes`` nodes of one NIC each.

    Every node's NIC must send (and receive) at least 2(N-1)/N * S bytes, and the last
    contribution needs at least ceil(log2 N) inter-node latencies to reach every node:
    T >= 2(N-1)/N * S / bw + ceil(log2 N) * alpha.
    """
    if nodes <= 1:
        return 0.0
    return 2 * (nodes - 1) / nodes * nbytes / nic_bw + math.ceil(math.log2(nodes)) * alpha


def collective_seconds(model: LinkModel, members: list[int], what: str, nbytes: int,
                       scaled: bool = True) -> float:
    """Virtual seconds of a collective of global ranks ``members`` (charged by formula, not
    simulated message by message): a barrier is 2 ceil(log2 n) alphas, an allgather a ring of
    n - 1 steps of the largest part, a broadcast a binomial tree of ceil(log2 n) whole sends.
    Across nodes, the group's ranks of one node share its NIC's bandwidth."""
    n = len(members)
    if n <= 1:
        return 0.0
    per_node: dict[int, int] = {}
    for g in members:
        per_node[model.node(g)] = per_node.get(model.node(g), 0) + 1
    inter = len(per_node) > 1
    share = max(per_node.values()) if inter else 1
    wire = model.wire_seconds(nbytes, inter) * share
    if not scaled:
        wire /= model.scale
    alpha, depth = model.alpha(inter), math.ceil(math.log2(n))
    if what == "barrier":
        return 2 * depth * alpha
    if what == "broadcast":
        return depth * (alpha + wire)
    return (n - 1) * (alpha + wire)
