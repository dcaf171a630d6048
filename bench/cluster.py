"""Where compression pays: allreduce over an emulated cluster of shaped links, in one command.

    sudo .venv/bin/python bench/cluster.py                 # 4 ranks; 1 Gbit/s, 10 Gbit/s, unshaped

For every link rate it builds one network namespace per rank joined by a bridge (bench/netns.py),
shapes every rank's link with tc tbf, and runs bench/allreduce_perf.py under mpiexec with MPICH
talking TCP over those links (no shared memory). It checks that the traffic crossed the shaped
links (tc's byte counters against the bytes the runs reported) and whether the link, not the
CPU, bounded the dense ring, then writes the speed-up table (every variant against the dense ring,
and MPI's own Allreduce) and plots to --out. With --train it also trains the digits MLP at the
first rate, dense against int8 and top-k, reporting wall time per epoch and final accuracy.
Everything it creates is removed on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns import Cluster, ClusterError, parse_rate, preflight

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("none,fp16,int8,topk:0.01,topk:0.01:allgather,topk:0.001,topk:0.001:allgather,"
            "auto:topk")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rates", default="1gbit,10gbit,none", help="comma list; none = unshaped")
    p.add_argument("-b", "--minbytes", default="1M")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", default="4")
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup", type=int, default=1)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--train", action="store_true", help="time to accuracy at the first rate")
    p.add_argument("--train-epochs", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return p.parse_args(argv)


def _python() -> str:
    return sys.executable


def _mpiexec(n: int, launch: list[str] | None = None) -> list[str]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return [str(mpiexec if mpiexec.exists() else "mpiexec"), *(launch or []), "-n", str(n),
            _python(), str(ROOT / "bench" / "netns_exec.py")]


def _stop(proc: subprocess.Popen[str]) -> None:
    """End an mpiexec job: SIGTERM first, so that mpiexec ends its ranks (SIGKILL would leave
    them running), SIGKILL if it has not exited 30 s later."""
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def run_in_cluster(cluster: Cluster, args: list[str], timeout: float,
                   env: dict[str, str] | None = None) -> str:
    """Run ``python args...`` on every rank of ``cluster`` (environment ``env``, by default
    ``cluster.mpi_env()``); returns rank 0's output."""
    cmd = [*_mpiexec(cluster.n, cluster.launch_args()), _python(), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cluster.mpi_env() if env is None else env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout:.0f} s") from None
    except BaseException:  # Ctrl-C or SIGTERM (netns.Cluster raises KeyboardInterrupt)
        _stop(proc)
        raise
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}\n{err}")
    return out


def bench_rate(rate: str | None, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """allreduce_perf at one link rate, with the traffic and bottleneck checks."""
    tag = rate or "none"
    json_path, png_path = out / f"allreduce_{tag}.json", out / f"allreduce_{tag}.png"
    with Cluster(args.ranks, rate) as cluster:
        before = cluster.tx_bytes()
        text = run_in_cluster(cluster, [
            "bench/allreduce_perf.py", "-b", args.minbytes, "-e", args.maxbytes,
            "-f", args.stepfactor, "-n", str(args.iters), "-w", str(args.warmup),
            "--compression", args.variants, "--baseline", "mpi", "--no-memcpy", "--no-inplace",
            "--json", str(json_path), "--plot", str(png_path),
            "--title", f"allreduce, {args.ranks} ranks, links {tag}, MPI over TCP"], args.timeout)
        crossed = sum(a - b for a, b in zip(cluster.tx_bytes(), before, strict=True))
    print(text, flush=True)
    rows = json.loads(json_path.read_text())["rows"]
    return {"rate": tag, "rows": rows, "checks": checks(rows, rate, crossed, args)}


def checks(rows: list[dict[str, Any]], rate: str | None, crossed: int,
           args: argparse.Namespace) -> dict[str, Any]:
    """Did the traffic cross the links, and did the link bound the dense ring?"""
    calls = args.iters + args.warmup  # timed calls of each variant; checks and stats add more
    sent = sum(r["wire_bytes"] for r in rows) * calls * args.ranks  # bytes_sent is per rank
    result: dict[str, Any] = {"tc_bytes": crossed, "reported_min_bytes": sent,
                              "traffic_crossed_links": crossed >= sent}
    bits = parse_rate(rate)
    dense = [r for r in rows if r["compression"] == "none"]
    if bits and dense:
        biggest = max(dense, key=lambda r: r["size"])
        share = biggest["busbw"] * 1e9 / (bits / 8)
        result.update(dense_busbw_of_link=share, link_bound=share >= 0.6)
    return result


def speedup_table(results: list[dict[str, Any]]) -> str:
    """Markdown: time of every variant and its speed-up over the dense ring, per rate and size."""
    lines = []
    for res in results:
        rows = res["rows"]
        names = list(dict.fromkeys(r["compression"] for r in rows))
        lines += [f"\n### link {res['rate']}\n", "| size | " + " | ".join(
            ["MPI Allreduce", *names]) + " |", "|" + " --- |" * (len(names) + 2)]
        for size in sorted({r["size"] for r in rows}):
            at = {r["compression"]: r for r in rows if r["size"] == size}
            dense = at["none"]["time_us"]
            times = [at["none"]["mpi_time_us"], *(at[k]["time_us"] for k in names)]
            cells = [f"{t / 1e3:.1f} ms ({dense / t:.2f}x)" for t in times]
            cells = [c + (f" -> {at[k]['chose']}" if k in at and "chose" in at[k] else "")
                     for c, k in zip(cells, ["mpi", *names], strict=True)]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append(f"\nchecks: {json.dumps(res['checks'])}")
    return "\n".join(lines)


def train(rate: str | None, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """The digits MLP (wide hidden layer, so gradients matter) at ``rate``: dense vs compressed."""
    runs = []
    with Cluster(args.ranks, rate) as cluster:
        for compression in ("none", "int8", "topk"):
            path = out / f"train_{rate}_{compression}.json"
            run_in_cluster(cluster, [
                "examples/train_digits.py", "--compression", compression, "--hidden", "2048",
                "--epochs", str(args.train_epochs), "--json", str(path)], args.timeout)
            epochs = json.loads(path.read_text())["epochs"]
            runs.append({"compression": compression,
                         "epoch_s": sorted(e["epoch_s"] for e in epochs)[len(epochs) // 2],
                         "final_accuracy": epochs[-1]["test_accuracy"],
                         "wire_KiB_per_step": epochs[-1]["wire_bytes_per_step"] / 1024})
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preflight()
    except ClusterError as err:
        print(f"cluster: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rates = [None if r == "none" else r for r in args.rates.split(",")]
    results = [bench_rate(rate, args, out) for rate in rates]
    report = speedup_table(results)
    trained = train(rates[0], args, out) if args.train else []
    if trained:
        report += f"\n\n### time to accuracy, digits MLP (hidden 2048), link {rates[0]}\n\n"
        report += "| compression | median epoch (s) | final test accuracy | wire per step |\n"
        report += "| --- | --- | --- | --- |\n" + "\n".join(
            f"| {t['compression']} | {t['epoch_s']:.2f} | {t['final_accuracy']:.4f} | "
            f"{t['wire_KiB_per_step']:.0f} KiB |" for t in trained)
    (out / "cluster.md").write_text(report + "\n")
    (out / "cluster.json").write_text(json.dumps({"results": results, "train": trained},
                                                 indent=1))
    print(report)
    print(f"\n# done in {time.monotonic() - start:.0f} s; tables and plots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
