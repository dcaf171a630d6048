"""The benchmark's run: each size's variants (ringcomm with each compression, out-of-place and
in-place) and baselines timed side by side, checked, and printed as rows on rank 0."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import ringcomm
from ringcomm.perf import baselines as _baselines
from ringcomm.perf import checks, options, report, timing

__all__ = ["main", "run_size"]


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


class _Variant:
    """One ringcomm variant of one size: its out-of-place and in-place calls and buffers."""

    def __init__(self, comm: Any, x: Any, label: str, comp: Any, op: str,
                 feedback: ringcomm.ErrorFeedback) -> None:
        self.label, self.comp = label, comp
        self.out, self.inplace = x.copy(), x.copy()
        kw: dict[str, Any] = dict(options.algorithm_kw(label), op=op)
        if comp is not None:
            kw.update(compression=comp, feedback=feedback, name=label)
        out, z = self.out, self.inplace
        self.run: Callable[[], Any] = lambda: comm.allreduce(x, out=out, **kw)
        self.run_in_place: Callable[[], Any] = lambda: comm.allreduce(z, out=z, **kw)
        self.restore: Callable[[], Any] = lambda: z.__setitem__(Ellipsis, x)


def run_size(args: argparse.Namespace, comm: Any, world: Any, nbytes: int, dtype: np.dtype,
             variants: list[tuple[str, Any]], baselines: list[str]) -> list[dict[str, Any]]:
    """Time, check and describe every variant at ``nbytes`` per rank (collective)."""
    n = comm.size
    count = nbytes // dtype.itemsize
    x = _make_input(comm, count, dtype, comm.rank)
    sync = timing.sync_for(x)
    feedback = ringcomm.ErrorFeedback()
    runs = [_Variant(comm, x, label, comp, args.op, feedback) for label, comp in variants]
    fns: dict[str, Callable[[], Any]] = {v.label: v.run for v in runs}
    before: dict[str, Callable[[], Any]] = {}
    if not args.no_inplace:
        for v in runs:
            fns[f"{v.label} in-place"] = v.run_in_place
            before[f"{v.label} in-place"] = v.restore
    base = _baselines.baseline_fns(baselines, world, x, args.op)
    if not args.no_memcpy:
        base["memcpy"] = timing.memcpy_fn(nbytes, comm.rank)
    samples = timing.time_variants(world, {**fns, **base}, args.iters, args.warmup_iters, sync,
                                   before)
    medians = {name: float(np.median(s)) for name, s in samples.items()}
    busbw_factor = 2 * (n - 1) / n  # nccl-tests' for allreduce: 0 at one rank, as there
    rows, dense_wire = [], None
    for v in runs:
        comm.stats.reset()
        v.run()
        wire = comm.stats.bytes_sent
        if v.comp is None and dense_wire is None:
            dense_wire = wire
        t = medians[v.label]
        q1, _, q3 = timing.quartiles(samples[v.label])
        algbw = nbytes / t / 1e9
        row: dict[str, Any] = {
            "size": nbytes, "count": count, "type": args.datatype, "redop": args.op,
            "compression": v.label, "time_us": t * 1e6, "time_q1_us": q1 * 1e6,
            "time_q3_us": q3 * 1e6, "spread": (q3 - q1) / t, "algbw": algbw,
            "busbw": algbw * busbw_factor, "wire_bytes": wire,
        }
        if not args.no_inplace:
            ip = medians[f"{v.label} in-place"]
            row.update(ip_time_us=ip * 1e6, ip_algbw=nbytes / ip / 1e9,
                       ip_busbw=nbytes / ip / 1e9 * busbw_factor)
        if isinstance(v.comp, ringcomm.Auto):  # what "auto" picked at this size
            choice = v.comp.resolve(comm.transport, comm.auto_figures, x, comm.inline_bytes)
            row["chose"] = "none" if choice is None else options.label_of(choice)
        if args.check:
            _check(row, args, comm, world, x, v, feedback)
        for b in baselines:
            if b in medians:
                bt = medians[b]
                row[f"{b}_time_us"] = bt * 1e6
                row[f"{b}_busbw"] = nbytes / bt / 1e9 * busbw_factor
                row[f"vs_{b}"] = bt / t
                # ringcomm's time over the baseline's, per iteration (both timed in it).
                low, mid, high = timing.quartiles(samples[v.label] / samples[b])
                row[f"over_{b}"], row[f"over_{b}_q1"], row[f"over_{b}_q3"] = mid, low, high
        if args.phases:
            row["phases_ms"] = timing.phase_ms(world, v.run, args.phases, sync)
        if "memcpy" in medians and medians["memcpy"] > 0:
            row["memcpy_GBps"] = nbytes / medians["memcpy"] / 1e9
            row["busbw_vs_memcpy"] = row["busbw"] / row["memcpy_GBps"]
        rows.append(row)
    for row in rows:
        if dense_wire and row["wire_bytes"]:
            row["ratio"] = dense_wire / row["wire_bytes"]
    return rows


def _check(row: dict[str, Any], args: argparse.Namespace, comm: Any, world: Any, x: Any,
           v: _Variant, feedback: ringcomm.ErrorFeedback) -> None:
    """#wrong (dense: out-of-place and in-place, from fresh inputs, against MPI's float64
    sum and rank 0's bits; compressed: elements whose bits differ from rank 0's, in one call
    without feedback and in the last in-place call timed) and, compressed, the relative
    error."""
    if v.comp is None:
        row["wrong"] = checks.count_wrong(world, x, v.out, args.op)
        if not args.no_inplace:
            v.restore()
            v.run_in_place()
            row["ip_wrong"] = checks.count_wrong(world, x, v.inplace, args.op)
        return
    if not args.no_inplace:
        row["ip_wrong"] = checks.count_differing(world, v.inplace)
    feedback.reset()
    y = comm.allreduce(x, op=args.op, compression=v.comp, **options.algorithm_kw(v.label))
    row["wrong"] = checks.count_differing(world, y)
    row["relerr"] = checks.relative_error(world, x, y, args.op)


def _agreed_args(argv: list[str]) -> tuple[Any, Any, argparse.Namespace | None, str | None]:
    """Start ringcomm and agree on the options: (communicator, MPI world, options, the
    problem every rank reports; no communicator where ringcomm refused to start). A rank's
    bad option, or options that differ between ranks (rank 0's output files aside), are told
    on every rank: a rank that left alone with its error left the others waiting in the
    start-up, and ranks of different sizes or counts waited for each other in mismatched
    calls."""
    args, problem = None, None
    try:
        args = options.parse_args(argv)
    except options.UsageError as err:
        problem = str(err)
    backend, segment = ((args.backend, args.segment_bytes) if args is not None
                        else options.start_options(argv))
    from mpi4py import MPI

    try:
        comm = ringcomm.init(backend, segment_bytes=segment)
    except ringcomm.InvalidArgumentError as err:  # refused on every rank alike
        return None, MPI.COMM_WORLD, args, (
            f"--backend {backend} --segment-bytes {segment}: {err.reason or err}")
    world = MPI.COMM_WORLD.Dup()
    if args is not None and args.json and comm.rank == 0:
        folder = Path(args.json).resolve().parent
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            problem = f"--json {args.json}: {folder} is no directory this process may write in"
    everyone = world.allgather((problem, None if args is None else options.agreed(args)))
    return comm, world, args, options.disagreement(everyone)


def _variants(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The ringcomm variants to time, (label, compressor): the dense ring first, once, the
    ratios' reference (named or not in the list)."""
    variants = [(s.strip(), options.parse_compression(s)) for s in args.compression.split(",")]
    dense = [v for v in variants if v[1] is None]
    return (dense or [("none", None)]) + [v for v in variants if v[1] is not None]


#: Elements of the call that tries each variant before the timing.
_PROBE_ELEMENTS = 16


def _refused(args: argparse.Namespace, comm: Any, variants: list[tuple[str, Any]]) -> str | None:
    """What ringcomm refuses among the variants with these options (its own argument checks,
    which fail on every rank alike), found by one call of each on a few elements before any
    timing (its bytes are no part of the job's traffic checks); None where it takes them all.
    (``-d int32 -o avg``, or int8 with ``-o max``, left a traceback on every rank and the job
    aborted.)"""
    dtype = options.dtype_of(args.datatype)
    x = _make_input(comm, _PROBE_ELEMENTS, dtype, comm.rank)
    for label, comp in variants:
        try:
            comm.allreduce(x, op=args.op, compression=comp, **options.algorithm_kw(label))
        except ringcomm.InvalidArgumentError as err:
            return f"-d {args.datatype} -o {args.op} --compression {label}: {err.reason or err}"
    return None


def _stop(comm: Any, world: Any, problem: str) -> int:
    """Say ``problem`` once (rank 0) and end with exit status 2 on every rank."""
    if world.Get_rank() == 0:
        print(f"ringcomm-perf: error: {problem}", file=sys.stderr, flush=True)
    if comm is not None:
        world.Free()
        comm.close()
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (under the launcher, on every rank); 0 when every check passed, 2
    where the options are bad on any rank, differ between ranks or ask for what ringcomm
    refuses (said by rank 0)."""
    comm, world, parsed, problem = _agreed_args(sys.argv[1:] if argv is None else list(argv))
    if problem is not None or parsed is None:
        return _stop(comm, world, str(problem))
    args = parsed
    dtype = options.dtype_of(args.datatype)
    variants = _variants(args)
    problem = _refused(args, comm, variants)
    if problem is not None:
        return _stop(comm, world, problem)
    baseline = args.baseline or ("nccl" if comm.backend == "nccl" else "mpi")
    baselines = [b.strip() for b in baseline.split(",") if b.strip() not in ("", "none")]
    table = report.Table(baselines, not args.no_inplace, not args.no_memcpy)
    info = report.machine()
    warning = report.load_warning(comm.local_size)
    if comm.rank == 0:
        print(f"# ringcomm-perf {ringcomm.__version__}: nranks {comm.size}, backend "
              f"{comm.backend}, segment {comm.segment_bytes} B, iters {args.iters}, warmup "
              f"{args.warmup_iters}")
        gpu = f" | {info['gpu']}, NCCL {info['nccl']}" if "gpu" in info else ""
        print(f"# {info.get('cpu', '')} | {info.get('mpi', '')} | numpy {info['numpy']}{gpu}")
        if warning:
            print(warning)
        print(table.header())
    timing.warm_up_job(world, comm, _baselines.baseline_fns(
        baselines, world, np.zeros(2, np.float32), args.op), args.job_warmup)
    rows = []
    for nbytes in options.sizes(args, dtype.itemsize):
        for row in run_size(args, comm, world, nbytes, dtype, variants, baselines):
            rows.append(row)
            if comm.rank == 0:
                print(table.row(row), flush=True)
    if comm.rank == 0:
        print("\n".join(report.summary(rows)), flush=True)
        if args.json:
            meta = {"nranks": comm.size, "backend": comm.backend, "machine": info,
                    "segment_bytes": comm.segment_bytes, "args": vars(args),
                    "load_warning": warning}
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if args.plot:
            report.plot(rows, args.plot,
                        args.title or f"allreduce, {comm.size} ranks, {comm.backend}")
    comm.close()
    failed = any(r.get("wrong") or r.get("ip_wrong") for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
