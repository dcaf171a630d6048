"""The Communicator's choice between the flat ring and the two-level allreduce, and the
node-local and cross-node transports the latter runs over.

``algorithm="flat"`` always runs the flat ring; "hierarchical" always runs
:mod:`ringcomm.algorithms.hierarchical` (and raises, the same on every rank, where the nodes hold
different numbers of ranks); "auto" runs it only where it can help: more than one node, more
than one rank per node, every node the same size, and a dense call, or one through a
compressor that encodes every element (casts, Int8), of at least ``HIERARCHICAL_MIN_BYTES``
(on device arrays through such a compressor: on at least
``HIERARCHICAL_MIN_NODES_ENCODED_DEVICE`` nodes), or a sparse one (top-k) on at least
``HIERARCHICAL_MIN_NODES_COMPRESSED`` nodes (host arrays) or
``HIERARCHICAL_MIN_NODES_SPARSE_DEVICE`` (device arrays).

The topology and the two transports are made once, when the first call that may use them
comes, after that call's cross-rank agreement: every rank then takes the same decision, so
every rank joins the same collective exchange and splits. Calls that cannot use them (flat,
small dense calls under "auto") never make them, and cost nothing more.
"""

from __future__ import annotations

import functools
from typing import Any

from ringcomm import ops as _ops
from ringcomm.algorithms import hierarchical, sparse_hierarchical
from ringcomm.codecs.base import Compressor, DenseCompressor
from ringcomm.comm import topology as _topology
from ringcomm.core.env import env
from ringcomm.core.types import Array, InvalidArgumentError, Transport

__all__ = ["ALGORITHMS", "ALGORITHM_ENV", "HIERARCHICAL_MIN_BYTES",
           "HIERARCHICAL_MIN_NODES_COMPRESSED", "HIERARCHICAL_MIN_NODES_ENCODED_DEVICE",
           "HIERARCHICAL_MIN_NODES_SPARSE_DEVICE", "TwoLevel",
           "check_algorithm", "resolve_algorithm", "route"]

#: What ``algorithm=`` takes.
ALGORITHMS = ("auto", "flat", "hierarchical")
#: The default algorithm of ``ringcomm.init`` when it is given none.
ALGORITHM_ENV = "RINGCOMM_ALGORITHM"
#: Dense calls from this size on go two-level under "auto". Below it a call is bound by
# per-message latency and by the fixed cost of each phase (three schedules instead of one);
# the smaller cross-node volume of each node pays for those only once transfer time
# dominates.
HIERARCHICAL_MIN_BYTES = 1 << 20
#: Sparse compressed calls (top-k) on host arrays go two-level under "auto" on at least this
# many nodes. Top-k's two-level allreduce (ringcomm.algorithms.sparse_hierarchical) selects over
# as much of each rank's array as the flat ring does, and on the CPU the selection, not the
# link, bounds it: measured 0.85-0.94x the flat ring at 2 nodes of 2 on 2 shared cores at 1
# Gbit/s and 0.97-0.99x at 10 Gbit/s (the earlier two-level path, float32 inside the node,
# 0.71-1.09x and 0.81-0.94x: bench/results/cluster2/topk_two_level/). Its error is lower.
HIERARCHICAL_MIN_NODES_COMPRESSED = 64
#: Sparse compressed calls on device arrays go two-level under "auto" from this many nodes
# where top-k's sparse two-level path takes them (its ring, pairs lighter than the floats):
# with the GPU's selection the NIC bounds top-k, and the two-level path moves fewer pairs over
# it in fewer serial steps (simulated 1.11x the flat ring at 2 nodes of 8 GPUs with 400 Gbit/s
# NICs, 1.25x at 8 nodes, 2.2x at 64 nodes: bench/results/scale_sim/; not measured on a GPU
# cluster). Other sparse calls keep HIERARCHICAL_MIN_NODES_COMPRESSED.
HIERARCHICAL_MIN_NODES_SPARSE_DEVICE = 2
#: Compressors that encode every element (casts, Int8) go two-level under "auto" from this
# many nodes, for calls of HIERARCHICAL_MIN_BYTES or more, as dense calls do: the cross-node
# phase moves their payload over a node's NIC once instead of 2(n - 1) / n times per rank,
# re-encoding it nodes - 1 times instead of ranks - 1. Measured at 2 nodes of 2 with the
# residual added by the cross-node phase: int8 1.27x flat at 1 Gbit/s, 1.75x at 10 Gbit/s,
# fp16 1.47x at 10 Gbit/s (64 MiB, shared memory within the node).
HIERARCHICAL_MIN_NODES_ENCODED = 2
#: The same compressors on device arrays go two-level under "auto" from this many nodes: on
# NVLink and the GPU's codecs the flat ring's steps are cheap, and the two-level path's float32
# node phases cost more than the NIC bytes they save until the flat ring's 2(n - 1) steps
# dominate: int8 simulated 0.94x the flat ring at 2 nodes of 8 GPUs, 0.69-0.72x at 8-32 nodes,
# 1.14x at 64 (400 Gbit/s NICs, bench/results/scale_sim/; not measured on a GPU cluster).
HIERARCHICAL_MIN_NODES_ENCODED_DEVICE = 64


def check_algorithm(algorithm: Any) -> str:
    """``algorithm`` if it names an allreduce algorithm ("auto", "flat", "hierarchical").

    Raises:
        TypeError: not a string.
        ValueError: an unknown name.
    """
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                        f"got {type(algorithm).__name__} {algorithm!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                         f"got {algorithm!r}")
    return algorithm


def resolve_algorithm(algorithm: str | None) -> str:
    """``algorithm`` checked, or when None ``RINGCOMM_ALGORITHM``'s value, or "auto".

    Raises:
        TypeError, ValueError: as ``check_algorithm`` (naming the variable for its value).
    """
    if algorithm is not None:
        return check_algorithm(algorithm)
    raw = env(ALGORITHM_ENV)
    if raw is None:
        return "auto"
    try:
        return check_algorithm(raw.strip().lower())
    except ValueError:
        raise ValueError(f"{ALGORITHM_ENV} must be one of {', '.join(ALGORITHMS)}, "
                         f"got {raw!r}") from None


class TwoLevel:
    """The two-level setting of one communicator: its default algorithm, its topology
    setting, and (once made) the topology and the node-local and cross-node transports.

    Args:
        transport: the communicator's transport, which the groups are split from.
        algorithm: the default of ``allreduce(algorithm=None)``.
        topology: "auto" or ranks per node (see :mod:`ringcomm.comm.topology`);
            ``RINGCOMM_RANKS_PER_NODE`` replaces "auto" when set (read here: a bad value
            raises, and the Communicator being built raises it on every rank, in its start-up
            agreement).
    """

    __slots__ = ("_groups", "_topology", "algorithm", "setting", "transport")

    def __init__(self, transport: Transport, algorithm: str, topology: str | int) -> None:
        self.transport = transport
        self.algorithm = check_algorithm(algorithm)
        self.setting = _topology.resolve_topology(topology)
        self._topology: _topology.Topology | None = None
        self._groups: tuple[Transport, Transport] | None = None

    @property
    def topology(self) -> _topology.Topology | None:
        """The topology, once a call has needed it (None before)."""
        return self._topology

    def set_topology(self, topology: str | int) -> None:
        """Change the topology setting: the topology and groups are made again when next
        needed (a collective change: every rank must make it at the same point)."""
        self.setting = _topology.resolve_topology(topology)
        self._topology = None
        self._close_groups()

    def call_algorithm(self, algorithm: Any, compression: Any) -> str:
        """The algorithm of one allreduce: ``algorithm`` checked, or the default when None.

        Raises:
            TypeError, ValueError: an unknown algorithm; "hierarchical" with a compressor that
                cannot reduce node shards (a compression="auto" decided after the agreement
                is judged by what it picks, later).
        """
        chosen = self.algorithm if algorithm is None else check_algorithm(algorithm)
        if chosen == "hierarchical" and isinstance(compression, Compressor):
            hierarchical.check_compressor(compression)
        return chosen

    def groups(self, algorithm: str, x: Array,
               comp: Any | None) -> tuple[Transport, Transport] | None:
        """The (local, cross) transports for an allreduce of ``x`` under ``algorithm`` through
        ``comp`` (agreed on every rank already), or None to run the flat ring.

        Raises:
            InvalidArgumentError: "hierarchical" on nodes of different sizes (on every rank).
            ArgumentMismatchError: the topology setting differs between ranks (on every rank).
        """
        t = self.transport
        if algorithm == "flat" or t.size == 1:
            return None
        if algorithm == "auto" and not _may_help(t, x, comp):
            return None
        topo = self._detect()
        if algorithm == "hierarchical":
            if not topo.uniform:
                raise InvalidArgumentError(
                    f"allreduce: algorithm 'hierarchical' needs the same number of ranks on "
                    f"every node, got {topo.describe()}; use algorithm='flat' or 'auto', or "
                    f"pass topology=k (or {_topology.RANKS_PER_NODE_ENV}) for nodes of k ranks",
                    kind="allreduce", ranks=tuple(range(t.size)),
                    reason="nodes of different sizes")
        elif not (topo.uniform and len(topo.nodes) > 1 and topo.local_size > 1):
            return None
        elif len(topo.nodes) < min_nodes(comp, x, (topo.local_size, len(topo.nodes))):
            return None
        return self._split(topo)

    def surely_flat(self, algorithm: str, x: Array) -> bool:
        """Whether a dense allreduce of ``x`` under ``algorithm`` runs the flat ring whatever
        the topology (no exchange: decided from the call alone)."""
        return (algorithm == "flat" or self.transport.size == 1
                or (algorithm == "auto" and not _may_help(self.transport, x, None)))

    def close(self) -> None:
        """Close the node-local and cross-node transports, if made."""
        self._close_groups()

    def _detect(self) -> _topology.Topology:
        if self._topology is None:
            self._topology = _topology.detect(self.transport, self.setting)
        return self._topology

    def _split(self, topo: _topology.Topology) -> tuple[Transport, Transport]:
        if self._groups is None:
            t = self.transport
            local = t.split(topo.node_of(t.rank), t.rank)
            try:
                cross = t.split(topo.local_rank(t.rank), t.rank)
            except BaseException:
                local.close()
                raise
            for sub in (local, cross):  # a timeout in either fails the communicator
                sub.on_failure(functools.partial(_forward_failure, sub, t))
            self._groups = (local, cross)
        return self._groups

    def _close_groups(self) -> None:
        groups, self._groups = self._groups, None
        for sub in groups or ():
            sub.close()


def route(sub: Transport, x: Array) -> Transport:
    """The transport of ``sub`` that moves arrays like ``x`` (its host transport for host
    arrays, on backends that have one)."""
    return sub.transport_for(x)


def min_nodes(comp: Compressor | None, x: Array, shape: tuple[int, int] | None = None) -> int:
    """The nodes from which "auto" runs a call of ``x`` through ``comp`` two-level (None:
    dense). ``shape``: (ranks per node, nodes) once the topology is known; before it, the
    fewest nodes any shape could need. A device top-k call that the sparse two-level path
    does not take at that shape (top-k's allgather, or pairs that outweigh the float32 values:
    the float32 node phases then run) needs HIERARCHICAL_MIN_NODES_COMPRESSED, as on the host."""
    if comp is None:
        return 2
    device = _ops.is_device_array(x)
    if isinstance(comp, DenseCompressor):
        return HIERARCHICAL_MIN_NODES_ENCODED_DEVICE if device else HIERARCHICAL_MIN_NODES_ENCODED
    if device and (shape is None or sparse_hierarchical.applies_to_shape(*shape, x.size, comp)):
        return HIERARCHICAL_MIN_NODES_SPARSE_DEVICE
    return HIERARCHICAL_MIN_NODES_COMPRESSED


def _may_help(t: Transport, x: Array, comp: Any | None) -> bool:
    """Whether "auto" considers the two-level allreduce for ``x`` at all (no exchange)."""
    if comp is not None and not comp.shardable:
        return False
    if comp is None and t.follows_nodes_on_device and _ops.is_device_array(x):
        return False
    if t.size < 2 * min_nodes(comp, x):  # that many nodes of at least two ranks
        return False
    if comp is None or isinstance(comp, DenseCompressor):
        return x.nbytes >= HIERARCHICAL_MIN_BYTES
    return True  # sparse: the node count decides


def _forward_failure(sub: Transport, parent: Transport) -> None:
    """Fail ``parent`` with the error that failed ``sub`` (its node-local or cross-node
    group): a wait there that timed out left requests posted on some ranks, and the
    communicator over ``parent`` must refuse every later call, as for its own timeouts."""
    if sub.failure is not None:
        parent.fail(sub.failure)
