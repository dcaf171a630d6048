"""Allreduce bandwidth benchmark in the style of nccl-tests' all_reduce_perf.

Run under the launcher, one process per rank::

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/allreduce_perf.py -b 4K -e 256M -f 4

Every row times ringcomm and its baselines in the same run, interleaved iteration by iteration
so that machine noise hits both alike, and reports medians. Columns follow nccl-tests: size
(bytes per rank), count, type, redop, time (us), algbw = size / time and busbw = algbw *
2(n-1)/n (GB/s), #wrong; then the bytes this rank put on the wire and the compression ratio
against the dense ring, and the same time and busbw for each baseline (MPI's own Allreduce;
torch's gloo allreduce with --baseline gloo; NCCL's own allreduce on GPU) with ringcomm's
speed-up over MPI. The last column is a single-process memcpy of the same size on rank 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import ringcomm
from ringcomm.core.types import ReduceOp

_DTYPES = {"half": "float16", "float": "float32", "double": "float64", "int32": "int32",
           "int64": "int64", "bfloat16": "bfloat16"}
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _dtype(name: str) -> np.dtype:
    """nccl-tests' type names as NumPy dtypes (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DTYPES[name])


def parse_size(text: str) -> int:
    """'256', '4K', '16M', '1G' -> bytes."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 8, 4K, 16M or 1G, got {text!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=3)
    p.add_argument("-c", "--check", type=int, default=1, help="check results (1) or not (0)")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(_DTYPES))
    p.add_argument("-o", "--op", default="sum", choices=[o.value for o in ReduceOp])
    p.add_argument("--backend", default="auto", choices=["auto", "mpi", "nccl"])
    p.add_argument("--compression", default="none",
                   help="comma list of none, fp16, bf16, int8[:block], "
                        "topk:RATIO[:ring|allgather], auto, auto:topk; a suffix @flat or "
                        "@hier (@hierarchical) picks the allreduce algorithm")
    p.add_argument("--baseline", default=None,
                   help="comma list of mpi, gloo, nccl, none (default: nccl on the NCCL "
                        "backend, mpi otherwise)")
    p.add_argument("--segment-bytes", type=parse_size, default=None)
    p.add_argument("--no-memcpy", action="store_true", help="skip the memcpy column")
    p.add_argument("--json", metavar="FILE", help="write the rows and the machine as JSON")
    p.add_argument("--plot", metavar="FILE", help="plot busbw and time against size (PNG)")
    p.add_argument("--title", help="the plot's title")
    p.add_argument("--phases", type=int, default=0, metavar="CALLS",
                   help="after the timing, run each variant CALLS more times with a tracer and "
                        "report the seconds per call of every phase span (slowest rank)")
    args = p.parse_args(argv)
    if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.iters < 1:
        p.error("need minbytes <= maxbytes, stepfactor >= 2, iters >= 1")
    return args


_ALGORITHMS = {"flat": "flat", "hier": "hierarchical", "hierarchical": "hierarchical"}


def algorithm_kw(spec: str) -> dict[str, str]:
    """The allreduce keyword a variant's '@flat' or '@hier' suffix asks for ({} without one)."""
    _, at, alg = spec.strip().lower().partition("@")
    if not at:
        return {}
    if alg not in _ALGORITHMS:
        raise ValueError(f"unknown algorithm {alg!r} in {spec!r}; known: {sorted(_ALGORITHMS)}")
    return {"algorithm": _ALGORITHMS[alg]}


def parse_compression(spec: str) -> Any:
    """'int8', 'int8:128', 'topk:0.01', 'topk:0.01:allgather', 'fp16', 'bf16', 'none' (an
    '@flat' or '@hier' suffix is the algorithm's, see ``algorithm_kw``)."""
    algorithm_kw(spec)  # check it
    name, *params = spec.strip().lower().partition("@")[0].split(":")
    if name == "none":
        return None
    if name == "auto":
        # auto:topk allows top-k at 1% besides fp16 and int8
        extra = (ringcomm.TopK(0.01),) if params and params[0] == "topk" else ()
        return ringcomm.Auto((None, ringcomm.FP16(), ringcomm.Int8(), *extra))
    if name == "fp16":
        return ringcomm.FP16()
    if name == "bf16":
        return ringcomm.BF16()
    if name == "int8":
        return ringcomm.Int8(block_size=int(params[0]) if params else 256)
    if name == "topk":
        ratio = float(params[0]) if params else 0.01
        algorithm = params[1] if len(params) > 1 else "ring"
        return ringcomm.TopK(ratio=ratio, algorithm=algorithm)
    raise ValueError(f"unknown compression {spec!r}")


def label_of(comp: Any) -> str:
    """The --compression spelling of a compressor."""
    if isinstance(comp, ringcomm.TopK):
        return f"topk:{comp.ratio:g}" + ("" if comp.algorithm == "ring" else ":allgather")
    if isinstance(comp, ringcomm.Int8):
        return "int8" if comp.block_size == 256 else f"int8:{comp.block_size}"
    return type(comp).__name__.lower()


def sizes(args: argparse.Namespace, itemsize: int) -> list[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(max(itemsize, s - s % itemsize))
        s *= args.stepfactor
    return out


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "numpy": np.__version__}
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
    return {"gpu": name, "nccl": _nccl_lib.load().version_string,
            "cupy": cupy.__version__}


def fmt_row(cols: list[tuple[str, int, str]], row: dict[str, Any]) -> str:
    parts = []
    for key, width, spec in cols:
        value = row.get(key)
        parts.append(f"{'-' if value is None else format(value, spec):>{width}}")
    return " ".join(parts)


# --------------------------------------------------------------------------------- timing
def _sync_for(x: Any) -> Any:
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().synchronize
    return lambda: None


def time_variants(world: Any, fns: dict[str, Any], iters: int, warmup: int,
                  sync: Any) -> dict[str, np.ndarray]:
    """Each iteration's slowest-rank time of every variant, each variant timed in turn.

    The order rotates every iteration, so each variant follows each other one equally often
    (what ran just before, e.g. a memcpy that evicted the caches, changes the next timing).
    """
    for _ in range(warmup):
        for f in fns.values():
            f()
        sync()
    funcs = list(fns.values())
    times = np.zeros((len(fns), iters))
    for i in range(iters):
        for j in range(len(funcs)):
            k = (i + j) % len(funcs)
            f = funcs[k]
            world.Barrier()
            t0 = time.perf_counter()
            f()
            sync()
            times[k, i] = time.perf_counter() - t0
    from mpi4py import MPI

    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: times[k] for k, name in enumerate(fns)}


def quartiles(values: np.ndarray) -> tuple[float, float, float]:
    """The first quartile, median and third quartile of ``values``."""
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return float(q1), float(q2), float(q3)


class PhaseTimes:
    """A tracer (``ringcomm.core.trace``) adding up the seconds each span label takes; nested
    spans count in their own label and in the enclosing one's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: dict[str, list[float]] = {}

    def begin(self, label: str) -> None:
        self._open.setdefault(label, []).append(time.perf_counter())

    def end(self, label: str) -> None:
        start = self._open[label].pop()
        self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start


def phase_ms(world: Any, fn: Any, calls: int, sync: Any) -> dict[str, float]:
    """Milliseconds per call of every span ``fn`` runs, the slowest rank's (collective)."""
    from ringcomm.core import trace

    tracer = PhaseTimes()
    trace.set_tracer(tracer)
    try:
        for _ in range(calls):
            world.Barrier()
            fn()
            sync()
    finally:
        trace.set_tracer(None)
    everyone = world.allgather(tracer.seconds)
    labels = sorted({label for mine in everyone for label in mine})
    return {label: 1e3 * max(m.get(label, 0.0) for m in everyone) / calls for label in labels}


def memcpy_fn(nbytes: int, rank: int) -> Any:
    """A single-process copy of ``nbytes`` (NumPy, host memory) on rank 0; a no-op elsewhere.

    Timed in turn with the collectives, so it sees the same machine state.
    """
    if rank != 0:
        return lambda: None
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return lambda: np.copyto(dst, src)


# ---------------------------------------------------------------------------------- checks
def _eps(dtype: np.dtype) -> float:
    if dtype.name == "bfloat16":
        return 2.0 ** -7
    return float(np.finfo(dtype).eps) if dtype.kind == "f" else 0.0


def count_wrong(world: Any, x: np.ndarray, y: np.ndarray, op: str) -> int:
    """Elements of ``y`` off the float64 reference by more than rounding, plus any rank whose
    result differs in a single bit from rank 0's (then every element counts as wrong)."""
    from mpi4py import MPI

    host_x, host_y = _host(x), _host(y)
    n = world.Get_size()
    if host_x.dtype.kind in "fV":  # V: bfloat16
        wide = host_x.astype(np.float64)
        ref = np.empty_like(wide)
        mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX,
                  "prod": MPI.PROD}[op]
        world.Allreduce(wide, ref, op=mpi_op)
        scale = np.empty_like(wide)
        world.Allreduce(np.abs(wide), scale, op=MPI.SUM if op in ("sum", "avg") else MPI.MAX)
        if op == "avg":
            ref /= n
            scale /= n
        if op == "prod":
            scale = np.abs(ref)
        tol = 4 * n * _eps(host_x.dtype) * (scale + np.finfo(np.float64).tiny)
        wrong = int(np.count_nonzero(~(np.abs(host_y.astype(np.float64) - ref) <= tol)))
    else:
        ref = np.empty_like(host_x)
        mpi_op = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op]
        world.Allreduce(host_x, ref, op=mpi_op)
        wrong = int(np.count_nonzero(host_y != ref))
    first = world.bcast(host_y.tobytes() if world.Get_rank() == 0 else None, root=0)  # bytes
    if host_y.tobytes() != first:
        wrong = host_y.size
    return int(world.allreduce(wrong, op=MPI.MAX))


def relative_error(world: Any, xs: np.ndarray, y: np.ndarray, op: str) -> float:
    """||y - exact|| / ||exact|| against the float64 reduction of the inputs."""
    from mpi4py import MPI

    wide = _host(xs).astype(np.float64)
    ref = np.empty_like(wide)
    world.Allreduce(wide, ref, op=MPI.SUM)
    if op == "avg":
        ref /= world.Get_size()
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(_host(y).astype(np.float64) - ref) / (denom or 1.0))


def _host(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


# ------------------------------------------------------------------------------- baselines
def _gloo_group(world: Any) -> Any:
    import torch.distributed as dist

    from ringcomm.torch.process_group import init_process_group_from_mpi

    if not dist.is_initialized():
        init_process_group_from_mpi(backend="gloo", mpi_comm=world)
    return dist


def baseline_fns(names: list[str], world: Any, x: Any, op: str) -> dict[str, Any]:
    """The baselines' allreduce calls on the same data, each writing its own output."""
    fns: dict[str, Any] = {}
    if "mpi" in names and isinstance(x, np.ndarray) and x.dtype.kind != "V":
        from mpi4py import MPI

        mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX,
                  "prod": MPI.PROD}[op]
        y = np.empty_like(x)
        if x.dtype == np.float16:
            # MPI has no half-precision sum on this library; time the same bytes as int16 max
            # would be misleading, so leave the column empty for half.
            pass
        else:
            fns["mpi"] = lambda: world.Allreduce(x, y, op=mpi_op)
    if "gloo" in names and isinstance(x, np.ndarray):
        import torch

        dist = _gloo_group(world)
        t = torch.from_numpy(x.copy())
        red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}[op]
        fns["gloo"] = lambda: dist.all_reduce(t, op=red)
    if "nccl" in names and not isinstance(x, np.ndarray):
        from nccl_baseline import allreduce_fn  # beside this script

        fns["nccl"] = allreduce_fn(world, x, op)
    return fns


# ------------------------------------------------------------------------------------ main
_COLUMNS = [
    ("size", 12, "d"), ("count", 11, "d"), ("type", 8, "s"), ("redop", 5, "s"),
    ("compression", 14, "s"), ("time_us", 10, ".1f"), ("algbw", 7, ".2f"), ("busbw", 7, ".2f"),
    ("wrong", 7, "d"), ("relerr", 8, ".1e"), ("wire_bytes", 11, "d"), ("ratio", 6, ".2f"),
]


def _columns(baselines: list[str], memcpy: bool) -> list[tuple[str, int, str]]:
    cols = list(_COLUMNS)
    for b in baselines:
        cols += [(f"{b}_time_us", 11, ".1f"), (f"{b}_busbw", 8, ".2f"), (f"vs_{b}", 7, ".2f")]
    if memcpy:
        cols += [("memcpy_GBps", 11, ".2f"), ("busbw_vs_memcpy", 15, ".2f")]
    return cols


def _header(cols: list[tuple[str, int, str]]) -> str:
    names = {"time_us": "time(us)", "algbw": "algbw", "busbw": "busbw", "wrong": "#wrong",
             "wire_bytes": "wire(B)", "memcpy_GBps": "memcpy(GB/s)"}
    return "#" + " ".join(f"{names.get(k, k):>{w}}" for k, w, _ in cols)[1:]


def _make_input(comm: Any, count: int, dtype: np.dtype, rank: int) -> Any:
    rng = np.random.default_rng(1234 + rank)
    if dtype.kind == "i":
        host = rng.integers(-8, 9, count).astype(dtype)
    else:
        host = rng.standard_normal(count).astype(dtype)
    if comm.backend == "nccl":
        import cupy

        return cupy.asarray(host)
    return host


def run_size(args: argparse.Namespace, comm: Any, world: Any, nbytes: int, dtype: np.dtype,
             variants: list[tuple[str, Any]], baselines: list[str]) -> list[dict[str, Any]]:
    n = comm.size
    count = nbytes // dtype.itemsize
    x = _make_input(comm, count, dtype, comm.rank)
    sync = _sync_for(x)
    outs = {label: None for label, _ in variants}
    fns: dict[str, Any] = {}
    feedback = ringcomm.ErrorFeedback()
    for label, comp in variants:
        out = x.copy()
        outs[label] = out
        kw = algorithm_kw(label)
        if comp is None:
            fns[label] = (lambda o=out, kw=kw: comm.allreduce(x, out=o, op=args.op, **kw))
        else:
            fns[label] = (lambda o=out, c=comp, lab=label, kw=kw: comm.allreduce(
                x, out=o, op=args.op, compression=c, feedback=feedback, name=lab, **kw))
    base = baseline_fns(baselines, world, x, args.op)
    if not args.no_memcpy:
        base["memcpy"] = memcpy_fn(nbytes, comm.rank)
    samples = time_variants(world, {**fns, **base}, args.iters, args.warmup_iters, sync)
    medians = {name: float(np.median(s)) for name, s in samples.items()}
    memcpy = medians.get("memcpy")
    rows, dense_wire = [], None
    for label, comp in variants:
        comm.stats.reset()
        fns[label]()
        wire = comm.stats.bytes_sent
        if comp is None and dense_wire is None:
            dense_wire = wire
        t = medians[label]
        q1, _, q3 = quartiles(samples[label])
        algbw = nbytes / t / 1e9
        row: dict[str, Any] = {
            "size": nbytes, "count": count, "type": args.datatype, "redop": args.op,
            "compression": label, "time_us": t * 1e6, "time_q1_us": q1 * 1e6,
            "time_q3_us": q3 * 1e6, "algbw": algbw,
            "busbw": algbw * 2 * (n - 1) / n if n > 1 else algbw, "wire_bytes": wire,
        }
        if isinstance(comp, ringcomm.Auto):  # what "auto" picked at this size
            choice = comp.resolve(comm.transport, comm.auto_figures, x, comm.inline_bytes)
            row["chose"] = "none" if choice is None else label_of(choice)
        if args.check:
            if comp is None:
                row["wrong"] = count_wrong(world, x, outs[label], args.op)
            else:
                feedback.reset()
                y = comm.allreduce(x, op=args.op, compression=comp, **algorithm_kw(label))
                row["relerr"] = relative_error(world, x, y, args.op)
        for b in baselines:
            if b in medians:
                bt = medians[b]
                row[f"{b}_time_us"] = bt * 1e6
                row[f"{b}_busbw"] = nbytes / bt / 1e9 * (2 * (n - 1) / n if n > 1 else 1)
                row[f"vs_{b}"] = bt / t
                # ringcomm's time over the baseline's, per iteration (both timed in it).
                low, mid, high = quartiles(samples[label] / samples[b])
                row[f"over_{b}"], row[f"over_{b}_q1"], row[f"over_{b}_q3"] = mid, low, high
        if args.phases:
            row["phases_ms"] = phase_ms(world, fns[label], args.phases, sync)
        if memcpy:
            row["memcpy_GBps"] = nbytes / memcpy / 1e9
            row["busbw_vs_memcpy"] = row["busbw"] / row["memcpy_GBps"]
        rows.append(row)
    for row in rows:
        if dense_wire and row["wire_bytes"]:
            row["ratio"] = dense_wire / row["wire_bytes"]
    return rows


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """busbw and time against size, one line per compression and baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for row in rows:
        series.setdefault(f"ringcomm {row['compression']}", []).append(
            (row["size"], row["busbw"], row["time_us"]))
        for key in row:
            if key.endswith("_time_us") and row[key] is not None and row["compression"] in (
                    "none", rows[0]["compression"]):
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comm = ringcomm.init(args.backend, segment_bytes=args.segment_bytes)
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Dup()
    dtype = _dtype(args.datatype)
    variants = [(s.strip(), parse_compression(s)) for s in args.compression.split(",")]
    if variants[0][1] is not None:
        variants.insert(0, ("none", None))  # the dense ring is the ratio's reference
    baseline = args.baseline or ("nccl" if comm.backend == "nccl" else "mpi")
    baselines = [b.strip() for b in baseline.split(",") if b.strip() not in ("", "none")]
    cols = _columns(baselines, not args.no_memcpy)
    info = machine()
    if comm.rank == 0:
        print(f"# ringcomm allreduce_perf: nranks {comm.size}, backend {comm.backend}, "
              f"segment {comm.segment_bytes} B, iters {args.iters}, warmup {args.warmup_iters}")
        gpu = f" | {info['gpu']}, NCCL {info['nccl']}" if "gpu" in info else ""
        print(f"# {info.get('cpu', '')} | {info.get('mpi', '')} | numpy {info['numpy']}{gpu}")
        print(_header(cols))
    rows = []
    for nbytes in sizes(args, dtype.itemsize):
        for row in run_size(args, comm, world, nbytes, dtype, variants, baselines):
            rows.append(row)
            if comm.rank == 0:
                print(fmt_row(cols, row), flush=True)
    if comm.rank == 0:
        wrong = sum(r.get("wrong") or 0 for r in rows)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        if args.json:
            meta = {"nranks": comm.size, "backend": comm.backend, "machine": info,
                    "segment_bytes": comm.segment_bytes, "args": vars(args)}
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if args.plot:
            plot(rows, args.plot, args.title or f"allreduce, {comm.size} ranks, {comm.backend}")
    comm.close()
    return 0 if all(not r.get("wrong") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
