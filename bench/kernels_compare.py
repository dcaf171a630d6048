"""Compare kernels_perf runs of several versions of ringcomm, kernel by kernel, as Markdown.

Each version is a label and the JSON files (``kernels_perf.py --json``) of its runs on one
machine, taken alternately where possible. Per kernel the table gives each version's median
time over its runs, and each later version's time over the first's (below 1 is faster); a
version without the row shows "-". Rows follow the first version that has them; each
version's median device-to-device copy is given too, so a shift of the whole machine shows.

Usage::

    python bench/kernels_compare.py --version before=b1.json,b2.json \
        --version after=a1.json,a2.json --markdown bench/results/gpu/FILE.md --title "..."
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

__all__ = ["main", "table"]

_WORK = re.compile(r" \[\d+ launches[^\]]*\]$")  # the host work counted, which may differ


def _times(paths: list[str]) -> dict[str, float]:
    """Median microseconds per kernel row (its name without the launch counts) over runs."""
    runs: dict[str, list[float]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["results"]:
            runs.setdefault(_WORK.sub("", row["kernel"]), []).append(float(row["us"]))
    return {name: statistics.median(us) for name, us in runs.items()}


def table(versions: list[tuple[str, list[str]]], title: str) -> str:
    """The Markdown comparison of ``versions`` (label, JSON files), the first the baseline."""
    times = [(label, _times(paths)) for label, paths in versions]
    order: list[str] = []
    for _, t in times:
        order += [name for name in t if name not in order]
    labels = [label for label, _ in times]
    head = "| kernel | " + " | ".join(f"{label} (us)" for label in labels)
    head += "".join(f" | {label} / {labels[0]}" for label in labels[1:]) + " |"
    lines = [f"# {title}", "", head,
             "| --- |" + " ---: |" * (len(labels) + len(labels) - 1)]
    for name in order:
        cells = [t.get(name) for _, t in times]
        us = [f"{c:.1f}" if c is not None else "-" for c in cells]
        ratios = [f"{c / cells[0]:.2f}" if c is not None and cells[0] else "-"
                  for c in cells[1:]]
        shown = name.replace("|", "/")
        lines.append(f"| {shown} | " + " | ".join(us + ratios) + " |")
    runs = ", ".join(f"{label}: {len(paths)} run(s)" for label, paths in versions)
    lines += ["", f"Medians over each version's runs ({runs}); rows indented are one call's "
              "kernels timed one by one (bench/kernels_perf.py BREAKDOWN)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="append", required=True,
                   help="LABEL=run1.json,run2.json (the first is the baseline)")
    p.add_argument("--title", default="Kernel times by version")
    p.add_argument("--markdown", type=Path, default=None, help="write the table here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    versions: list[tuple[str, list[str]]] = []
    for spec in args.version:
        label, _, paths = spec.partition("=")
        versions.append((label, [p for p in paths.split(",") if p]))
    out = table(versions, args.title)
    if args.markdown:
        args.markdown.write_text(out)
    print(out, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

