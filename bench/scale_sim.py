"""ringcomm at 16 to 1024 GPUs, simulated: error, projected time, and the model's validation.

    .venv/bin/python bench/scale_sim.py            # full run, results in bench/results/scale_sim/
    .venv/bin/python bench/scale_sim.py --quick    # smaller n, a few minutes

ringcomm's real algorithms (the dense ring, the int8 ring, the sparse top-k ring, and the
hierarchical allreduce of ringcomm.algorithms.hierarchical) run on thread ranks over the
simulated-clock transport of bench/sim_transport.py, on small real arrays that stand for large
gradients (bench/sim_model.py has the link, NIC and compute model; bench/sim_costs.py the measured
compute rates). It writes, as JSON, Markdown and a PNG:

(a) the relative error of one int8 and one top-k(0.01) allreduce against n, flat against
    hierarchical (8 ranks per node), measured on the real arrays against the float64 sum;
(b) the projected time of an allreduce of 1 GiB of gradients at 64, 256, 512 and 1024 GPUs (8
    per node, NVLink inside, 100 and 400 Gbit/s NICs), dense, int8 and top-k, flat and
    hierarchical, beside the alpha-beta lower bound; what was not simulated is computed with
    the closed forms of bench/sim_formulas.py on the same model, and labelled so;
(c) the same model with the emulated cluster's parameters against its measured times
    (bench/results/cluster/, and bench/results/cluster2/ where present).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from scale_sim_jobs import Job, exact_sum, run_job
from scale_sim_report import plot, report
from scale_sim_validate import validate
from sim_costs import gpu_costs
from sim_formulas import projected
from sim_model import CostModel, LinkModel, alpha_beta_bound
from sim_transport import run_sim

import ringcomm
from ringcomm.codecs.base import Compressor

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
#: Real float32 elements per rank: 1 GiB / 2048, so that a 2 MiB segment of the real job is 256
#: elements here, one int8 block (the compressed ring aligns segments to blocks).
LENGTH = 131072
NVLINK = {"intra_bw": 300e9, "intra_alpha": 2e-6}
INTER_ALPHA = 5e-6


def compressors() -> dict[str, Compressor | None]:
    """The variants: dense, int8 (block 256), top-k 0.01 (sparse ring)."""
    return {"dense": None, "int8": ringcomm.Int8(), "topk": ringcomm.TopK(0.01)}


def gpu_links(nic_gbit: float, scale: float) -> LinkModel:
    """8 GPUs per node on NVLink, one NIC of ``nic_gbit`` per node."""
    return LinkModel(ranks_per_node=8, inter_bw=nic_gbit * 1e9 / 8, inter_alpha=INTER_ALPHA,
                     scale=scale, **NVLINK)


class Runner:
    """Runs and remembers simulated cases (one case serves both the error and the time)."""

    def __init__(self, length: int, cost: CostModel) -> None:
        self.length, self.cost = length, cost
        self.scale = GIB / (4 * length)
        self.cases: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._exact: dict[int, np.ndarray] = {}

    def case(self, n: int, variant: str, hier: bool, nic_gbit: float) -> dict[str, Any]:
        """Simulate one allreduce of 1 GiB per rank (stood for by ``length`` elements)."""
        key = (n, variant, hier, nic_gbit)
        if key in self.cases:
            return self.cases[key]
        comp = compressors()[variant]
        job = Job(self.length, comp, hier, segment_bytes=int((2 << 20) / self.scale),
                  keep_result=True)
        self.cost.scale = self.scale
        wall = time.monotonic()
        sim = run_sim(n, lambda t: run_job(job, t), gpu_links(nic_gbit, self.scale), self.cost)
        y = sim.results[0]["out"]
        exact = self._exact.get(n)
        if exact is None:
            exact = self._exact[n] = exact_sum(n, self.length)
        row = {"n": n, "variant": variant, "algorithm": "hierarchical" if hier else "flat",
               "nic_gbit": nic_gbit, "time_s": max(r["time"] for r in sim.results),
               "compute_s": max(r["compute"] for r in sim.results),
               "relerr": float(np.linalg.norm(y - exact) / np.linalg.norm(exact)),
               "identical": len({r["digest"] for r in sim.results}) == 1,
               "wall_s": time.monotonic() - wall, "source": "simulated"}
        print(f"  n={n:4d} {variant:5s} {row['algorithm']:12s} {nic_gbit:g} Gbit/s: "
              f"{row['time_s'] * 1e3:8.2f} ms, error {row['relerr']:.3e}, "
              f"{row['wall_s']:.1f} s", flush=True)
        self.cases[key] = row
        return row


def part_a(runner: Runner, ns: list[int]) -> list[dict[str, Any]]:
    """One int8 and one top-k step's relative error against n, flat and hierarchical."""
    print("(a) error of one step against n", flush=True)
    return [runner.case(n, v, hier, 400) for n in ns for v in ("int8", "topk")
            for hier in (False, True)]


def part_b(runner: Runner, simulate: list[tuple[int, float]], ns: list[int],
           nics: list[float]) -> list[dict[str, Any]]:
    """Projected time of a 1 GiB allreduce: simulated where listed or already run for (a),
    else computed."""
    print("(b) projected time of 1 GiB", flush=True)
    rows = []
    for n in ns:
        for nic in nics:
            links = gpu_links(nic, 1.0)
            for variant, comp in compressors().items():
                for hier in (False, True):
                    computed = projected(n, GIB, comp, hier, links, runner.cost)
                    if (n, nic) in simulate or (n, variant, hier, nic) in runner.cases:
                        row = dict(runner.case(n, variant, hier, nic))
                        row["computed_s"] = computed
                    else:
                        row = {"n": n, "variant": variant, "nic_gbit": nic,
                               "algorithm": "hierarchical" if hier else "flat",
                               "time_s": computed, "source": "computed"}
                    row["bound_s"] = alpha_beta_bound(n // 8, GIB, INTER_ALPHA, links.inter_bw)
                    rows.append(row)
    return rows


def refresh_computed(rows: list[dict[str, Any]], cost: CostModel) -> None:
    """Recompute the closed forms of part (b)'s rows (they are derived, cheap, and follow
    bench/sim_formulas.py); simulated times stay as they were."""
    for row in rows:
        comp = compressors()[row["variant"]]
        links = gpu_links(row["nic_gbit"], 1.0)
        value = projected(row["n"], GIB, comp, row["algorithm"] == "hierarchical", links, cost)
        row["time_s" if row["source"] == "computed" else "computed_s"] = value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="n up to 64 simulated, the rest computed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale_sim"))
    p.add_argument("--launch-us", type=float, default=5.0,
                   help="fixed GPU cost per array operation (kernel launch), microseconds")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the Markdown and PNG from the JSON of an earlier run")
    p.add_argument("--validate-only", action="store_true",
                   help="with --report-only: also rerun (c) against the measured results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads((out / "scale_sim.json").read_text())
        refresh_computed(results["times"], gpu_costs(fixed=results["meta"]["cost_fixed_s"]))
        if args.validate_only:
            results["validation"] = validate(quick=args.quick)
        (out / "scale_sim.json").write_text(json.dumps(results, indent=1))
        (out / "scale_sim.md").write_text(report(results))
        plot(results, out / "scale_sim.png")
        return 0
    started = time.monotonic()
    runner = Runner(LENGTH, gpu_costs(fixed=args.launch_us * 1e-6))
    ns_a = [16, 32, 64] if args.quick else [16, 32, 64, 128, 256, 512]
    simulate = [(64, 400.0)] if args.quick else [(64, 400.0), (64, 100.0), (256, 400.0)]
    results: dict[str, Any] = {
        "errors": part_a(runner, ns_a),
        "times": part_b(runner, simulate, [64, 256, 512, 1024], [100.0, 400.0]),
        "validation": validate(quick=args.quick),
    }
    results["meta"] = {
        "command": " ".join(sys.argv), "quick": args.quick, "length": LENGTH,
        "scale": runner.scale, "gradient_bytes": GIB, "segment_bytes": 2 << 20,
        "links": {"ranks_per_node": 8, **NVLINK, "inter_alpha": INTER_ALPHA,
                  "nic_gbit": [100, 400]},
        "cost_source": runner.cost.source, "cost_rates": runner.cost.rates,
        "cost_fixed_s": runner.cost.fixed, "machine": platform.platform(),
        "python": platform.python_version(), "wall_s": time.monotonic() - started,
    }
    (out / "scale_sim.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (out / "scale_sim.md").write_text(text)
    plot(results, out / "scale_sim.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
