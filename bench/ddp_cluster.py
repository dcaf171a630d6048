"""PyTorch DDP training over an emulated cluster of shaped links: gradient hooks compared.

    sudo .venv/bin/python bench/ddp_cluster.py                 # 4 ranks; 1 and 10 Gbit/s
    sudo .venv/bin/python bench/ddp_cluster.py --quick         # one rate, two variants, 2 ranks

For every link rate it builds one network namespace per rank joined by a bridge (bench/netns.py,
tc tbf on both ends of every link) and runs one mpiexec job per variant
(bench/ddp_cluster_worker.py): MPICH and torch.distributed's gloo both talk TCP over the shaped
links. Each job trains the same wide MLP (about 16.6 MiB of float32 gradients) on scikit-learn's
digits with the same batches; only DDP's gradient path differs: DDP's own gloo allreduce,
PyTorch's fp16 and PowerSGD (rank 1) hooks, and ringcomm's hook dense, Int8, TopK(0.01),
auto and PowerSGD rank 1 (on DDP's default buckets). Reported per variant: the median step
time of the slowest rank (after warm-up), the bytes each rank's link sent per step, the final
test accuracy and test accuracy against cumulative training time. A variant that fails or
runs past --timeout is reported as failed and the others still run. Everything the cluster
creates is removed on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import run_in_cluster
from netns import PREFIX, Cluster, ClusterError, load_average, parse_rate, preflight

__all__ = ["VARIANTS", "main", "markdown_table", "slowest_rank_median", "summarize"]

ROOT = Path(__file__).resolve().parent.parent
WORKER = "bench/ddp_cluster_worker.py"
#: variant -> how the tables name it (the worker builds each one).
VARIANTS = {
    "ddp": "DDP default (gloo allreduce)",
    "fp16": "PyTorch fp16_compress_hook",
    "powersgd": "PyTorch PowerSGD rank 1 (one bucket)",
    "ringcomm": "ringcomm dense",
    "ringcomm-int8": "ringcomm Int8",
    "ringcomm-topk": "ringcomm TopK(0.01)",
    "ringcomm-auto": "ringcomm auto",
    "ringcomm-powersgd": "ringcomm PowerSGD rank 1 (DDP's buckets)",
    "ringcomm-powersgd-gloo": "ringcomm PowerSGD rank 1 (DDP's buckets), over gloo",
    "backend": "DDP on the \"ringcomm\" torch.distributed backend (no hook)",
    "fsdp": "FSDP2 (fully_shard per layer) on gloo",
    "fsdp-backend": "FSDP2 (fully_shard per layer) on the \"ringcomm\" backend",
    "fsdp-grad-op": "FSDP2, parameters kept after forward, on gloo",
    "fsdp-grad-op-backend": "FSDP2, parameters kept after forward, on the \"ringcomm\" backend",
    "local": "no communication (compute floor)",
}
DEFAULT_VARIANTS = ("ddp,fp16,powersgd,ringcomm,ringcomm-int8,ringcomm-topk,ringcomm-auto,"
                    "ringcomm-powersgd")
QUICK = {"rates": "10gbit", "variants": "ddp,ringcomm-int8", "ranks": 2, "steps": 8,
         "warmup": 3, "timeout": 120.0}
_LOG = logging.getLogger("ddp_cluster")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rates", default="1gbit,10gbit", help="comma list; none = unshaped")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=176, help="training steps per variant")
    p.add_argument("-w", "--warmup", type=int, default=5,
                   help="first steps left out of the median step time")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--hidden", type=int, default=2048, help="width of the two hidden layers")
    p.add_argument("--profile", action="store_true",
                   help="where time goes: an MPI barrier before every hook (its wait timed "
                        "apart) and ringcomm's traced phases; changes the step times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "ddp_cluster"))
    p.add_argument("--prefix", default=PREFIX,
                   help="name prefix of the cluster's network namespaces (a cluster removes "
                        "stale namespaces of its prefix: give concurrent runs different ones)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK['rates']}, {QUICK['variants']}, "
                        f"{QUICK['ranks']} ranks, {QUICK['steps']} steps (overrides those flags)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"need 0 <= warmup < steps, got warmup {args.warmup} and steps {args.steps}")
    for rate in args.rates.split(","):
        try:
            parse_rate(rate)
        except ValueError as err:
            p.error(str(err))
    return args


# ------------------------------------------------------------------ pure helpers (unit-tested)
def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest value over the ranks (every rank must have the same step count)."""
    if not per_rank or len({len(r) for r in per_rank}) != 1:
        raise ValueError(f"expected equally long per-rank series, got lengths "
                         f"{[len(r) for r in per_rank]}")
    return [max(step) for step in zip(*per_rank, strict=True)]


def slowest_rank_median(per_rank: Sequence[Sequence[float]], warmup: int) -> float:
    """Median over the steps after ``warmup`` of each step's slowest rank."""
    steps = slowest_rank(per_rank)[warmup:]
    if not steps:
        raise ValueError(f"no steps left after a warm-up of {warmup}")
    return statistics.median(steps)


def mean_after_warmup(per_rank: Sequence[Sequence[float]], warmup: int) -> float:
    """Mean over ranks and steps after ``warmup`` (bytes per step and rank)."""
    values = [v for r in per_rank for v in r[warmup:]]
    return statistics.fmean(values) if values else 0.0


def time_to_accuracy(epochs: Sequence[dict[str, Any]],
                     epoch_train_s: Sequence[Sequence[float]]) -> list[list[float]]:
    """[cumulative training seconds, test accuracy] after each epoch; an epoch's time is its
    slowest rank's."""
    elapsed, curve = 0.0, []
    for epoch, seconds in zip(epochs, slowest_rank(epoch_train_s), strict=True):
        elapsed += seconds
        curve.append([elapsed, epoch["test_accuracy"]])
    return curve


def summarize(raw: dict[str, Any], warmup: int) -> dict[str, Any]:
    """The figures of one variant's run from the worker's raw per-rank JSON."""
    ranks = raw["per_rank"]
    steps = [r["step_s"] for r in ranks]
    slowest = slowest_rank(steps)
    worst = max(range(len(slowest)), key=slowest.__getitem__)
    return {
        "median_step_ms": 1e3 * slowest_rank_median(steps, warmup),
        "worst_step": [worst, 1e3 * slowest[worst]],
        "median_hook_ms": phase_ms(ranks, "hook", warmup),
        "bytes_per_step_rank": mean_after_warmup([r["tx_bytes"] for r in ranks], warmup),
        "ringcomm_bytes_per_step_rank": mean_after_warmup(
            [r["ringcomm_bytes"] for r in ranks], warmup),
        "final_accuracy": raw["epochs"][-1]["test_accuracy"],
        "time_to_accuracy": time_to_accuracy(raw["epochs"],
                                             [r["epoch_train_s"] for r in ranks]),
        "phase_ms": {label: phase_ms(ranks, label, warmup) for label in sorted(
            {k for r in ranks for step in r["phase_s"] for k in step})},
    }


def phase_ms(ranks: Sequence[dict[str, Any]], label: str, warmup: int) -> float:
    """Median over the steps after ``warmup`` of the ranks' mean milliseconds in ``label``."""
    per_rank = [[step.get(label, 0.0) for step in r["phase_s"]] for r in ranks]
    means = [statistics.fmean(step) for step in zip(*per_rank, strict=True)][warmup:]
    return 1e3 * statistics.median(means) if means else 0.0


def rate_label(rate: str) -> str:
    """'1gbit' -> '1 Gbit/s'; 'none' -> 'unshaped'."""
    bits = parse_rate(rate)
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _speed_cell(run: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    if run is None:
        return "-"
    if run["status"] != "ok":
        return f"failed ({run['reason'].splitlines()[0][:60]})"
    ms = run["median_step_ms"]
    if base is None or base["status"] != "ok":
        return f"{ms:.1f} ms"
    if run is base:
        return f"{ms:.1f} ms (1.00x)"
    return f"{base['median_step_ms'] / ms:.2f}x ({ms:.1f} ms)"


def markdown_table(results: dict[str, dict[str, dict[str, Any]]], rates: Sequence[str],
                   variants: Sequence[str]) -> str:
    """The speed-up table: per variant and rate, DDP default's median step time over the
    variant's (x > 1: faster than DDP default); bytes and accuracy per rate, in rate order."""
    head = ["variant", *(f"{rate_label(r)} vs DDP default" for r in rates),
            "bytes/step/rank", "test acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v in variants:
        runs = [results.get(r, {}).get(v) for r in rates]
        cells = [VARIANTS[v]]
        cells += [_speed_cell(run, results.get(r, {}).get("ddp"))
                  for run, r in zip(runs, rates, strict=True)]
        ok = [run for run in runs if run is not None and run["status"] == "ok"]
        cells.append(" / ".join(_size(run["bytes_per_step_rank"]) for run in ok) or "-")
        cells.append(" / ".join(f"{run['final_accuracy']:.4f}" for run in ok) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- running
def run_variant(cluster: Cluster, variant: str, args: argparse.Namespace,
                out: Path) -> dict[str, Any]:
    """One mpiexec job training ``variant``; its summary, or status "failed" and why."""
    tag = cluster.rate or "none"
    raw_path = out / f"raw_{tag}_{variant}.json"
    raw_path.unlink(missing_ok=True)
    cmd = [WORKER, "--variant", variant, "--steps", str(args.steps), "--batch", str(args.batch),
           "--hidden", str(args.hidden), "--master-addr", cluster.address(0),
           "--json", str(raw_path), *(["--profile"] if args.profile else [])]
    before, start = cluster.tx_bytes(), time.monotonic()
    _LOG.info("%s at %s: %d steps", variant, tag, args.steps)
    try:
        run_in_cluster(cluster, cmd, args.timeout)
        raw = json.loads(raw_path.read_text())
    except (RuntimeError, OSError, ValueError) as err:
        _LOG.warning("%s at %s failed: %s", variant, tag, str(err)[-2000:])
        return {"variant": variant, "status": "failed", "reason": _reason(err),
                "wall_s": time.monotonic() - start}
    tc_bytes = sum(a - b for a, b in zip(cluster.tx_bytes(), before, strict=True))
    run = {"variant": variant, "status": "ok", "wall_s": time.monotonic() - start,
           **summarize(raw, args.warmup), "raw": raw}
    measured = sum(sum(r["tx_bytes"]) for r in raw["per_rank"])
    # tc counts what passed the shaped qdiscs; the worker counted its steps' share of it.
    run["checks"] = {"tc_bytes_job": tc_bytes, "eth0_bytes_steps": measured,
                     "traffic_crossed_links": tc_bytes >= measured > 0}
    _LOG.info("%s at %s: %.1f ms/step, %s/step/rank, test acc %.4f", variant, tag,
              run["median_step_ms"], _size(run["bytes_per_step_rank"]), run["final_accuracy"])
    return run


def _reason(err: BaseException) -> str:
    """The first line of a failure and the tail of its output (the error is usually last)."""
    text = str(err).strip()
    first, _, rest = text.partition("\n")
    if " ran past " in first:
        return f"timeout: {first.rsplit(' ran past ', 1)[1]}"
    status = re.search(r" failed \((-?\d+)\)", first)
    head = f"exit status {status.group(1)}" if status else first[:300]
    tail = "\n".join(rest.strip().splitlines()[-8:])
    return f"{head}\n{tail}" if tail else head


def bench_rate(rate: str, variants: Sequence[str], args: argparse.Namespace,
               out: Path) -> dict[str, dict[str, Any]]:
    """Every variant at one link rate, in one cluster."""
    runs: dict[str, dict[str, Any]] = {}
    with Cluster(args.ranks, None if rate == "none" else rate, prefix=args.prefix) as cluster:
        for variant in variants:
            runs[variant] = run_variant(cluster, variant, args, out)
    return runs


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> str | None:
    """Test accuracy against cumulative training time, one panel per rate; the file written,
    or None (with a logged reason) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _LOG.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (rate, runs) in zip(axes[0], results.items(), strict=True):
        for variant, run in runs.items():
            if run["status"] == "ok":
                xs, ys = zip(*run["time_to_accuracy"], strict=True)
                ax.plot(xs, ys, marker=".", label=VARIANTS[variant])
        ax.set(title=f"links {rate_label(rate)}", xlabel="training time (s, slowest rank)",
               ylabel="test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("DDP on digits, 4 ranks, time to accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------- report
def targets(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The issue's targets, each met or missed with the figures (where the runs allow it)."""
    def speedup(rate: str, variant: str) -> float | None:
        runs = results.get(rate, {})
        base, run = runs.get("ddp"), runs.get(variant)
        if not (base and run and base["status"] == run["status"] == "ok"):
            return None
        return base["median_step_ms"] / run["median_step_ms"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = []
    int8, topk = speedup("1gbit", "ringcomm-int8"), speedup("1gbit", "ringcomm-topk")
    psgd = speedup("1gbit", "powersgd")
    if int8 is not None:
        lines.append(f"- ringcomm Int8 >= 2.5x DDP default at 1 Gbit/s: {verdict(int8 >= 2.5)} "
                     f"({int8:.2f}x)")
    if int8 is not None and psgd is not None:
        lines.append(f"- ringcomm Int8 faster than PowerSGD rank 1 at 1 Gbit/s: "
                     f"{verdict(int8 > psgd)} ({int8:.2f}x vs {psgd:.2f}x)")
    if topk is not None:
        lines.append(f"- ringcomm TopK(0.01) >= 3x at 1 Gbit/s: {verdict(topk >= 3)} "
                     f"({topk:.2f}x)")
    ours = speedup("1gbit", "ringcomm-powersgd")
    if ours is not None and psgd is not None:
        lines.append(f"- ringcomm PowerSGD rank 1 (DDP's buckets) at least as fast as PyTorch's "
                     f"PowerSGD rank 1 (one bucket) at 1 Gbit/s: {verdict(ours >= psgd)} "
                     f"({ours:.2f}x vs {psgd:.2f}x)")
    at10 = {v: speedup("10gbit", v) for v in VARIANTS if v.startswith("ringcomm")}
    at10 = {v: s for v, s in at10.items() if s is not None}
    if at10:
        slow = {v: s for v, s in at10.items() if s < 1}
        lines.append(f"- no ringcomm hook slower than DDP default at 10 Gbit/s: "
                     f"{verdict(not slow)} (" + ", ".join(
                         f"{v} {s:.2f}x" for v, s in at10.items()) + ")")
    for rate, runs in results.items():
        base = runs.get("ddp")
        if not base or base["status"] != "ok":
            continue
        off = {v: 100 * (r["final_accuracy"] - base["final_accuracy"])
               for v, r in runs.items() if r["status"] == "ok" and v not in ("ddp", "local")}
        worst = min(off.values(), default=0.0)
        lines.append(f"- test accuracy within 0.5 points of DDP default's "
                     f"({base['final_accuracy']:.4f}) at {rate_label(rate)}: "
                     f"{verdict(worst >= -0.5)} (" + ", ".join(
                         f"{v} {d:+.2f}" for v, d in off.items()) + ")")
    return lines


def details(rate: str, runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per-variant figures at one rate (step and hook time, both byte counts, accuracy)."""
    lines = [f"\n### {rate_label(rate)}\n",
             "| variant | median step (ms) | in hook (ms) | link bytes/step/rank | "
             "ringcomm bytes/step/rank | test acc | training time (s) | slowest step (ms, #) | "
             "job wall (s) |",
             "|" + " --- |" * 9]
    for variant, run in runs.items():
        if run["status"] != "ok":
            lines.append(f"| {VARIANTS[variant]} | failed: {run['reason'].splitlines()[0]} "
                         "| | | | | | | " + f"{run['wall_s']:.0f} |")
            continue
        ringcomm_bytes = run["ringcomm_bytes_per_step_rank"]
        hook = f"{run['median_hook_ms']:.1f}" if run["raw"].get("hook_calls_last_step") else "-"
        lines.append(
            f"| {VARIANTS[variant]} | {run['median_step_ms']:.1f} | {hook} | "
            f"{_size(run['bytes_per_step_rank'])} | "
            f"{_size(ringcomm_bytes) if ringcomm_bytes else '-'} | "
            f"{run['final_accuracy']:.4f} | {run['time_to_accuracy'][-1][0]:.1f} | "
            f"{run['worst_step'][1]:.0f} (#{run['worst_step'][0]}) | {run['wall_s']:.0f} |")
    return lines


def profile(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per variant, the milliseconds per step (mean over ranks, median over steps) in each
    timed phase, when the run was profiled (--profile)."""
    lines = [f"- {VARIANTS[v]}: " + ", ".join(f"{k} {ms:.1f}" for k, ms in run["phase_ms"].items())
             for v, run in runs.items()
             if run["status"] == "ok" and set(run["phase_ms"]) - {"hook"}]
    if lines:
        lines[:0] = ["", "Profile, ms per step (wait: MPI barrier before each hook, i.e. "
                     "waiting for the last rank; hook: the hook after it; upper-case: ringcomm's "
                     "traced phases inside the hook):"]
    return lines


def notes(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """How the variants were configured, as the workers reported it."""
    seen: dict[str, str] = {}
    for runs in results.values():
        for variant, run in runs.items():
            if run["status"] == "ok" and variant not in seen:
                raw = run["raw"]
                keep = {k: raw[k] for k in ("hook_calls_last_step", "compression",
                                            "start_iter", "error_feedback",
                                            "min_compress_bytes", "matrix_approximation_rank",
                                            "start_powerSGD_iter", "bucket_cap_mb") if k in raw}
                seen[variant] = json.dumps(keep)
    chose = {rate: runs[v]["raw"]["auto_chose"] for rate, runs in results.items()
             for v in runs if runs[v]["status"] == "ok" and "auto_chose" in runs[v]["raw"]}
    lines = ["- hook_calls_last_step: DDP's buckets per step after its rebuild (0: no hook)"]
    lines += [f"- {VARIANTS[v]}: {text}" for v, text in seen.items()]
    lines += [f"- ringcomm auto chose at {rate_label(r)}: {', '.join(c)}" for r, c in chose.items()]
    return lines


def report_markdown(report: dict[str, Any], rates: Sequence[str],
                    variants: Sequence[str]) -> str:
    """The whole Markdown report: set-up, speed-up table, targets, details, notes."""
    results, m, a = report["results"], report["machine"], report["args"]
    lines = [
        f"## DDP on digits over an emulated cluster: {a['ranks']} ranks, links shaped with tc tbf",
        "",
        f"Machine: {m.get('cpu', '?')} ({m.get('cores', '?')} cores), {m.get('memory', '?')}, "
        f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}, {m.get('mpi', '?')} from "
        f"the mpich wheel (TCP over the namespaces' links, no shared memory), gloo over the same "
        f"links. Load average (1/5/15 min) {report['load_before']} before, "
        f"{report['load_after']} after.",
        f"Model: MLP 64 -> {a['hidden']} -> {a['hidden']} -> 10, "
        f"{report.get('grad_bytes', 0) / 2**20:.2f} MiB of float32 gradients; SGD with momentum; "
        f"batch {a['batch']} per rank; {a['steps']} steps, same batches for every variant. "
        f"Step time: each step's slowest rank, median over the steps after {a['warmup']} "
        "warm-up steps. Bytes: what each rank's eth0 sent per step (after warm-up). Speed-up: "
        "DDP default's median step time over the variant's (x > 1: faster).",
        f"Command: `{report['command']}`",
        "",
        markdown_table(results, rates, variants),
        "",
        "Targets:",
        *targets(results),
        "",
        "Details per rate:",
    ]
    for rate in rates:
        lines += details(rate, results[rate]) + profile(results[rate])
    lines += ["", "Configuration as run:", *notes(results)]
    return "\n".join(lines) + "\n"


def _machine(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """What the workers reported about the machine, with the core count and kernel."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "kernel": platform.release()}
    for runs in results.values():
        for run in runs.values():
            if run["status"] == "ok":
                return {**run["raw"]["machine"], **info}
    return info


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    try:
        preflight()
    except ClusterError as err:
        _LOG.error("cannot build the cluster: %s", err)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates, variants = args.rates.split(","), args.variants.split(",")
    command = subprocess.list2cmdline([sys.executable, *(sys.argv if argv is None else
                                                         [__file__, *argv])])
    report: dict[str, Any] = {"command": command, "args": vars(args),
                              "load_before": load_average(), "started": time.ctime()}
    with tempfile.TemporaryDirectory(prefix="ddp_cluster.") as scratch:
        report["results"] = {rate: bench_rate(rate, variants, args, Path(scratch))
                             for rate in rates}
    report["load_after"] = load_average()
    report["machine"] = _machine(report["results"])
    report["grad_bytes"] = next((run["raw"]["grad_bytes"] for runs in report["results"].values()
                                 for run in runs.values() if run["status"] == "ok"), 0)
    report["plot"] = plot(report["results"], out / "ddp_cluster.png")
    text = report_markdown(report, rates, variants)
    (out / "ddp_cluster.md").write_text(text)
    (out / "ddp_cluster.json").write_text(json.dumps(report, indent=1))
    print(text)
    print(f"# JSON, Markdown{' and plot' if report['plot'] else ''} in {out}")
    failed = [f"{v}@{r}" for r, runs in report["results"].items()
              for v, run in runs.items() if run["status"] != "ok"]
    if failed:
        _LOG.warning("failed: %s", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
