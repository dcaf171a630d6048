"""What the benchmark prints and writes: the machine, a load warning, the table in nccl-tests'
layout, the closing summary lines, the JSON record and the plot."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np

__all__ = ["Table", "load_warning", "machine", "plot", "summary"]


def machine() -> dict[str, Any]:
    """What the numbers were measured on: Python, platform, NumPy, CPU, MPI, GPU and NCCL."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "numpy": np.__version__, "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = f"{len(names)} x {names[0]}" if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    try:
        from mpi4py import MPI

        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except ImportError:
        pass
    info.update(_gpu_info())
    return info


def _gpu_info() -> dict[str, Any]:
    """The GPU and NCCL, where there are."""
    from ringcomm.backends import nccl

    if not nccl.usable():
        return {}
    import cupy

    from ringcomm.backends import _nccl_lib

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"gpu": name, "nccl": _nccl_lib.load().version_string, "cupy": cupy.__version__}


def load_warning(ranks_here: int) -> str | None:
    """A warning when other work loads this machine: the load average over the last minute
    above the cores left after this job's own ``ranks_here`` processes (figures then swing
    between runs), or None."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on this platform
        return None
    cores = os.cpu_count() or 1
    spare = max(cores - ranks_here, 0)
    if load <= max(spare, 0.5 * cores):
        return None
    return (f"# WARNING: load average {load:.2f} on {cores} cores with {ranks_here} ranks of "
            f"this job here: other work competes for the machine, and the figures below will "
            f"be noisy (compare runs by their spread, or rerun on an idle machine)")


# Column key, width, format. nccl-tests' columns first (out-of-place, then in-place), then
# the spread of the time, compression, wire bytes, baselines and memcpy.
_OUT_OF_PLACE = [
    ("size", 12, "d"), ("count", 11, "d"), ("type", 8, "s"), ("redop", 5, "s"),
    ("compression", 14, "s"), ("time_us", 10, ".1f"), ("algbw", 7, ".2f"), ("busbw", 7, ".2f"),
    ("wrong", 7, "d"),
]
_IN_PLACE = [("ip_time_us", 10, ".1f"), ("ip_algbw", 7, ".2f"), ("ip_busbw", 7, ".2f"),
             ("ip_wrong", 7, "d")]
_OURS = [("spread", 7, ".0%"), ("relerr", 8, ".1e"), ("wire_bytes", 11, "d"),
         ("ratio", 6, ".2f")]
_NAMES = {"time_us": "time(us)", "wrong": "#wrong", "ip_time_us": "time(us)",
          "ip_algbw": "algbw", "ip_busbw": "busbw", "ip_wrong": "#wrong", "spread": "iqr",
          "wire_bytes": "wire(B)", "memcpy_GBps": "memcpy(GB/s)"}


class Table:
    """The table's columns for one run: which baselines, in-place or not, memcpy or not."""

    def __init__(self, baselines: list[str], in_place: bool, memcpy: bool) -> None:
        cols = list(_OUT_OF_PLACE) + (list(_IN_PLACE) if in_place else []) + list(_OURS)
        for b in baselines:
            cols += [(f"{b}_time_us", 11, ".1f"), (f"{b}_busbw", 8, ".2f"),
                     (f"vs_{b}", 7, ".2f")]
        if memcpy:
            cols += [("memcpy_GBps", 12, ".2f"), ("busbw_vs_memcpy", 15, ".2f")]
        self.columns = cols
        self.in_place = in_place

    def header(self) -> str:
        """The column names' lines (a first line grouping out-of-place and in-place, as
        nccl-tests does)."""
        names = " ".join(f"{_NAMES.get(k, k):>{w}}" for k, w, _ in self.columns)
        lines = []
        if self.in_place:
            left = sum(w + 1 for _, w, _ in _OUT_OF_PLACE[:5])
            width_out = sum(w + 1 for _, w, _ in _OUT_OF_PLACE[5:]) - 1
            width_in = sum(w + 1 for _, w, _ in _IN_PLACE) - 1
            lines.append("#" + " " * (left - 1) + f"{'out-of-place':>{width_out}} "
                         f"{'in-place':>{width_in}}")
        lines.append("#" + names[1:])
        return "\n".join(lines)

    def row(self, row: dict[str, Any]) -> str:
        """One row, '-' where a figure does not apply."""
        parts = []
        for key, width, spec in self.columns:
            value = row.get(key)
            parts.append(f"{'-' if value is None else format(value, spec):>{width}}")
        return " ".join(parts)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """nccl-tests' closing lines: the wrong values found, and each variant's average bus
    bandwidth over every size (out-of-place and in-place figures alike)."""
    wrong = sum((r.get("wrong") or 0) + (r.get("ip_wrong") or 0) for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    labels = list(dict.fromkeys(r["compression"] for r in rows))
    for label in labels:
        bw = [r[k] for r in rows if r["compression"] == label for k in ("busbw", "ip_busbw")
              if r.get(k) is not None]
        name = "" if len(labels) == 1 else f" ({label})"
        lines.append(f"# Avg bus bandwidth{name}    : {np.mean(bw):.4g} GB/s")
    return lines


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """busbw and time against size, one line per compression and baseline (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for row in rows:
        series.setdefault(f"ringcomm {row['compression']}", []).append(
            (row["size"], row["busbw"], row["time_us"]))
        for key in row:
            if (key.endswith("_time_us") and not key.startswith("ip_")
                    and row[key] is not None
                    and row["compression"] in ("none", rows[0]["compression"])):
                b = key[: -len("_time_us")]
                pts = series.setdefault(b, [])
                if not pts or pts[-1][0] != row["size"]:
                    pts.append((row["size"], row[f"{b}_busbw"], row[key]))
    for label, pts in series.items():
        xs, bw, ts = zip(*pts, strict=True)
        style = "--" if not label.startswith("ringcomm") else "-"
        ax_bw.plot(xs, bw, style, marker="o", ms=3, label=label)
        ax_t.plot(xs, ts, style, marker="o", ms=3, label=label)
    for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_bw.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
