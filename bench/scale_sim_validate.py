"""Part (c) of bench/scale_sim.py: the simulator with the emulated cluster's parameters against
the times measured there (bench/results/cluster/, and bench/results/cluster2/ where present).

The emulated clusters (bench/netns.py) shape every rank's or node's link with tc tbf at
1 Gbit/s in each direction and run MPI over TCP on a 2-core machine. The model's parameters:

- link: 1 Gbit/s per direction, one "node" (NIC) per network namespace; payload efficiency
  1448 / 1514 (TCP with timestamps in a 1514-byte Ethernet frame, which tbf counts);
- per-message cost ``TCP_ALPHA`` (an assumption for MPI over TCP through veth and a bridge);
- ranks of one namespace in cluster2 talk over loopback TCP or MPICH's shared memory, with
  the bandwidth and per-message cost of ``INTRA`` (assumptions, not measured);
- compute: the CPU codec benchmark's rates (bench/results/codecs_perf.json) times the ranks per
  core (``slowdown``: 4 ranks share 2 cores, and MPICH's waiting ranks poll);
- every call first exchanges the Communicator's small agreement header (one allgather).

Only the 1 Gbit/s runs are compared: at 10 Gbit/s and unshaped the measured dense ring is
bound by the host's TCP stack on 2 cores (bench/results/cluster/cluster.md says so), which
the model does not include.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from scale_sim_jobs import Job, run_job
from sim_costs import cpu_costs
from sim_model import LinkModel
from sim_transport import run_sim

import ringcomm
from ringcomm.codecs.base import Compressor

__all__ = ["INTRA", "TCP_ALPHA", "parse_variant", "validate"]

RESULTS = Path(__file__).resolve().parent / "results"
TCP_ALPHA = 50e-6
TCP_EFFICIENCY = 1448 / 1514
#: Intra-node (bytes per second, seconds per message) of cluster2's "tcp" (loopback) and "shm"
#: (MPICH shared memory) variants: assumptions.
INTRA = {"tcp": (2e9, 20e-6), "shm": (5e9, 5e-6)}
CORES = 2
#: Real float32 elements per rank; larger measured sizes are stood for by scaling.
LENGTH = 1 << 18


def parse_variant(label: str) -> tuple[Compressor | None, bool]:
    """allreduce_perf's compression label ("int8", "topk:0.01:allgather", "none@hier") as a
    compressor (None: dense) and whether it is hierarchical."""
    name, _, algo = label.partition("@")
    parts = name.split(":")
    if parts[0] == "none":
        comp = None
    elif parts[0] == "fp16":
        comp = ringcomm.FP16()
    elif parts[0] == "int8":
        comp = ringcomm.Int8()
    elif parts[0] == "topk":
        comp = ringcomm.TopK(float(parts[1]), *(parts[2:3] or ["ring"]))
    else:
        raise ValueError(f"no model for compression {label!r}")
    return comp, algo.startswith("hier")


def _model_time(n: int, per_node: int, size: int, label: str, intra: str) -> float:
    comp, hier = parse_variant(label)
    scale = size / (4 * LENGTH)
    intra_bw, intra_alpha = INTRA[intra]
    links = LinkModel(ranks_per_node=per_node, intra_bw=intra_bw, intra_alpha=intra_alpha,
                      inter_bw=1e9 / 8, inter_alpha=TCP_ALPHA, scale=scale,
                      efficiency=TCP_EFFICIENCY)
    cost = cpu_costs(slowdown=n / CORES)
    cost.scale = scale
    job = Job(LENGTH, comp, hier, segment_bytes=max(1, int((2 << 20) / scale)), agreement=True)
    sim = run_sim(n, lambda t: run_job(job, t), links, cost)
    return max(r["time"] for r in sim.results)


def _compare(rows: list[dict[str, Any]], n: int, per_node: int, source: str,
             labels: set[str] | None, intra: str = "tcp") -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if labels is not None and r["compression"] not in labels:
            continue
        try:
            model = _model_time(n, per_node, r["size"], r["compression"], intra)
        except ValueError:
            continue  # a compressor the model does not cover (auto)
        measured = r["time_us"] * 1e-6
        out.append({"source": source, "n": n, "ranks_per_node": per_node, "size": r["size"],
                    "compression": r["compression"], "measured_s": measured,
                    "model_s": model, "ratio": model / measured})
        print(f"  {source} {r['compression']:22s} {r['size'] >> 20:3d} MiB: model "
              f"{model * 1e3:8.2f} ms, measured {measured * 1e3:8.2f} ms, ratio "
              f"{model / measured:.2f}", flush=True)
    return out


def _cluster(quick: bool) -> list[dict[str, Any]]:
    data = json.loads((RESULTS / "cluster" / "cluster.json").read_text())
    rows = next(r["rows"] for r in data["results"] if r["rate"] == "1gbit")
    labels = {"none", "int8", "topk:0.01"} if quick else None
    return _compare(rows, 4, 1, "cluster 4x1 1gbit", labels)


_TAG = re.compile(r"allreduce_(\d+)x(\d+)_(tcp|shm)_(\d+gbit)\.json$")


def _cluster2(quick: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Every allreduce_<nodes>x<ranks>_..._1gbit.json that bench/cluster2.py left."""
    found = sorted(p for p in (RESULTS / "cluster2").glob("allreduce_*.json")
                   if _TAG.search(p.name))
    out: list[dict[str, Any]] = []
    labels = {"none@flat", "none@hier", "int8@flat", "int8@hier"} if quick else None
    for path in found:
        nodes, per_node, intra, rate = _TAG.search(path.name).groups()
        if rate != "1gbit":
            continue
        rows = json.loads(path.read_text())["rows"]
        n = int(nodes) * int(per_node)
        out += _compare(rows, n, int(per_node), f"cluster2 {path.stem[10:]}", labels, intra)
    return out, [p.name for p in found]


def validate(quick: bool = False) -> dict[str, Any]:
    """Model against measurement: every row with its ratio, and what was missing."""
    print("(c) validation against the emulated clusters", flush=True)
    rows = _cluster(quick)
    rows2, files = _cluster2(quick)
    missing = [] if files else ["bench/results/cluster2/ (no allreduce_<N>x<R>_*.json)"]
    return {"rows": rows + rows2, "cluster2_files": files, "missing": missing,
            "parameters": {"tcp_alpha_s": TCP_ALPHA, "tcp_efficiency": TCP_EFFICIENCY,
                           "cluster2_intra_bw_alpha": INTRA,
                           "cores": CORES, "length": LENGTH,
                           "cost_source": cpu_costs(slowdown=4 / CORES).source}}
