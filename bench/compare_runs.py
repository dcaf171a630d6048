"""Compare allreduce_perf runs of two versions of ringcomm, size by size, as a Markdown table.

Each version's JSON files (``allreduce_perf.py --json``) are runs on the same machine, taken
alternately (before, after, before, after, ...) so that drift hits both alike. Per size the
table gives the median time of each version and their ratio, and the median over runs of
ringcomm's time over MPI's own Allreduce timed in the same run, whose ratio between versions
cancels what the machine did meanwhile (the machine is shared: whole runs shift by 1.5x).

Usage::

    python bench/compare_runs.py --before b1.json b2.json --after a1.json a2.json \
        --markdown bench/results/FILE.md --title "..."
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _rows(paths: list[str], compression: str = "none") -> dict[int, list[dict[str, Any]]]:
    by_size: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("compression", "none") == compression:
                by_size.setdefault(int(row["size"]), []).append(row)
    return by_size


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(before: list[str], after: list[str], compression: str = "none") -> list[str]:
    """The Markdown lines comparing the two sets of runs (rows of one ``compression``)."""
    b, a = _rows(before, compression), _rows(after, compression)
    lines = [
        "| size | before (µs) | after (µs) | after / before | before / MPI | after / MPI "
        "| after / before, MPI-normalised |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in sorted(set(a) & set(b)):
        tb = statistics.median(r["time_us"] for r in b[size])
        ta = statistics.median(r["time_us"] for r in a[size])
        # Per run, ringcomm's time over MPI's in that run: the machine's mood cancels out.
        vb = statistics.median(r["time_us"] / r["mpi_time_us"] for r in b[size])
        va = statistics.median(r["time_us"] / r["mpi_time_us"] for r in a[size])
        lines.append(f"| {_size(size)} | {tb:.0f} | {ta:.0f} | {ta / tb:.3f} | {vb:.3f} | "
                     f"{va:.3f} | {va / vb:.3f} |")
    return lines


def spread_table(before: list[str], after: list[str]) -> list[str]:
    """Per size, each version's time over MPI's: the median over runs of each run's per-call
    median, with the first and third quartiles of the per-call ratios (median over runs); empty
    for runs made before ``allreduce_perf.py`` kept the quartiles."""
    b, a = _rows(before), _rows(after)
    sizes = sorted(size for size in set(a) & set(b)
                   if all("over_mpi_q1" in r for r in a[size] + b[size]))
    if not sizes:
        return []
    lines = ["| size | before / MPI: median [q1, q3] | after / MPI: median [q1, q3] |",
             "|---|---|---|"]

    def spread(rows: list[dict[str, Any]]) -> str:
        q1, q2, q3 = (statistics.median(r[k] for r in rows)
                      for k in ("over_mpi_q1", "over_mpi", "over_mpi_q3"))
        return f"{q2:.2f} [{q1:.2f}, {q3:.2f}]"

    for size in sizes:
        lines.append(f"| {_size(size)} | {spread(b[size])} | {spread(a[size])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True, help="JSON runs of the old tree")
    parser.add_argument("--after", nargs="+", required=True, help="JSON runs of the new tree")
    parser.add_argument("--markdown", help="write the table here (else print it)")
    parser.add_argument("--title", default="Dense allreduce, before and after")
    parser.add_argument("--compression", default="none",
                        help="the variant compared (allreduce_perf's label: none, int8, ...)")
    args = parser.parse_args()
    spread = spread_table(args.before, args.after)
    text = "\n".join([f"# {args.title}", "",
                      *table(args.before, args.after, args.compression), "",
                      *(["Time over MPI's in the same iterations, with the spread of the "
                         "per-call ratios:", "", *spread, ""] if spread else [])])
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
