"""The benchmark's command line: nccl-tests' flags (-b -e -f -n -w -c -d -o) and ringcomm's own
(compression variants, baselines, output files), and the sizes they name."""

from __future__ import annotations

import argparse
import re
from typing import Any

import numpy as np

import ringcomm
from ringcomm.core.types import ReduceOp

__all__ = ["DTYPES", "algorithm_kw", "dtype_of", "label_of", "parse_args", "parse_compression",
           "parse_size", "sizes"]

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (``argv``: the command line's when None)."""
    p = argparse.ArgumentParser(prog="ringcomm-perf", description=DESCRIPTION,
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
    args = p.parse_args(argv)
    if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.iters < 1:
        p.error(f"need minbytes <= maxbytes, stepfactor >= 2 and iters >= 1; got -b "
                f"{args.minbytes} -e {args.maxbytes} -f {args.stepfactor} -n {args.iters}")
    try:
        for spec in args.compression.split(","):
            parse_compression(spec)
    except ValueError as err:
        p.error(str(err))
    return args


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
    raise ValueError(f"unknown compression {spec!r}; known: none, fp16, bf16, int8[:block], "
                     f"topk:RATIO[:ring|allgather], auto, auto:topk")


def label_of(comp: Any) -> str:
    """The --compression spelling of a compressor."""
    if isinstance(comp, ringcomm.TopK):
        return f"topk:{comp.ratio:g}" + ("" if comp.algorithm == "ring" else ":allgather")
    if isinstance(comp, ringcomm.Int8):
        return "int8" if comp.block_size == 256 else f"int8:{comp.block_size}"
    return type(comp).__name__.lower()


def sizes(args: argparse.Namespace, itemsize: int) -> list[int]:
    """The sizes from -b to -e, each -f times the last, whole elements of ``itemsize``."""
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(max(itemsize, s - s % itemsize))
        s *= args.stepfactor
    return out
