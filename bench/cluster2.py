"""Flat against hierarchical allreduce on an emulated two-level cluster, in one command.

    sudo .venv/bin/python bench/cluster2.py --nodes 2 --ranks-per-node 2

For every NIC rate it builds one network namespace per node (bench/netns.py), each with its own
host name and one tbf-shaped NIC to a bridge; the ranks of a node share its namespace and talk
over its loopback (TCP, fast, unshaped) or, with --intra shm, through MPICH's shared memory
(one Hydra proxy per node, as on a real cluster); ranks of different nodes through the NICs.
It checks that every rank sees its node's host name, and, with one dense allreduce job per
algorithm, that the cross-node bytes crossed the NICs and the intra-node bytes did not (tc's
and the loopback's byte counters against the ring's traffic model). Then
bench/allreduce_perf.py times, interleaved in one job, the flat and hierarchical allreduce,
dense, int8 and top-k, and MPI's own Allreduce; this script writes the time, the speed-up over
the flat dense ring and the relative error of one compressed step to --out as JSON, Markdown and
PNG. Everything it creates is removed on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import run_in_cluster
from netns import TBF_LATENCY, Cluster, ClusterError, load_average, parse_rate, preflight, tbf_burst

ROOT = Path(__file__).resolve().parent.parent
FLAT = ("none", "int8", "topk:0.01")
PREFIX = "rchier"  # apart from bench/netns.py's default, which other benchmarks use
# rank 0 prints every rank's host name (the ranks' own lines could interleave)
HOSTS_PROBE = ("import socket; from mpi4py import MPI; "
               "names = MPI.COMM_WORLD.gather(socket.gethostname()); "
               "[print(f'rank {r} host {h}') for r, h in enumerate(names or [])]")
__all__ = ["hierarchical_available", "main", "traffic_model", "variants"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rates", default="1gbit,10gbit", help="comma list of NIC rates")
    p.add_argument("--intra", default="tcp,shm",
                   help="comma list of how ranks of one node talk: tcp (over the node's "
                        "loopback) or shm (MPICH's shared memory, one proxy per node)")
    p.add_argument("-b", "--minbytes", default="1M")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", default="4")
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup", type=int, default=1)
    p.add_argument("--variants", default=None,
                   help="allreduce_perf --compression list (default: none, int8, topk:0.01, "
                        "each flat and @hier where the hierarchical algorithm exists)")
    p.add_argument("--traffic-bytes", default="16M",
                   help="size of the traffic-check jobs (above RINGCOMM_MPI_ALLREDUCE_BYTES, "
                        "or MPI's own allreduce runs instead of the ring)")
    p.add_argument("--phases", type=int, default=0, metavar="CALLS",
                   help="also time the phases of every variant over CALLS more calls "
                        "(allreduce_perf --phases; in the JSON)")
    p.add_argument("--prefix", default=PREFIX, help="namespace name prefix")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster2"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    return p.parse_args(argv)


def hierarchical_available() -> bool:
    """Whether ``Communicator.allreduce`` takes ``algorithm=`` (the hierarchical allreduce)."""
    try:
        from ringcomm.comm.base import Communicator
    except ImportError:
        return False
    return "algorithm" in inspect.signature(Communicator.allreduce).parameters


def variants(spec: str | None, hierarchical: bool) -> list[str]:
    """The variant labels to time: ``spec``'s, or the flat ones and (if available) their
    hierarchical twins."""
    if spec:
        return [v.strip() for v in spec.split(",") if v.strip()]
    out = []
    for name in FLAT:
        # explicit "@flat": the library's default ("auto") may itself go two-level
        out += [f"{name}@flat", f"{name}@hier"] if hierarchical else [name]
    return out


def _flat_row(rows: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The flat variant of compression ``name`` among ``rows`` (by label)."""
    return rows.get(f"{name}@flat") or rows.get(name)


def traffic_model(nodes: int, per_node: int, size: int, algorithm: str) -> dict[str, float]:
    """Bytes a node's NIC and its loopback carry in one dense allreduce of ``size`` bytes.

    Flat ring over ranks in order: each node has one outgoing cross-node edge and per_node - 1
    local ones, every edge carrying 2(n-1)/n of the array. Two-level ring: a reduce-scatter and
    an allgather inside the node (each rank sends 2(p-1)/p of the array), and across nodes a ring
    over the node's share per local rank (2(N-1)/N of size / p each, p ranks).
    """
    n = nodes * per_node
    if algorithm == "flat":
        edge = 2 * (n - 1) / n * size
        return {"nic": edge if nodes > 1 else 0.0, "local": (per_node - 1) * edge}
    return {"nic": 2 * (nodes - 1) / nodes * size,
            "local": per_node * 2 * (per_node - 1) / per_node * size}


def hosts_seen(cluster: Cluster, timeout: float) -> dict[str, Any]:
    """The host name every rank reports, against the one its node should have."""
    text = run_in_cluster(cluster, ["-c", HOSTS_PROBE], timeout)
    seen = {int(r): host for r, host in re.findall(r"rank (\d+) host (\S+)", text)}
    expected = {r: cluster.hostname(r) for r in range(cluster.n)}
    return {"hosts": [seen.get(r) for r in range(cluster.n)],
            "hosts_ok": seen == expected}


def traffic_check(cluster: Cluster, variant: str, args: argparse.Namespace,
                  scratch: Path) -> dict[str, Any]:
    """One dense job of ``variant``: the NIC and loopback bytes per node and call, measured
    and modelled."""
    from ringcomm.perf.options import parse_size

    size = parse_size(args.traffic_bytes)
    json_path = scratch / "traffic.json"
    iters = 2
    nic0, lo0 = cluster.tx_bytes(), cluster.local_bytes()
    run_in_cluster(cluster, [
        "bench/allreduce_perf.py", "-b", str(size), "-e", str(size), "-n", str(iters), "-w", "0",
        "-c", "0", "--compression", variant, "--baseline", "none", "--no-memcpy", "--no-inplace",
        "--json", str(json_path)], args.timeout)
    nic = [b - a for a, b in zip(nic0, cluster.tx_bytes(), strict=True)]
    lo = [b - a for a, b in zip(lo0, cluster.local_bytes(), strict=True)]
    calls = iters + 1  # the timed calls, and one more that counts the wire bytes
    algorithm = "hierarchical" if "@hier" in variant else "flat"
    model = traffic_model(cluster.nodes, cluster.ranks_per_node, size, algorithm)
    if cluster.intra == "shm":
        model["local"] = 0.0  # shared memory: neither the NIC nor the loopback
    nic_call = max(nic) / calls
    lo_call = max(lo) / calls if cluster.intra == "shm" else min(lo) / calls
    stayed = lo_call >= model["local"] if model["local"] else lo_call < 0.01 * size
    return {"variant": variant, "size": size, "calls": calls, "nic_bytes": nic, "lo_bytes": lo,
            "nic_bytes_per_call": nic_call, "lo_bytes_per_call": lo_call,
            "model_nic_bytes_per_call": model["nic"], "model_lo_bytes_per_call": model["local"],
            # headers and acknowledgements add a few per cent; a local edge that went through
            # the NIC would add a whole edge's bytes
            "nic_as_modelled": model["nic"] <= nic_call <= 1.15 * model["nic"],
            "local_stayed_local": stayed}


def bench_rate(rate: str, intra: str, args: argparse.Namespace, out: Path, names: list[str],
               scratch: Path) -> dict[str, Any]:
    """Host names, traffic checks and the timed allreduce_perf job at one NIC rate, with the
    ranks of a node talking by ``intra`` ("tcp" or "shm")."""
    tag = f"{args.nodes}x{args.ranks_per_node}_{intra}_{rate}"
    json_path, png_path = out / f"allreduce_{tag}.json", out / f"allreduce_{tag}.png"
    n = args.nodes * args.ranks_per_node
    with Cluster(n, rate, prefix=args.prefix, ranks_per_node=args.ranks_per_node,
                 intra=intra) as cluster:
        hosts = hosts_seen(cluster, args.timeout)
        dense = [v for v in names if v.partition("@")[0] == "none"][:2]
        traffic = [traffic_check(cluster, v, args, scratch) for v in dense]
        text = run_in_cluster(cluster, [
            "bench/allreduce_perf.py", "-b", args.minbytes, "-e", args.maxbytes,
            "-f", args.stepfactor, "-n", str(args.iters), "-w", str(args.warmup),
            "--compression", ",".join(names), "--baseline", "mpi", "--no-memcpy", "--no-inplace",
            "--phases", str(args.phases), "--json", str(json_path), "--plot", str(png_path),
            "--title", f"allreduce, {args.nodes} nodes x {args.ranks_per_node} ranks, "
                       f"NICs {rate}, intra-node {intra}"], args.timeout)
    print(text, flush=True)
    data = json.loads(json_path.read_text())
    return {"rate": rate, "intra": intra, "link": link(rate, intra), **hosts, "traffic": traffic,
            "median_time_s": medians(data["rows"]), "rows": data["rows"],
            "machine": data["meta"]["machine"], "segment_bytes": data["meta"]["segment_bytes"]}


def link(rate: str, intra: str) -> dict[str, Any]:
    """The NIC's shaping, as built, and how ranks of one node talk."""
    local = "TCP over loopback, unshaped" if intra == "tcp" else "MPICH shared memory"
    return {"rate": rate, "bits_per_s": parse_rate(rate), "qdisc": "tbf", "both_ends": True,
            "burst_bytes": tbf_burst(rate), "latency": TBF_LATENCY, "intra_node": local}


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{variant: {size: median seconds}}, MPI's Allreduce as variant "mpi"."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        out.setdefault(r["compression"], {})[str(r["size"])] = r["time_us"] / 1e6
        if r.get("mpi_time_us"):
            out.setdefault("mpi", {})[str(r["size"])] = r["mpi_time_us"] / 1e6
    return out


def targets(res: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Hierarchical against flat, per compression, at ``size``: speed-up and error."""
    rows = {r["compression"]: r for r in res["rows"] if r["size"] == size}
    out = []
    for name in FLAT:
        flat, hier = _flat_row(rows, name), rows.get(f"{name}@hier")
        if not flat or not hier:
            continue
        item = {"compression": name, "size": size,
                "speedup": flat["time_us"] / hier["time_us"], "target_speedup": 1.35}
        item["speedup_met"] = item["speedup"] >= 1.35
        if "relerr" in flat and "relerr" in hier:
            item.update(relerr_flat=flat["relerr"], relerr_hier=hier["relerr"],
                        relerr_lower=hier["relerr"] < flat["relerr"])
        out.append(item)
    return out


def link_bound(res: dict[str, Any], size: int, nodes: int, per_node: int) -> list[dict[str, Any]]:
    """For each dense ring variant at ``size``: the time its busiest NIC needs at line rate
    (the traffic model's bytes) against the time measured; a share near 1 means the link, not
    the CPU, bounded the call."""
    bits = res["link"]["bits_per_s"]
    out = []
    for r in res["rows"]:
        name, _, alg = r["compression"].partition("@")
        if r["size"] != size or name != "none" or not bits:
            continue
        algorithm = "hierarchical" if alg.startswith("hier") else "flat"
        nic = traffic_model(nodes, per_node, size, algorithm)["nic"]
        wire_s = nic / (bits / 8)
        out.append({"variant": r["compression"], "size": size, "model_nic_bytes": nic,
                    "link_time_s": wire_s, "measured_s": r["time_us"] / 1e6,
                    "link_share": wire_s / (r["time_us"] / 1e6)})
    return out


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def time_table(res: dict[str, Any]) -> list[str]:
    """Markdown: every variant's time, its speed-up over the flat dense ring and its error."""
    rows = res["rows"]
    names = list(dict.fromkeys(r["compression"] for r in rows))
    lines = ["| size | MPI Allreduce | " + " | ".join(names) + " |",
             "|" + " --- |" * (len(names) + 2)]
    for size in sorted({r["size"] for r in rows}):
        at = {r["compression"]: r for r in rows if r["size"] == size}
        ref = _flat_row(at, "none")
        dense = ref["time_us"] if ref else None
        cells = [at[names[0]].get("mpi_time_us")] + [at[k]["time_us"] for k in names]
        text = [f"{t / 1e3:.1f} ms" + (f" ({dense / t:.2f}x)" if dense else "")
                if t else "-" for t in cells]
        for i, k in enumerate(names, start=1):
            if "relerr" in at[k]:
                text[i] += f", err {at[k]['relerr']:.2e}"
        lines.append(f"| {_label(size)} | " + " | ".join(text) + " |")
    return lines


def traffic_table(res: dict[str, Any]) -> list[str]:
    """Markdown: bytes per call on the busiest NIC and the least busy loopback, measured and
    modelled."""
    lines = ["| dense job | size | NIC bytes/call (model) | loopback bytes/call (model) | "
             "NIC as modelled | local stayed local |", "|" + " --- |" * 6]
    for t in res["traffic"]:
        lines.append(
            f"| {t['variant']} | {_label(t['size'])} | {t['nic_bytes_per_call'] / 2**20:.1f} MiB "
            f"({t['model_nic_bytes_per_call'] / 2**20:.1f}) | "
            f"{t['lo_bytes_per_call'] / 2**20:.1f} MiB ({t['model_lo_bytes_per_call'] / 2**20:.1f})"
            f" | {t['nic_as_modelled']} | {t['local_stayed_local']} |")
    return lines


def target_lines(res: dict[str, Any]) -> list[str]:
    """Markdown: hierarchical over flat at the largest size, against the 1.35x target."""
    out = []
    for t in res["targets"]:
        line = (f"- {t['compression']}: hierarchical {t['speedup']:.2f}x flat "
                f"(target >= {t['target_speedup']}: {'met' if t['speedup_met'] else 'NOT met'})")
        if "relerr_hier" in t:
            line += (f"; one-step error {t['relerr_hier']:.2e} against flat's "
                     f"{t['relerr_flat']:.2e} ({'lower' if t['relerr_lower'] else 'NOT lower'})")
        out.append(line)
    out = out or ["- no hierarchical variant timed"]
    for b in res.get("link_bound", []):
        out.append(f"- {b['variant']}: {b['measured_s'] * 1e3:.0f} ms measured, "
                   f"{b['link_time_s'] * 1e3:.0f} ms for its busiest NIC's "
                   f"{b['model_nic_bytes'] / 2**20:.0f} MiB at line rate "
                   f"(link share {b['link_share']:.2f})")
    return out


def report(results: list[dict[str, Any]], args: argparse.Namespace,
           meta: dict[str, Any]) -> str:
    """The whole Markdown page."""
    m = meta["machine"]
    lines = [f"# allreduce, {args.nodes} nodes x {args.ranks_per_node} ranks, emulated",
             "", f"Machine: {m.get('cpu')}; {m.get('mpi')}; {m.get('platform')}. "
             f"Load average before: {meta['load_before']}, after: {meta['load_after']}.",
             f"Every node is a network namespace with its own host name and one NIC (veth, "
             f"tc tbf at the rate below, both ends, latency {TBF_LATENCY}) to a bridge; ranks "
             "of one node talk over its loopback (TCP, unshaped) or through MPICH's shared "
             "memory (one Hydra proxy per node), as each section says. Between nodes MPICH "
             f"talks TCP (ofi). {args.iters} timed iterations (median of the slowest rank), "
             f"{args.warmup} warm-up, variants interleaved; err = relative error of one step "
             "against the float64 sum.", ""]
    for res in results:
        lines += [f"## NICs {res['rate']}, intra-node {res['link']['intra_node']}", "",
                  f"Host names seen by ranks 0..{len(res['hosts']) - 1}: "
                  f"{', '.join(map(str, res['hosts']))} ({'ok' if res['hosts_ok'] else 'WRONG'})",
                  "", *traffic_table(res), "", *time_table(res), "",
                  f"Hierarchical against flat at {_label(res['targets'][0]['size'])}:"
                  if res["targets"] else "", *target_lines(res), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preflight()
    except ClusterError as err:
        print(f"cluster2: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hierarchical = hierarchical_available()
    names = variants(args.variants, hierarchical)
    start, load_before = time.monotonic(), load_average()
    scratch = out / f".scratch{args.nodes}x{args.ranks_per_node}"
    scratch.mkdir(exist_ok=True)
    try:
        results = [bench_rate(rate, intra, args, out, names, scratch)
                   for intra in args.intra.split(",") for rate in args.rates.split(",")]
    finally:
        for path in scratch.glob("*"):
            path.unlink()
        scratch.rmdir()
    for res in results:
        largest = max(r["size"] for r in res["rows"])
        res["targets"] = targets(res, largest)
        res["link_bound"] = link_bound(res, largest, args.nodes, args.ranks_per_node)
    meta = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
            "hierarchical_available": hierarchical, "variants": names,
            "machine": results[0]["machine"], "load_before": load_before,
            "load_after": load_average(), "iters": args.iters, "warmup": args.warmup,
            "wall_s": time.monotonic() - start}
    tag = f"{args.nodes}x{args.ranks_per_node}"
    text = report(results, args, meta)
    (out / f"cluster2_{tag}.md").write_text(text + "\n")
    (out / f"cluster2_{tag}.json").write_text(json.dumps({"meta": meta, "results": results},
                                                        indent=1))
    print(text)
    print(f"\n# done in {meta['wall_s']:.0f} s; tables and plots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
