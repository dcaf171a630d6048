"""Turn allreduce_perf JSON into the markdown tables committed under bench/results/.

    python bench/report.py bench/results/allreduce_n2.json > bench/results/allreduce_n2.md

Dense rows become "ringcomm against MPI's own Allreduce (and gloo's) and a memcpy, measured in the
same run";
compressed rows become "what each compressor puts on the wire and what it costs against the
dense ring".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def header(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    args = meta["args"]
    lines = [f"- machine: {m.get('cpu', '?')}; {m.get('platform', '')}",
             f"- {m.get('mpi', 'no MPI')}; Python {m.get('python')}, NumPy {m.get('numpy')}",
             f"- {meta['nranks']} ranks, backend {meta['backend']}, segment "
             f"{meta['segment_bytes'] >> 10} KiB, {args['iters']} timed iterations after "
             f"{args['warmup_iters']} warm-up; every figure is the median over iterations of the "
             "slowest rank, all variants timed in turn within each iteration"]
    if "gpu" in m:
        lines.append(f"- GPU: {m['gpu']}, NCCL {m['nccl']}, CuPy {m.get('cupy')}")
    return "\n".join(lines)


def dense_table(rows: list[dict[str, Any]]) -> str:
    """ringcomm against MPI's Allreduce (and gloo's, when the run had it) and a memcpy; the
    ratios are times, baseline / ringcomm (above 1: ringcomm faster)."""
    dense = [r for r in rows if r["compression"] == "none"]
    gloo = any("gloo_time_us" in r for r in dense)
    nan = float("nan")
    head = "| size | ringcomm time | busbw GB/s | MPI Allreduce time | MPI / ringcomm |"
    rule = "| ---: | ---: | ---: | ---: | ---: |"
    if gloo:
        head += " gloo allreduce time | gloo / ringcomm |"
        rule += " ---: | ---: |"
    out = [head + " memcpy GB/s | ringcomm busbw / memcpy | #wrong |",
           rule + " ---: | ---: | ---: |"]
    for r in dense:
        line = (f"| {_size(r['size'])} | {r['time_us']:.1f} us | {r['busbw']:.2f} | "
                f"{r.get('mpi_time_us', nan):.1f} us | "
                f"{r.get('mpi_time_us', nan) / r['time_us']:.2f}x |")
        if gloo:
            line += (f" {r.get('gloo_time_us', nan):.1f} us | "
                     f"{r.get('gloo_time_us', nan) / r['time_us']:.2f}x |")
        out.append(line + f" {r.get('memcpy_GBps', nan):.2f} | "
                   f"{r.get('busbw_vs_memcpy', nan):.2f} | {r.get('wrong', '-')} |")
    return "\n".join(out)


def compression_table(rows: list[dict[str, Any]]) -> str:
    dense = {r["size"]: r for r in rows if r["compression"] == "none"}
    out = ["| size | compression | time | vs dense time | wire bytes / rank | fewer bytes than "
           "dense | relative error |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        d = dense.get(r["size"])
        err = r.get("relerr")
        out.append(
            f"| {_size(r['size'])} | {r['compression']} | {r['time_us'] / 1e3:.2f} ms | "
            f"{r['time_us'] / d['time_us'] if d else float('nan'):.2f}x | {r['wire_bytes']} | "
            f"{r.get('ratio', float('nan')):.2f}x | {'-' if err is None else f'{err:.1e}'} |")
    return "\n".join(out)


def sweep_table(data: dict[str, Any]) -> str:
    """Segment sweep: median time per segment size, and its ratio to the row's best."""
    segments = data["rows"][0]["segments"]
    out = ["| size | " + " | ".join(f"{s >> 10} KiB" for s in segments) + " |",
           "| ---: |" + " ---: |" * len(segments)]
    for row in data["rows"]:
        best = min(row["median_s"])
        cells = [f"{t * 1e3:.2f} ms ({t / best:.2f})" for t in row["median_s"]]
        out.append(f"| {_size(row['size'])} | " + " | ".join(cells) + " |")
    m = data["meta"]["machine"]
    head = [f"# segment sweep, {data['meta']['nranks']} ranks, float32 sum", "",
            f"- machine: {m.get('cpu')}; {m.get('mpi')}; Python {m.get('python')}, "
            f"NumPy {m.get('numpy')}",
            "- median time of the slowest rank per segment size, all sizes timed in turn "
            "within each iteration; in brackets, the ratio to the row's best", ""]
    return "\n".join(head + out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        data = json.loads(Path(path).read_text())
        if data["rows"] and "segments" in data["rows"][0]:
            print(sweep_table(data))
            continue
        rows = data["rows"]
        print(f"# allreduce_perf: {Path(path).stem}\n\n{header(data['meta'])}\n")
        if any(r["compression"] == "none" for r in rows):
            print(dense_table(rows) + "\n")
        if any(r["compression"] != "none" for r in rows):
            print(compression_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
