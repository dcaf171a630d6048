"""Closed forms of the simulated allreduces, on the same link and compute model as the simulator.

They extrapolate where thread ranks would be too many (1024) and are checked against the
simulation where both exist. A ring phase runs ``s`` steps over chunks cut into ``m`` segments;
its hops have per-message costs ``alpha_h``, wire times ``d_h`` and ``f_h`` flows sharing the
hop's NIC; its ranks compute ``c`` per segment and step. With ``B = max_h(f_h d_h)`` (the
busiest resource) and ``chain = mean_h(alpha_h + d_h) + c`` (one segment's hop and reduction):

- one segment per chunk (m = 1; the ring posts a step only once the previous one is reduced,
  and a request ends when its own send has left): ``s * max(B + c, chain)`` when each NIC
  carries one flow, ``s * max(B, chain)`` when several flows keep it busy meanwhile;
- pipelined (m > 1, two exchanges in flight): ``s * m * max(B, c, chain / 2) + chain``.

The flat ring's hops are ``k - 1`` intra-node hops and one NIC hop per node; the hierarchical
allreduce is a node-local reduce-scatter, ``k`` cross-node rings at once (each NIC carries ``k``
flows), and a node-local allgather of whole shards (for top-k: of the cross-node rings' selected
pairs, after a node-local exchange of pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sim_model import CostModel, LinkModel

__all__ = ["Phase", "projected", "ring_phase"]

SEGMENT = 2 << 20
WINDOW = 2


@dataclass(frozen=True)
class Phase:
    """One ring phase: steps, segments per chunk, its hops' (alpha, wire seconds per segment
    message, flows sharing the hop), compute per segment and step."""

    steps: int
    segments: int
    hops: tuple[tuple[float, float, int], ...]
    compute: float


def ring_phase(p: Phase) -> float:
    """Seconds of a ring phase (see the module's formulas)."""
    if p.steps <= 0:
        return 0.0
    busiest = max(f * d for _, d, f in p.hops)
    chain = sum(a + d for a, d, _ in p.hops) / len(p.hops) + p.compute
    if p.segments == 1:
        shared = max(f for _, _, f in p.hops) > 1
        return p.steps * max(busiest + (0.0 if shared else p.compute), chain)
    return p.steps * p.segments * max(busiest, p.compute, chain / WINDOW) + chain


def _op(cost: CostModel, name: str, elems: float, **kw: Any) -> float:
    return cost.slowdown * (cost.fixed + elems * cost.rate(name, kw))


def _hops(links: LinkModel, ranks: int, per_node: int, share: int,
          nbytes: float) -> tuple[tuple[float, float, int], ...]:
    """The hops of a ring of ``ranks`` ranks, ``per_node`` of them on each node, ``share``
    flows on each NIC, for messages of ``nbytes``."""
    wire = nbytes / links.efficiency
    intra = (links.intra_alpha, wire / links.intra_bw, 1)
    inter = (links.inter_alpha, wire / links.inter_bw, share)
    nodes = math.ceil(ranks / per_node)
    if nodes == 1:
        return (intra,)
    return (intra,) * (per_node - 1) + (inter,)


def _dense_ring(links: LinkModel, cost: CostModel, n: int, elems: float, per_node: int,
                share: int, comp: Any) -> float:
    """A flat allreduce of ``elems`` float32 over ``n`` ranks through ``comp``."""
    if n == 1:
        return 0.0
    chunk = elems / n
    if comp is None or comp.allreduce_algorithm == "ring":
        align = getattr(comp, "align", 1)
        seg = max(SEGMENT // 4, align)
        m = max(1, math.ceil(chunk / seg))
        se = chunk / m
        if comp is None:
            wire, rs, ag = 4 * se, _op(cost, "reduce", se), 0.0
        else:
            wire = comp.nbytes(int(se))
            rs = _op(cost, "compensate", se) + _op(cost, "int8_hop", se, error=True)
            ag = _op(cost, "int8_decode", se)
        hops = _hops(links, n, per_node, share, wire)
        return (ring_phase(Phase(n - 1, m, hops, rs)) + ring_phase(Phase(n - 1, m, hops, ag)))
    k = comp.k_for(int(chunk))
    wire = min(8 * k, 4 * chunk)
    rs = (_op(cost, "compensate", chunk) + _op(cost, "scatter_add", k)
          + _op(cost, "topk", chunk) + _op(cost, "sparse_residual", chunk))
    hops = _hops(links, n, per_node, share, wire)
    return (ring_phase(Phase(n - 1, 1, hops, rs))
            + ring_phase(Phase(n - 1, 1, hops, _op(cost, "scatter_add", k))))


def _sparse_hierarchical(links: LinkModel, cost: CostModel, n: int, elems: float,
                         comp: Any) -> float:
    """Top-k in two levels, every phase sparse (ringcomm.algorithms.sparse_hierarchical):
    ``k - 1`` direct exchanges of selected pairs, the cross-node sparse ring of each shard,
    then the cross-node ring's messages around the node, decoded by every rank."""
    k = links.ranks_per_node
    nodes = n // k
    shard = elems / k
    pairs = comp.k_for(int(shard))
    select = (_op(cost, "compensate", shard) + _op(cost, "topk", shard)
              + _op(cost, "sparse_residual", shard) + _op(cost, "scatter_add", pairs))
    alpha, wire, _ = _hops(links, k, k, 1, 8 * pairs)[0]
    gather = (k - 1) * (select + alpha + wire)
    cross = _dense_ring(links, cost, nodes, shard, 1, k, comp)
    chunk_pairs = comp.k_for(int(shard / nodes))
    messages = nodes * min(8 * chunk_pairs, 4 * shard / nodes)
    alpha, wire, _ = _hops(links, k, k, 1, messages)[0]
    share = (k - 1) * (alpha + wire + nodes * _op(cost, "scatter_add", chunk_pairs))
    return gather + cross + share


def _hierarchical(links: LinkModel, cost: CostModel, n: int, elems: float, comp: Any) -> float:
    if comp is not None and comp.allreduce_algorithm == "sparse-ring":
        return _sparse_hierarchical(links, cost, n, elems, comp)
    k = links.ranks_per_node
    nodes = n // k
    shard = elems / k
    local = _hops(links, k, k, 1, 4 * min(shard, SEGMENT // 4))
    m = max(1, math.ceil(shard / (SEGMENT // 4)))
    prep = _op(cost, "reduce", elems) if comp is not None else 0.0
    rs = ring_phase(Phase(k - 1, m, local, _op(cost, "reduce", shard / m)))
    cross = _dense_ring(links, cost, nodes, shard, 1, k, comp)
    gather = _hops(links, k, k, 1, 4 * shard)
    ag = (k - 1) * (gather[0][0] + gather[0][1])  # whole shards, one at a time
    return prep + rs + cross + _op(cost, "copy", shard) + ag


def projected(n: int, nbytes: float, comp: Any, hier: bool, links: LinkModel,
              cost: CostModel) -> float:
    """Seconds of an allreduce of ``nbytes`` of float32 gradients over ``n`` ranks (closed
    form); ``links.scale`` is ignored (real sizes are given)."""
    elems = nbytes / 4
    saved = cost.scale
    try:
        cost.scale = 1.0
        if hier:
            return _hierarchical(links, cost, n, elems, comp)
        return _dense_ring(links, cost, n, elems, links.ranks_per_node, 1, comp)
    finally:
        cost.scale = saved

