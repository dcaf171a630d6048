"""Markdown and PNG of bench/scale_sim.py's results."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["plot", "report"]

_LOG = logging.getLogger("scale_sim")


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _errors(rows: list[dict[str, Any]]) -> list[str]:
    ns = sorted({r["n"] for r in rows})
    out = ["| n | int8 flat | int8 hierarchical | top-k 0.01 flat | top-k 0.01 hierarchical "
           "| results identical on every rank |", "| ---: | ---: | ---: | ---: | ---: | :---: |"]
    for n in ns:
        at = {(r["variant"], r["algorithm"]): r for r in rows if r["n"] == n}
        cells = [f"{at[(v, a)]['relerr']:.3e}" if (v, a) in at else "-"
                 for v in ("int8", "topk") for a in ("flat", "hierarchical")]
        same = all(r["identical"] for r in at.values())
        out.append(f"| {n} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    return out


def _times(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| GPUs | NIC | variant | flat (ms) | hierarchical (ms) | lower bound (ms) | source "
           "| closed form / simulated |",
           "| ---: | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    keys = sorted({(r["n"], r["nic_gbit"], r["variant"]) for r in rows},
                  key=lambda k: (k[0], -k[1], ["dense", "int8", "topk"].index(k[2])))
    for n, nic, variant in keys:
        at = {r["algorithm"]: r for r in rows
              if (r["n"], r["nic_gbit"], r["variant"]) == (n, nic, variant)}
        flat, hier = at.get("flat"), at.get("hierarchical")
        ref = flat or hier
        bound = _ms(ref["bound_s"]) if variant == "dense" else "-"
        source = ref["source"]
        checks = [f"{r['computed_s'] / r['time_s']:.2f}" for r in (flat, hier)
                  if r is not None and "computed_s" in r]
        out.append(f"| {n} | {nic:g} Gbit/s | {variant} | {_ms(flat and flat['time_s'])} | "
                   f"{_ms(hier and hier['time_s'])} | {bound} | {source} | "
                   f"{' / '.join(checks) or '-'} |")
    return out


def _validation_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per measured set and variant: the range of model / measured, and how many within 15%."""
    out = ["| cluster | variant | sizes | model / measured | within 15% |",
           "| --- | --- | ---: | --- | ---: |"]
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["compression"]), []).append(r["ratio"])
    for (source, variant), ratios in groups.items():
        near = sum(abs(x - 1) <= 0.15 for x in ratios)
        out.append(f"| {source} | {variant} | {len(ratios)} | {min(ratios):.2f} to "
                   f"{max(ratios):.2f} | {near} of {len(ratios)} |")
    return out


def _validation(val: dict[str, Any]) -> list[str]:
    out = [*_validation_summary(val["rows"]), "", "Every row:", "",
           "| cluster | variant | size | measured (ms) | model (ms) | model / measured |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in val["rows"]:
        out.append(f"| {r['source']} | {r['compression']} | {r['size'] >> 20} MiB | "
                   f"{_ms(r['measured_s'])} | {_ms(r['model_s'])} | {r['ratio']:.2f} |")
    for m in val["missing"]:
        out.append(f"\nMissing: {m}.")
    return out


def report(res: dict[str, Any]) -> str:
    """The Markdown report."""
    meta = res["meta"]
    links = meta["links"]
    lines = [
        "# ringcomm at scale, simulated",
        "",
        f"`{meta['command']}`, {meta['wall_s']:.0f} s on {meta['machine']} (Python "
        f"{meta['python']}). ringcomm's real algorithms ran on thread ranks over the "
        "simulated-clock transport (bench/sim_transport.py); every figure marked *simulated* "
        "is the virtual time of such a run, *computed* figures are the closed forms of "
        "bench/sim_formulas.py on the same model, nothing here was measured on a GPU cluster.",
        "",
        "Model: 8 ranks per node; NVLink-like intra-node links "
        f"{links['intra_bw'] / 1e9:g} GB/s per direction per rank, {links['intra_alpha'] * 1e6:g}"
        f" us per message; one NIC per node ({links['nic_gbit']} Gbit/s per direction, "
        f"{links['inter_alpha'] * 1e6:g} us per message) shared by its ranks, first come "
        "first served in virtual time. Compute: "
        f"{meta['cost_source']}. Each rank holds {meta['length']} real float32 elements "
        f"standing for 1 GiB (scale {meta['scale']:g}); segments of 2 MiB of the real job.",
        "",
        "## (a) relative error of one allreduce step against n",
        "",
        "Synthetic gradients (shared part plus per-rank noise, lognormal magnitude per block "
        "of 256; bench/scale_sim_jobs.py), error feedback residual zero before the call; "
        "error = ||result - exact|| / ||exact|| against the float64 sum of the real arrays.",
        "",
        *_errors(res["errors"]),
        "",
        "## (b) projected time of an allreduce of 1 GiB of float32 gradients",
        "",
        "Lower bound (dense, alpha-beta): every node's NIC must send and receive "
        "2(N-1)/N * S bytes and the last contribution needs ceil(log2 N) inter-node "
        "latencies: T >= 2(N-1)/N * S / B_nic + ceil(log2 N) * alpha_nic (N nodes, S = 1 GiB).",
        "The last column, where a case was simulated, is the closed form over the simulation "
        "(how far the extrapolation's formulas are off where both exist).",
        "",
        *_times(res["times"]),
        "",
        "## (c) validation: the model with the emulated cluster's parameters",
        "",
        "Parameters (assumptions named in bench/scale_sim_validate.py): "
        f"{res['validation']['parameters']}. Target: within 15%. No parameter was fitted to "
        "these measurements. A ratio well below 1 means the measured run took longer than its "
        "links and codecs allow: something the model leaves out (the host's TCP stack and "
        "loopback on 2 shared cores, other jobs on the machine) bounded it. Only the 1 Gbit/s "
        "runs are compared: at 10 Gbit/s the emulated clusters are bound by the host's TCP "
        "stack, which the model leaves out.",
        "",
        *_validation(res["validation"]),
        "",
    ]
    return "\n".join(lines)


def _rank_axis(ax: Any, ns: list[int]) -> None:
    """A base-2 log axis with a labelled tick at every rank count."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()


def plot(res: dict[str, Any], path: Path) -> None:
    """Error against n (left) and projected time against GPUs (right), or nothing without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _LOG.warning("matplotlib is not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
    for variant in ("int8", "topk"):
        for algo, style in (("flat", "-o"), ("hierarchical", "--s")):
            rows = sorted((r for r in res["errors"]
                           if r["variant"] == variant and r["algorithm"] == algo),
                          key=lambda r: r["n"])
            ax1.plot([r["n"] for r in rows], [r["relerr"] for r in rows], style,
                     label=f"{variant} {algo}")
    ax1.set(yscale="log", xlabel="ranks", ylabel="relative error, one step",
            title="(a) error of one compressed allreduce")
    _rank_axis(ax1, sorted({r["n"] for r in res["errors"]}))
    ax1.legend(fontsize=8)
    for nic in (400.0, 100.0):
        for variant in ("dense", "int8"):
            for algo, style in (("flat", "-o"), ("hierarchical", "--s")):
                rows = sorted((r for r in res["times"] if r["nic_gbit"] == nic
                               and r["variant"] == variant and r["algorithm"] == algo),
                              key=lambda r: r["n"])
                ax2.plot([r["n"] for r in rows], [r["time_s"] * 1e3 for r in rows],
                         style, label=f"{variant} {algo} {nic:g}G")
                computed = [r for r in rows if r["source"] == "computed"]
                ax2.plot([r["n"] for r in computed], [r["time_s"] * 1e3 for r in computed],
                         style[-1], color="white", markersize=3, linestyle="none")
        bound = sorted((r for r in res["times"] if r["nic_gbit"] == nic
                        and r["variant"] == "dense" and r["algorithm"] == "flat"),
                       key=lambda r: r["n"])
        ax2.plot([r["n"] for r in bound], [r["bound_s"] * 1e3 for r in bound], ":k",
                 label=f"dense lower bound {nic:g}G")
    _rank_axis(ax2, sorted({r["n"] for r in res["times"]}))
    ax2.set(yscale="log", xlabel="GPUs (8 per node)", ylabel="ms",
            title="(b) 1 GiB allreduce (filled: simulated, hollow: computed)")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
