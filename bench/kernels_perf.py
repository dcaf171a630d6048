"""Effective bandwidth of ringcomm's CUDA kernels against a device-to-device copy.

    .venv/bin/python bench/kernels_perf.py [-n 64M] [--iters 50] [--json out.json]

The ceiling is a device-to-device copy of the same number of elements. Every kernel is timed
with CUDA events around one launch (median of --iters runs after --warmup runs), cycling
through --rotate independent sets of inputs so that no run finds its data in L2; its effective
bandwidth is (bytes read + bytes written) / time. Top-k at --ratio of the elements is also
compared with torch.topk (when PyTorch sees the GPU) and a CuPy sort-based selection on the
same data. Needs CuPy and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ringcomm.comm.types import ReduceOp
from ringcomm.ops import numpy as host_ops

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text: str) -> int:
    """'1000', '4K', '64M' -> elements."""
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a count like 4096, 4K or 64M, got {text!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--elements", type=parse_count, default=parse_count("64M"),
                   help="float32 elements per array (default 64M)")
    p.add_argument("--iters", type=int, default=50, help="timed runs per kernel")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    p.add_argument("--rotate", type=int, default=3, help="independent input sets cycled")
    p.add_argument("--block", type=int, default=256, help="int8 block size")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k fraction")
    p.add_argument("--only", default="", help="comma list of kernel names to run")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


class Timer:
    """Median time of a GPU operation with CUDA events, inputs rotated between runs."""

    def __init__(self, cupy: Any, iters: int, warmup: int) -> None:
        self.cupy, self.iters, self.warmup = cupy, iters, warmup

    def median_us(self, run: Callable[[int], Any], events: Any = None) -> float:
        """Median microseconds of ``run(i)`` (i counts runs, for rotating inputs)."""
        make = events or (lambda: self.cupy.cuda.Event())
        for i in range(self.warmup):
            run(i)
        times = []
        for i in range(self.iters):
            start, end = make(), make()
            start.record()
            run(self.warmup + i)
            end.record()
            end.synchronize()
            elapsed = (start.elapsed_time(end) if hasattr(start, "elapsed_time")
                       else self.cupy.cuda.get_elapsed_time(start, end))
            times.append(elapsed * 1e3)
        return float(np.median(times))


def _inputs(cupy: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """--rotate independent sets of every kernel's inputs and outputs."""
    n, block = args.elements, args.block
    rng = np.random.default_rng(0)  # on the host: cuRAND is not among the test extra's wheels
    sets = []
    for _ in range(args.rotate):
        x = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
        own = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
        s = {"x": x, "own": own, "out": cupy.empty(n, np.float32),
             "err": cupy.empty(n, np.float32), "h": x.astype(np.float16),
             "q": cupy.empty(host_ops.int8_nbytes(n, block), np.uint8),
             "q2": cupy.empty(host_ops.int8_nbytes(n, block), np.uint8),
             "w": cupy.empty(host_ops.cast_nbytes(n), np.uint8),
             "w2": cupy.empty(host_ops.cast_nbytes(n), np.uint8)}
        sets.append(s)
    return sets


def _kernels(cupy: Any, args: argparse.Namespace, sets: list[dict[str, Any]]) -> list[tuple]:
    """(name, bytes read + written, run(i)) of each benchmarked operation."""
    from ringcomm.ops import cuda as ops

    n, block = args.elements, args.block
    nb = -(-n // block)
    q_bytes = n + 4 * nb
    k = max(1, math.ceil(args.ratio * n))
    picked = np.random.default_rng(1).choice(n, size=k, replace=False)  # unique, as in payloads
    idx = cupy.asarray(np.sort(picked).astype(np.int32))

    def pick(i: int) -> dict[str, Any]:
        return sets[i % len(sets)]

    stoch = {"stochastic": True, "seed": 7, "base": 0}
    return [
        ("reduce f32+f32", 12 * n, lambda i: ops.reduce(ReduceOp.SUM, pick(i)["x"],
                                                         pick(i)["own"], pick(i)["out"])),
        ("reduce f32+f16->f32", 10 * n, lambda i: ops.reduce(ReduceOp.SUM, pick(i)["own"],
                                                              pick(i)["h"], pick(i)["out"])),
        ("copy f32->f16", 6 * n, lambda i: ops.copy(pick(i)["h"], pick(i)["x"])),
        ("compensate", 12 * n, lambda i: ops.compensate(pick(i)["x"], pick(i)["own"],
                                                         pick(i)["out"])),
        ("int8 quantize", 4 * n + q_bytes,
         lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block)),
        ("int8 quantize+error", 8 * n + q_bytes,
         lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block, error=pick(i)["err"])),
        ("int8 quantize stoch+error", 8 * n + q_bytes,
         lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block, error=pick(i)["err"],
                                   **stoch)),
        ("int8 dequantize", q_bytes + 4 * n,
         lambda i: ops.int8_decode(pick(i)["q"], pick(i)["out"], block)),
        ("int8 fused hop+error", 2 * q_bytes + 8 * n,
         lambda i: ops.int8_hop(pick(i)["q"], pick(i)["own"], pick(i)["q2"], block,
                                error=pick(i)["err"])),
        ("fp16 encode+error", 10 * n,
         lambda i: ops.cast_encode(pick(i)["x"], pick(i)["w"], "f16", error=pick(i)["err"])),
        ("bf16 hop+error", 12 * n,
         lambda i: ops.cast_hop(pick(i)["w"], pick(i)["own"], pick(i)["w2"], "bf16",
                                error=pick(i)["err"])),
        (f"scatter_add k={k}", 16 * k,
         lambda i: ops.scatter_add(pick(i)["out"], idx, pick(i)["own"][:k])),
        (f"topk exact k={k}", 4 * n + 8 * k, lambda i: ops.topk(pick(i)["x"], k)),
        (f"topk approximate k={k}", 4 * n + 8 * k,
         lambda i: ops.topk(pick(i)["x"], k, approximate=True, seed=i)),
    ]


def _topk_baselines(cupy: Any, args: argparse.Namespace, sets: list[dict[str, Any]],
                    timer: Timer) -> list[tuple[str, float]]:
    """torch.topk and a CuPy sort-based selection of the same k on the same data."""
    n = args.elements
    k = max(1, math.ceil(args.ratio * n))
    rows = []

    def sort_select(i: int) -> Any:
        order = cupy.argsort(cupy.abs(sets[i % len(sets)]["x"]))
        return cupy.sort(order[n - k:])  # ascending indices, as ringcomm returns them

    rows.append((f"cupy argsort select k={k}", timer.median_us(sort_select)))
    try:
        import torch
    except ImportError:
        return rows
    if not torch.cuda.is_available():
        return rows
    tensors = [torch.from_dlpack(s["x"]) for s in sets]

    def torch_topk(i: int) -> Any:
        return torch.topk(tensors[i % len(tensors)].abs(), k, sorted=False)

    rows.append((f"torch.topk k={k}", timer.median_us(torch_topk,
                                                      lambda: torch.cuda.Event(True))))
    return rows


def _device(cupy: Any) -> dict[str, Any]:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"name": name, "compute_capability": dev.compute_capability,
            "memory_bytes": int(props["totalGlobalMem"]), "sms": int(props["multiProcessorCount"]),
            "cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "host": platform.node()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as err:
        print(f"kernels_perf needs CuPy and a CUDA GPU ({err})", file=sys.stderr)
        return 2
    timer = Timer(cupy, args.iters, args.warmup)
    sets = _inputs(cupy, args)
    n = args.elements

    def copy(i: int) -> None:
        s = sets[i % len(sets)]
        s["out"].data.copy_from_device(s["x"].data, 4 * n)

    copy_us = timer.median_us(copy)
    ceiling = 8 * n / copy_us / 1e3
    rows = [{"kernel": "d2d copy f32 (ceiling)", "bytes": 8 * n, "us": copy_us,
             "gbps": ceiling, "of_copy": 1.0}]
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for name, nbytes, run in _kernels(cupy, args, sets):
        if only and name.split(" k=")[0] not in only:
            continue
        us = timer.median_us(run)
        rows.append({"kernel": name, "bytes": nbytes, "us": us, "gbps": nbytes / us / 1e3,
                     "of_copy": nbytes / us / 1e3 / ceiling})
    baselines = [] if only else _topk_baselines(cupy, args, sets, timer)
    for name, us in baselines:
        rows.append({"kernel": name, "bytes": None, "us": us, "gbps": None, "of_copy": None})
    device = _device(cupy)
    print(f"# {device['name']} (sm_{''.join(map(str, device['compute_capability']))}), "
          f"{n} float32 elements, median of {args.iters} runs")
    print(f"{'kernel':<34}{'bytes':>14}{'time (us)':>12}{'GB/s':>9}{'of copy':>9}")
    for r in rows:
        gbps = f"{r['gbps']:9.1f}" if r["gbps"] is not None else f"{'-':>9}"
        frac = f"{r['of_copy']:9.0%}" if r["of_copy"] is not None else f"{'-':>9}"
        nbytes = f"{r['bytes']:14d}" if r["bytes"] is not None else f"{'-':>14}"
        print(f"{r['kernel']:<34}{nbytes}{r['us']:12.1f}{gbps}{frac}")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "elements": n, "block": args.block,
                                         "ratio": args.ratio, "iters": args.iters,
                                         "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
