"""CPU codecs against a memcpy of the same bytes: the NumPy reference, the compiled kernels, torch.

    .venv/bin/python bench/codecs_perf.py [--sizes 64M,1M] [-n 21] [-w 3]

One thread. For each size (bytes of float32 input) every codec runs in each implementation
that has it, all interleaved within every iteration with a memcpy of the input's bytes
(``np.copyto`` into a preallocated array), and is reported as median time / median memcpy
time. Implementations:

- ``numpy``: ringcomm.ops.numpy, the reference (what ``RINGCOMM_CPU_KERNELS=numpy`` runs);
- ``blocked``: the same reference functions called on 64 KiB pieces, so that their passes
  over memory stay in the L2 cache (the better-NumPy alternative to compiling);
- ``numba``: ringcomm.ops.cpu, the compiled kernels (the default for NumPy arrays);
- ``torch``: what PyTorch's CPU kernels do for the same job, where it has one, into
  preallocated tensors (``.copy_`` to half/bfloat16 and back, ``torch.topk``). Not
  bit-identical: they quiet signalling NaNs (fp16) or write 0xffff for every NaN (bf16).

``same`` says whether the compiled output (payload, decoded values and error-feedback output)
equals the reference's bit for bit on the benchmark's data, with NaN, Inf, -0.0 and subnormals
mixed in. Compile costs are measured in fresh processes with an empty and then a warm Numba
cache. Writes bench/results/codecs_perf.md and .json with the machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ringcomm.ops import cpu
from ringcomm.ops import numpy as ref
from ringcomm.ops._host import int8_views
from ringcomm.perf.options import parse_size
from ringcomm.perf.report import machine

Run = Callable[[], Any]
_RESULTS = Path(__file__).resolve().parent / "results"
_PIECE = 1 << 14  # elements per piece of the blocked variant: 64 KiB of float32
_IMPLS = ("numpy", "blocked", "numba", "torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64M,1M",
                   help="comma list of input sizes in bytes of float32 (default 64M,1M)")
    p.add_argument("-n", "--iters", type=int, default=21, help="timed iterations")
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed iterations first")
    p.add_argument("--block", type=int, default=256, help="int8 block size")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k fraction")
    p.add_argument("--no-compile-cost", action="store_true",
                   help="skip the fresh-process compile measurements")
    p.add_argument("--out", type=Path, default=_RESULTS / "codecs_perf",
                   help="output path without suffix (.md and .json are written)")
    return p.parse_args(argv)


def test_data(n: int, seed: int = 0) -> np.ndarray:
    """Gradient-like float32 values with a few NaN, +-Inf, -0.0 and subnormals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 64:
        for value in (np.nan, np.inf, -np.inf, -0.0, 1e-42, -3e-39):
            x[rng.integers(0, n, 2)] = value
    return x


# --------------------------------------------------------------------- the blocked variant
def _pieces(n: int, block: int) -> range:
    return range(0, n, max(block, _PIECE // block * block))


def _blocked_int8(n: int, block: int, run: Callable[[slice, np.ndarray, np.ndarray], Any],
                  out: np.ndarray, tmp: np.ndarray) -> None:
    """Run ``run(piece, piece_payload)`` per piece, then move each piece's scales and q into
    ``out`` (the payload of the whole array)."""
    scales, q = int8_views(out, n, block)
    step = _pieces(n, block).step
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        pay = tmp[: ref.int8_nbytes(hi - lo, block)]
        run(slice(lo, hi), pay, tmp)
        ps, pq = int8_views(pay, hi - lo, block)
        scales[lo // block: lo // block + ps.size] = ps
        q[lo:hi] = pq


def blocked_int8_encode(src: np.ndarray, out: np.ndarray, block: int, tmp: np.ndarray,
                        error: np.ndarray | None = None) -> None:
    """ringcomm.ops.numpy.int8_encode, piece by piece."""
    _blocked_int8(src.size, block, lambda s, pay, _: ref.int8_encode(
        src[s], pay, block, error=None if error is None else error[s]), out, tmp)


def blocked_int8_hop(payload: np.ndarray, own: np.ndarray, out: np.ndarray, block: int,
                     tmp: np.ndarray, tmp_in: np.ndarray, error: np.ndarray | None = None
                     ) -> None:
    """ringcomm.ops.numpy.int8_hop, piece by piece (each piece's input payload gathered)."""
    n = own.size
    scales, q = int8_views(payload, n, block)

    def hop(s: slice, pay: np.ndarray, _: np.ndarray) -> None:
        src = tmp_in[: pay.size]
        ps, pq = int8_views(src, s.stop - s.start, block)
        ps[:] = scales[s.start // block: s.start // block + ps.size]
        pq[:] = q[s]
        ref.int8_hop(src, own[s], pay, block, error=None if error is None else error[s])

    _blocked_int8(n, block, hop, out, tmp)


def blocked_cast(fn: Callable[..., Any], n: int, *arrays_and_fmt: Any,
                 error: np.ndarray | None = None) -> None:
    """A cast operation piece by piece: float32 arrays are cut by elements, payloads (uint8)
    by 2 bytes per element."""
    *arrays, fmt = arrays_and_fmt
    for lo in range(0, n, _PIECE):
        hi = min(lo + _PIECE, n)
        parts = [a[2 * lo: 2 * hi] if a.dtype == np.uint8 else a[lo:hi] for a in arrays]
        if error is None:
            fn(*parts, fmt)
        else:
            fn(*parts, fmt, error=error[lo:hi])


# ----------------------------------------------------------------------------------- codecs
class Case:
    """One codec: how each implementation runs it, and its outputs under an ops module."""

    def __init__(self, name: str, runs: dict[str, Run],
                 outputs: Callable[[Any], list[np.ndarray]] | None = None) -> None:
        self.name, self.runs, self.outputs = name, runs, outputs

    def same(self) -> bool | None:
        """Whether the compiled outputs equal the reference's, bit for bit."""
        if self.outputs is None:
            return None
        return all(a.tobytes() == b.tobytes()
                   for a, b in zip(self.outputs(ref), self.outputs(cpu), strict=True))


class Arrays:
    """The inputs and preallocated outputs of every case at one size."""

    def __init__(self, n: int, block: int) -> None:
        self.n, self.block = n, block
        self.x, self.own = test_data(n, 0), test_data(n, 1)
        self.err, self.dec = np.empty(n, np.float32), np.empty(n, np.float32)
        self.i8_in = np.empty(ref.int8_nbytes(n, block), np.uint8)
        self.i8_out = np.empty_like(self.i8_in)
        self.tmp = np.empty(ref.int8_nbytes(_pieces(n, block).step, block), np.uint8)
        self.tmp_in = np.empty_like(self.tmp)
        ref.int8_encode(self.x, self.i8_in, block)
        self.words = {f: np.empty(ref.cast_nbytes(n), np.uint8) for f in ("f16", "bf16")}
        for fmt, words in self.words.items():
            ref.cast_encode(self.x, words, fmt)
        self.cast_out = np.empty(ref.cast_nbytes(n), np.uint8)

    def fresh(self, *shapes: tuple[int, Any]) -> list[np.ndarray]:
        """Outputs filled with garbage, so an element left unwritten shows."""
        return [np.full(size, 0x7B, np.uint8).view(dtype) for size, dtype in shapes]


def int8_cases(a: Arrays) -> list[Case]:
    x, own, b, n = a.x, a.own, a.block, a.n
    nb = ref.int8_nbytes(n, b)

    def encoded(m: Any, **kw: Any) -> list[np.ndarray]:
        pay, err = a.fresh((nb, np.uint8), (4 * n, np.float32))
        m.int8_encode(x, pay, b, error=err, **kw)
        return [pay, err]

    def hopped(m: Any) -> list[np.ndarray]:
        pay, err = a.fresh((nb, np.uint8), (4 * n, np.float32))
        m.int8_hop(a.i8_in, own, pay, b, error=err)
        return [pay, err]

    def decoded(m: Any) -> list[np.ndarray]:
        (out,) = a.fresh((4 * n, np.float32))
        m.int8_decode(a.i8_in, out, b)
        return [out]

    o, e = a.i8_out, a.err
    return [
        Case("int8 encode", {
            "numpy": lambda: ref.int8_encode(x, o, b),
            "blocked": lambda: blocked_int8_encode(x, o, b, a.tmp),
            "numba": lambda: cpu.int8_encode(x, o, b)}, encoded),
        Case("int8 encode + error", {
            "numpy": lambda: ref.int8_encode(x, o, b, error=e),
            "blocked": lambda: blocked_int8_encode(x, o, b, a.tmp, error=e),
            "numba": lambda: cpu.int8_encode(x, o, b, error=e)}, encoded),
        Case("int8 encode stochastic + error", {
            "numpy": lambda: ref.int8_encode(x, o, b, stochastic=True, seed=3, error=e),
            "numba": lambda: cpu.int8_encode(x, o, b, stochastic=True, seed=3, error=e)},
            lambda m: encoded(m, stochastic=True, seed=3)),
        Case("int8 decode", {
            "numpy": lambda: ref.int8_decode(a.i8_in, a.dec, b),
            "numba": lambda: cpu.int8_decode(a.i8_in, a.dec, b)}, decoded),
        Case("int8 hop (fused)", {
            "numpy": lambda: ref.int8_hop(a.i8_in, own, o, b),
            "blocked": lambda: blocked_int8_hop(a.i8_in, own, o, b, a.tmp, a.tmp_in),
            "numba": lambda: cpu.int8_hop(a.i8_in, own, o, b)}, hopped),
        Case("int8 hop + error", {
            "numpy": lambda: ref.int8_hop(a.i8_in, own, o, b, error=e),
            "blocked": lambda: blocked_int8_hop(a.i8_in, own, o, b, a.tmp, a.tmp_in, error=e),
            "numba": lambda: cpu.int8_hop(a.i8_in, own, o, b, error=e)}, hopped),
    ]


def cast_cases(a: Arrays, fmt: str, torch: Any) -> list[Case]:
    x, own, n, words, o, e = a.x, a.own, a.n, a.words[fmt], a.cast_out, a.err
    name = {"f16": "fp16", "bf16": "bf16"}[fmt]

    def outputs(op: str) -> Callable[[Any], list[np.ndarray]]:
        def run(m: Any) -> list[np.ndarray]:
            pay, err, dec = a.fresh((2 * n, np.uint8), (4 * n, np.float32),
                                    (4 * n, np.float32))
            if op == "encode":
                m.cast_encode(x, pay, fmt, error=err)
            elif op == "hop":
                m.cast_hop(words, own, pay, fmt, error=err)
            m.cast_decode(words, dec, fmt)
            return [pay, err, dec]
        return run

    def with_torch(runs: dict[str, Run], torch_run: Run | None) -> dict[str, Run]:
        return {**runs, "torch": torch_run} if torch_run is not None else runs

    t_enc = t_dec = None
    if torch is not None:
        kind = torch.float16 if fmt == "f16" else torch.bfloat16
        xt, ht, dt = torch.from_numpy(x), torch.empty(n, dtype=kind), torch.from_numpy(a.dec)
        t_enc, t_dec = (lambda: ht.copy_(xt)), (lambda: dt.copy_(ht))
    return [
        Case(f"{name} encode", with_torch({
            "numpy": lambda: ref.cast_encode(x, o, fmt),
            "blocked": lambda: blocked_cast(ref.cast_encode, n, x, o, fmt),
            "numba": lambda: cpu.cast_encode(x, o, fmt)}, t_enc), outputs("encode")),
        Case(f"{name} encode + error", {
            "numpy": lambda: ref.cast_encode(x, o, fmt, error=e),
            "blocked": lambda: blocked_cast(ref.cast_encode, n, x, o, fmt, error=e),
            "numba": lambda: cpu.cast_encode(x, o, fmt, error=e)}, outputs("encode")),
        Case(f"{name} decode", with_torch({
            "numpy": lambda: ref.cast_decode(words, a.dec, fmt),
            "blocked": lambda: blocked_cast(ref.cast_decode, n, words, a.dec, fmt),
            "numba": lambda: cpu.cast_decode(words, a.dec, fmt)}, t_dec), outputs("decode")),
        Case(f"{name} hop + error", {
            "numpy": lambda: ref.cast_hop(words, own, o, fmt, error=e),
            "blocked": lambda: blocked_cast(ref.cast_hop, n, words, own, o, fmt, error=e),
            "numba": lambda: cpu.cast_hop(words, own, o, fmt, error=e)}, outputs("hop")),
    ]


def topk_case(a: Arrays, ratio: float, torch: Any) -> Case:
    k = max(1, int(a.n * ratio))
    runs: dict[str, Run] = {"numpy": lambda: ref.topk(a.x, k), "numba": lambda: cpu.topk(a.x, k)}
    if torch is not None:
        xt = torch.from_numpy(a.x)
        runs["torch"] = lambda: torch.topk(xt.abs(), k, sorted=False)
    return Case(f"top-k {ratio:g} exact", runs, lambda m: list(m.topk(a.x, k)))


# ----------------------------------------------------------------------------------- timing
def _seconds(run: Run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def measure(cases: list[Case], n: int, iters: int, warmup: int) -> dict[str, Any]:
    """Median seconds of every (case, implementation) and of the memcpy, all interleaved: each
    iteration times a memcpy before every case, then the case's implementations in turn."""
    src, dst = test_data(n), np.empty(n, np.float32)
    copies: list[float] = []
    times: dict[tuple[str, str], list[float]] = {}
    for it in range(warmup + iters):
        for case in cases:
            t = _seconds(lambda: np.copyto(dst, src))
            if it >= warmup:
                copies.append(t)
            for impl, run in case.runs.items():
                t = _seconds(run)
                if it >= warmup:
                    times.setdefault((case.name, impl), []).append(t)
    memcpy = float(np.median(copies))
    rows = []
    for case in cases:
        row: dict[str, Any] = {"codec": case.name, "same": case.same()}
        for impl in _IMPLS:
            samples = times.get((case.name, impl))
            if samples:
                row[f"{impl}_ms"] = 1e3 * float(np.median(samples))
                row[impl] = float(np.median(samples)) / memcpy
        rows.append(row)
    return {"bytes": 4 * n, "elements": n, "memcpy_ms": 1e3 * memcpy, "rows": rows}


_COMPILE_PROBE = """
import json, time
t0 = time.perf_counter()
import numpy as np
from ringcomm.ops import cpu
t1 = time.perf_counter()
kernels = cpu.kernels()
t2 = time.perf_counter()
x = np.ones(1000, np.float32)
cpu.int8_encode(x, np.empty(cpu.int8_nbytes(1000, 256), np.uint8), 256)
t3 = time.perf_counter()
compiled = cpu.prepare()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "numba_s": t2 - t1, "first_call_s": t3 - t2,
                  "all_kernels_s": t4 - t3, "kernels": len(kernels.KERNELS),
                  "compiled": compiled}))
"""


def compile_costs() -> dict[str, Any]:
    """Seconds to import ringcomm.ops.cpu, import Numba, make the first call (int8_encode:
    one kernel) and then have every other kernel, in fresh processes: with an empty Numba
    cache (compiling), then with the cache the first left (loading)."""
    costs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, check=True,
                                 capture_output=True, text=True).stdout
            costs[label] = json.loads(out.strip().splitlines()[-1])
    return costs


# ----------------------------------------------------------------------------------- report
def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return f"{value:.2f}"


def markdown(result: dict[str, Any]) -> str:
    lines = ["# CPU codecs against a memcpy of the same bytes", "",
             "Time of each codec as a multiple of a memcpy of its float32 input (one thread; "
             "every implementation and the memcpy interleaved within each iteration; medians "
             f"of {result['iters']} iterations after {result['warmup']}). Columns: the NumPy "
             "reference, the reference on 64 KiB pieces, the compiled kernels (the default), "
             "PyTorch's CPU kernels into preallocated tensors. `same`: compiled output "
             "(payload, decoded values, error-feedback output) bit-identical with the "
             "reference on data with NaN, Inf, -0.0 and subnormals. Reproduce with "
             "`.venv/bin/python bench/codecs_perf.py`.", ""]
    m = result["machine"]
    lines += [f"Machine: {m.get('cpu')}, {m.get('platform')}; Python {m.get('python')}, "
              f"NumPy {m.get('numpy')}, Numba {result['numba']}, torch {result['torch']}. "
              f"Load average {result['load_before'][0]:.2f} before and "
              f"{result['load_after'][0]:.2f} after the run on {os.cpu_count()} cores "
              f"({result['busy']}).", ""]
    for size in result["sizes"]:
        lines += [f"## {size['bytes'] >> 20} MiB float32 ({size['elements']} elements), "
                  f"memcpy {size['memcpy_ms']:.3f} ms", "",
                  "| codec | numpy | blocked | numba | torch | same |",
                  "| --- | ---: | ---: | ---: | ---: | :---: |"]
        for row in size["rows"]:
            cells = [_cell(row.get(impl)) for impl in _IMPLS]
            lines.append(f"| {row['codec']} | {' | '.join(cells)} | {_cell(row['same'])} |")
        lines.append("")
    costs = result.get("compile")
    if costs:
        n = next(iter(costs.values()))["kernels"]
        lines += ["## Compile cost (fresh processes)", "",
                  "Kernels compile on first use (or load from Numba's on-disk cache); "
                  "`int8_encode` is the first call's one kernel.", "",
                  "| Numba cache | import ringcomm.ops.cpu (s) | import Numba (s) | first call, "
                  f"int8_encode (s) | the other {n - 1} kernels (s) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for label, c in costs.items():
            lines.append(f"| {label} | {c['import_s']:.3f} | {c['numba_s']:.3f} | "
                         f"{c['first_call_s']:.3f} | {c['all_kernels_s']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def _versions() -> tuple[str, str, Any]:
    try:
        import numba
        numba_version = numba.__version__
    except ImportError:
        numba_version = "absent"
    try:
        import torch
        torch.set_num_threads(1)
        return numba_version, torch.__version__, torch
    except ImportError:
        return numba_version, "absent", None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    numba_version, torch_version, torch = _versions()
    if cpu.kernels() is None:
        print("warning: the compiled kernels are unavailable; 'numba' runs the reference",
              file=sys.stderr)
    load_before = os.getloadavg()
    sizes = []
    for text in args.sizes.split(","):
        n = parse_size(text) // 4
        a = Arrays(n, args.block)
        cases = [*int8_cases(a), *cast_cases(a, "f16", torch), *cast_cases(a, "bf16", torch),
                 topk_case(a, args.ratio, torch)]
        sizes.append(measure(cases, n, args.iters, args.warmup))
        print(markdown({**_header(args, numba_version, torch_version, load_before),
                        "sizes": sizes[-1:]}).split("## ", 1)[1], flush=True)
    result = {**_header(args, numba_version, torch_version, load_before), "sizes": sizes}
    if not args.no_compile_cost:
        result["compile"] = compile_costs()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


def _header(args: argparse.Namespace, numba_version: str, torch_version: str,
            load_before: tuple[float, float, float]) -> dict[str, Any]:
    after = os.getloadavg()
    # The run itself keeps one core busy: more than that is other work on the machine.
    busy = "busy: other jobs ran" if max(load_before[0], after[0]) > 1.5 else "otherwise idle"
    return {"machine": machine(), "numba": numba_version, "torch": torch_version,
            "iters": args.iters, "warmup": args.warmup, "block": args.block,
            "ratio": args.ratio, "threads": 1, "load_before": list(load_before),
            "load_after": list(after), "busy": busy}


if __name__ == "__main__":
    sys.exit(main())
