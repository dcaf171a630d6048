"""The benchmark's command line: nccl-tests' flags (-b -e -f -n -w -c -d -o) and ringcomm's own
(compression variants, baselines, output files), and the sizes they name."""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

import numpy as np

import ringcomm
from ringcomm.comm._mismatch import rank_groups, ranks_text
from ringcomm.core.types import ReduceOp

__all__ = ["DTYPES", "UsageError", "agreed", "algorithm_kw", "disagreement", "dtype_of",
           "label_of", "parse_args", "parse_compression", "parse_size", "sizes", "start_options"]

#: nccl-tests' type names and the NumPy dtypes they stand for.
DTYPES = {"half": "float16", "float": "float32", "double": "float64", "int32": "int32",
          "int64": "int64", "bfloat16": "bfloat16"}
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_ALGORITHMS = {"flat": "flat", "hier": "hierarchical", "hierarchical": "hierarchical"}

DESCRIPTION = """\
Allreduce bandwidth benchmark in the style of nccl-tests' all_reduce_perf, run under the
launcher, one process per rank: mpiexec -n 2 ringcomm-perf -b 8 -e 128M -f 2.

Every row times ringcomm and its baselines in the same run, interleaved iteration by iteration
so that machine noise hits them alike, and reports medians with their spread."""


def dtype_of(name: str) -> np.dtype:
    """nccl-tests' type names as NumPy dtypes (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[name])


def parse_size(text: str) -> int:
    """'256', '4K', '16M', '1G' -> bytes."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 8, 4K, 16M or 1G, got {text!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


#: Options that only rank 0 uses (its output files): they may differ between ranks.
RANK0_ONLY = ("json", "plot", "title")


class UsageError(ValueError):
    """An option the benchmark cannot run with: what was expected, what came."""


class _Parser(argparse.ArgumentParser):
    """Raises UsageError instead of exiting: every rank must hear of a rank's bad option
    before any of them leaves (run.main agrees on them), or the others wait in the start-up."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> _Parser:
    p = _Parser(prog="ringcomm-perf", description=DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"),
                   help="smallest size per rank (default 32M)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"),
                   help="largest size per rank (default 32M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the size by this much each step (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="untimed iterations first (default 5)")
    p.add_argument("--job-warmup", type=int, default=500,
                   help="8-byte allreduces of ringcomm and of each baseline before the first "
                        "size, untimed (default 500): a job's first few hundred calls run "
                        "slower")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="check results (1) or not (0); default 1")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
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
    p.add_argument("--no-inplace", action="store_true",
                   help="skip the in-place columns (out-of-place only)")
    p.add_argument("--json", metavar="FILE", help="write the rows and the machine as JSON")
    p.add_argument("--plot", metavar="FILE",
                   help="plot busbw and time against size (PNG; needs matplotlib)")
    p.add_argument("--title", help="the plot's title")
    p.add_argument("--phases", type=int, default=0, metavar="CALLS",
                   help="after the timing, run each variant CALLS more times with a tracer and "
                        "report the seconds per call of every phase span (slowest rank)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (``argv``: the command line's when None).

    Raises:
        UsageError: an option that is malformed or out of range, saying what was expected.
    """
    p = _parser()
    args = p.parse_args(argv)
    if not (1 <= args.minbytes <= args.maxbytes) or args.stepfactor < 2 or args.iters < 1:
        p.error(f"need 1 <= minbytes <= maxbytes, stepfactor >= 2 and iters >= 1; got -b "
                f"{args.minbytes} -e {args.maxbytes} -f {args.stepfactor} -n {args.iters}")
    for flag, value in (("-w/--warmup_iters", args.warmup_iters),
                        ("--job-warmup", args.job_warmup), ("--phases", args.phases)):
        if value < 0:
            p.error(f"{flag} must be >= 0, got {value}")
    if args.check not in (0, 1):
        p.error(f"-c/--check must be 0 or 1, got {args.check}")
    specs = [spec.strip().lower() for spec in args.compression.split(",")]
    try:
        for spec in specs:
            parse_compression(spec)
    except ValueError as err:
        p.error(str(err))
    twice = sorted({spec for spec in specs if specs.count(spec) > 1})
    if twice:
        p.error(f"--compression names {', '.join(twice)} more than once")
    if args.baseline is not None:
        from ringcomm.perf.baselines import KNOWN

        unknown = sorted({b.strip() for b in args.baseline.split(",")} - {*KNOWN, "none", ""})
        if unknown:
            p.error(f"unknown baseline {', '.join(unknown)}; known: {', '.join(KNOWN)}, none")
    return args


def start_options(argv: list[str]) -> tuple[str, int | None]:
    """The backend and segment size to start with where ``argv`` has a bad option (so that
    ringcomm's start-up agrees, and the bad option is told on every rank next)."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--backend", default="auto")
    p.add_argument("--segment-bytes", default=None)
    try:
        known, _ = p.parse_known_args(argv)
        segment = None if known.segment_bytes is None else parse_size(known.segment_bytes)
    except (argparse.ArgumentError, argparse.ArgumentTypeError):
        return "auto", None
    backend = known.backend if known.backend in ("auto", "mpi", "nccl") else "auto"
    return backend, segment


def agreed(args: argparse.Namespace) -> dict[str, Any]:
    """The options every rank must share (all but rank 0's output files)."""
    return {k: v for k, v in vars(args).items() if k not in RANK0_ONLY}


def disagreement(everyone: list[tuple[str | None, dict[str, Any] | None]]) -> str | None:
    """What is wrong with the ranks' options, each rank's (problem, ``agreed`` options) in
    rank order: the ranks' problems, else the options that differ, each rank's value; None
    where they agree."""
    problems: dict[str, list[int]] = {}
    for rank, (problem, _) in enumerate(everyone):
        if problem:
            problems.setdefault(problem, []).append(rank)
    if problems:
        return "; ".join(f"{ranks_text(ranks)}: {problem}" for problem, ranks in problems.items())
    first = everyone[0][1] or {}
    flags = {a.dest: "/".join(a.option_strings) for a in _parser()._actions}
    differ = []
    for key in first:
        values = [repr((opts or {}).get(key)) for _, opts in everyone]
        if len(set(values)) > 1:
            differ.append(f"{flags.get(key, key)} differs between ranks: {rank_groups(values)}")
    return "; ".join(differ) or None


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
    form = _FORMS.get(name)
    if form is None:
        raise ValueError(f"unknown compression {spec!r}; known: {', '.join(_FORMS.values())}")
    if len(params) > form.count(":") or (name == "auto" and params not in ([], ["topk"])):
        raise ValueError(f"{spec!r} is not of the form {form}")
    if name == "none":
        return None
    if name == "auto":
        # auto:topk allows top-k at 1% besides bf16 and int8 (the default candidates)
        extra = (ringcomm.TopK(0.01),) if params else ()
        return ringcomm.Auto((*ringcomm.Auto().candidates, *extra))
    if name == "fp16":
        return ringcomm.FP16()
    if name == "bf16":
        return ringcomm.BF16()
    if name == "int8":
        return ringcomm.Int8(block_size=_number(int, params[0], spec, "block size")
                             if params else 256)
    ratio = _number(float, params[0], spec, "ratio") if params else 0.01
    return ringcomm.TopK(ratio=ratio, algorithm=params[1] if len(params) > 1 else "ring")


_FORMS = {"none": "none", "fp16": "fp16", "bf16": "bf16", "int8": "int8[:block]",
          "topk": "topk:RATIO[:ring|allgather]", "auto": "auto[:topk]"}


def _number(kind: type, text: str, spec: str, what: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"the {what} in {spec!r} must be a "
                         f"{'whole number' if kind is int else 'number'}, got {text!r}") from None


def label_of(comp: Any) -> str:
    """The --compression spelling of a compressor."""
    if isinstance(comp, ringcomm.TopK):
        return f"topk:{comp.ratio:g}" + ("" if comp.algorithm == "ring" else ":allgather")
    if isinstance(comp, ringcomm.Int8):
        return "int8" if comp.block_size == 256 else f"int8:{comp.block_size}"
    return type(comp).__name__.lower()


def sizes(args: argparse.Namespace, itemsize: int) -> list[int]:
    """The sizes from -b to -e, each -f times the last, in whole elements of ``itemsize`` (one
    at least), each once."""
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        size = max(itemsize, s - s % itemsize)
        if size not in out:
            out.append(size)
        s *= args.stepfactor
    return out
