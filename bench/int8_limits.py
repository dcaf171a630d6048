"""What limits the int8 kernels on a GPU: their traffic's own ceiling, and their variants.

    python bench/int8_limits.py [-n 64M] [--iters 50] [--json out.json] [--markdown out.md]

bench/kernels_perf.py gives each kernel's bandwidth against a device-to-device copy, which
reads and writes the same bytes. The int8 encode reads 4 bytes an element and writes 1 (and
4 more with its error), so a copy is not its own ceiling. This probe times, in one job:

- the ceilings of that traffic with no arithmetic: a read of float32 (a sum per thread), a
  float32 -> int8 truncation (16-byte loads, 4-byte stores: the encode's traffic without
  blocks or scales), and the same writing a float32 error too;
- ringcomm's int8 encode, encode+error and fused hop+error as shipped, and variants of
  them compiled from the same source with another number of runs of 4 held in registers per
  lane (QREGS, and the team the host gives each block to match), or with
  ``__launch_bounds__`` capping registers for more resident blocks;
- for each variant, whether its payload and error are byte-identical to the shipped
  kernel's on the same input, whose own bytes are first checked against the NumPy twins
  (outputs are poisoned before each call, so a missed write shows).

Times are medians over --iters CUDA-event-timed launches, inputs rotated between --rotate
sets so that no run finds its data in L2. Needs CuPy and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from kernels_perf import Timer

from ringcomm.ops import _cuda_codecs
from ringcomm.ops import _cuda_runtime as _rt
from ringcomm.ops import _cuda_source as _src
from ringcomm.ops import _kernel_cache as _cache
from ringcomm.ops import numpy as host_ops

__all__ = ["main"]

_PROBES = r"""
namespace probe {
__global__ void read(const float4* x, float* out, long long n4) {
  float s = 0.0f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
       i += (long long)gridDim.x * blockDim.x) {
    const float4 v = x[i];
    s += v.x + v.y + v.z + v.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__global__ void trunc(const float4* x, char4* q, float4* err, long long n4) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
       i += (long long)gridDim.x * blockDim.x) {
    const float4 v = x[i];
    q[i] = make_char4((signed char)(int)v.x, (signed char)(int)v.y, (signed char)(int)v.z,
                      (signed char)(int)v.w);
    if (err != nullptr) err[i] = v;
  }
}
}  // namespace probe
"""

#: The kernels each variant is timed with: encode, encode+error, hop+error (round to nearest).
_NAMES = {"encode": "rc::int8_encode_kernel<false, false>",
          "encode+error": "rc::int8_encode_kernel<false, true>",
          "hop+error": "rc::int8_hop_kernel<false, true>"}
#: The same before the kernels took rounding and error as template arguments (--before).
_OLD_NAMES = {"encode": "rc::int8_encode_kernel", "encode+error": "rc::int8_encode_kernel",
              "hop+error": "rc::int8_hop_kernel"}


def _variant(text: str, qregs: int, bounds: int | None) -> str:
    """quantize.cu's ``text`` with QREGS = ``qregs`` and its quantizing kernels' launch
    bounds."""
    shipped = "constexpr int QREGS = 4;"
    if shipped not in text:
        raise RuntimeError("quantize.cu no longer says " + shipped)
    text = text.replace(shipped, f"constexpr int QREGS = {qregs};")
    if bounds:
        for kernel in ("int8_encode_kernel(", "int8_hop_kernel("):
            text = text.replace(f"__global__ void {kernel}",
                                f"__global__ void __launch_bounds__(256, {bounds}) {kernel}")
    return text


def _inlined(path: str) -> str:
    """A quantize.cu from elsewhere (an earlier tree) with this tree's headers inlined."""
    text = Path(path).read_text()
    return text.replace('#include "common.cuh"', _src.read_source("common.cuh"))


def _twin_agrees(kind: str, s: dict[str, Any], got: tuple[np.ndarray, np.ndarray],
                 block: int) -> bool:
    """Whether the shipped kernel's bytes (``got``: payload, error bits) are the NumPy twin's
    for the same call (round to nearest, seed 7, base 0): the variants are compared with
    them, so "identical" means correct."""
    x, own, received = (s[k].get() for k in ("x", "own", "in"))
    payload, error = np.zeros_like(got[0]), np.zeros(x.size, np.float32)
    err = None if kind == "encode" else error
    if kind == "hop+error":
        host_ops.int8_hop(received, own, payload, block, seed=7, error=err)
    else:
        host_ops.int8_encode(x, payload, block, seed=7, error=err)
    used = 4 * -(-x.size // block) + x.size  # the padding after it is nobody's
    return bool(np.array_equal(payload[:used], got[0][:used])
                and (err is None or np.array_equal(error.view(np.uint32), got[1])))


def _regs(cupy: Any, fn: Any) -> int:
    """Registers a thread of kernel ``fn`` uses (CU_FUNC_ATTRIBUTE_NUM_REGS), or -1."""
    try:
        return int(cupy.cuda.driver.funcGetAttribute(4, fn.ptr))
    except Exception:
        return -1


#: (label, QREGS, runs per lane for the team, minimum blocks an SM or None, grid blocks an SM
#: or None for --blocks-per-sm). "shipped" is this tree's kernel, the others' reference.
VARIANTS = [
    ("shipped", 4, 4, None, None),
    ("shipped, grid 16/SM", 4, 4, None, 16),
    ("bounds 4", 4, 4, 4, None),
    ("bounds 5", 4, 4, 5, None),
    ("QREGS 8", 8, 8, None, None),
    ("QREGS 2", 2, 2, None, None),
]


def _module(cupy: Any, name: str, text: str, names: tuple[str, ...]) -> tuple[Any, dict]:
    device = cupy.cuda.runtime.getDevice()
    compiled = _cache.load(name, text, names, _rt._target(cupy, device))
    module = cupy.cuda.function.Module()
    module.load(compiled.image)
    return module, dict(compiled.lowered)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--elements", default="64M")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rotate", type=int, default=3)
    p.add_argument("--blocks-per-sm", type=int, default=8, help="grid of the ringcomm kernels")
    p.add_argument("--before", help="an earlier quantize.cu to time beside this tree's")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    text = args.elements.upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    args.elements = int(text.rstrip("KMG")) * scale
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import cupy

    n, block = args.elements, args.block
    if n % 4 or block % 4:
        raise SystemExit("-n and --block must be multiples of 4")
    nb = -(-n // block)
    qn = host_ops.int8_nbytes(n, block)
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(args.rotate):
        sets.append({"x": cupy.asarray(rng.standard_normal(n, dtype=np.float32)),
                     "own": cupy.asarray(rng.standard_normal(n, dtype=np.float32)),
                     "in": cupy.empty(qn, np.uint8), "q": cupy.empty(qn, np.uint8),
                     "out": cupy.empty(n, np.float32), "err": cupy.empty(n, np.float32)})
    for s in sets:  # a real received payload for the hop
        _cuda_codecs.int8_encode(s["own"], s["in"], block)
    timer = Timer(cupy, args.iters, args.warmup)
    sms = int(cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"])
    rows: list[dict[str, Any]] = []

    def row(kernel: str, nbytes: int, us: float, **extra: Any) -> None:
        rows.append({"kernel": kernel, "bytes": nbytes, "us": us, "gbps": nbytes / us / 1e3,
                     **extra})

    def copy(i: int) -> None:
        s = sets[i % len(sets)]
        s["out"].data.copy_from_device(s["x"].data, 4 * n)

    row("d2d copy f32", 8 * n, timer.median_us(copy))
    probes, lowered = _module(cupy, "int8_probes.cu", _PROBES, ("probe::read", "probe::trunc"))
    read_fn = probes.get_function(lowered["probe::read"])
    trunc_fn = probes.get_function(lowered["probe::trunc"])
    grid = sms * args.blocks_per_sm
    partial = cupy.empty(grid * 256, np.float32)
    n4 = np.int64(n // 4)

    def read(i: int) -> None:
        read_fn((grid,), (256,), (sets[i % len(sets)]["x"], partial, n4))

    def trunc(err: bool) -> Any:
        def run(i: int) -> None:
            s = sets[i % len(sets)]
            trunc_fn((grid,), (256,), (s["x"], s["q"], s["err"] if err else _rt.NULL, n4))
        return run

    row("read f32 (sum)", 4 * n, timer.median_us(read))
    row("f32 -> int8 truncate", 5 * n, timer.median_us(trunc(False)))
    row("f32 -> int8 truncate + f32 write", 9 * n, timer.median_us(trunc(True)))

    shipped = _src.read_source("quantize.cu")
    plan = [(label, _variant(shipped, q, b), _NAMES, r, g) for label, q, r, b, g in VARIANTS]
    if args.before:
        plan.insert(1, ("before", _inlined(args.before), _OLD_NAMES, 4, None))
    reference: dict[str, Any] = {}
    for number, (label, text, names, runs, per_sm) in enumerate(plan):
        module, low = _module(cupy, f"quantize_probe{number}.cu", text,
                              tuple(sorted(set(names.values()))))
        team = _cuda_codecs._team(block, runs)
        blocks = max(1, min(-(-nb * team // 256), sms * (per_sm or args.blocks_per_sm)))
        common = (np.int64(n), np.int32(block), np.int32(team), np.uint32(7), np.uint32(0))
        tail = (np.int32(0), np.int32(7)) if names is _OLD_NAMES else (np.int32(7),)
        q_bytes = n + 4 * nb
        for kind, nbytes in (("encode", 4 * n + q_bytes), ("encode+error", 8 * n + q_bytes),
                             ("hop+error", 8 * n + 2 * q_bytes)):
            fn = module.get_function(low[names[kind]])

            def once(i: int, fn: Any = fn, kind: str = kind, blocks: int = blocks,
                     head: tuple = common + tail) -> None:
                s = sets[i % len(sets)]
                if kind == "hop+error":
                    fn((blocks,), (256,), (s["in"], s["own"], s["q"], s["err"], *head))
                else:
                    err = s["err"] if kind == "encode+error" else _rt.NULL
                    fn((blocks,), (256,), (s["x"], s["q"], err, *head))

            for poisoned in (sets[0]["q"], sets[0]["err"]):  # a missed write shows
                poisoned.view(np.uint8).fill(0x7B)
            once(0)
            got = (cupy.asnumpy(sets[0]["q"]), cupy.asnumpy(sets[0]["err"]).view(np.uint32))
            if label == "shipped":
                reference[kind] = got if _twin_agrees(kind, sets[0], got, block) else None
            want = reference[kind]
            same = want is not None and bool(
                np.array_equal(got[0][:q_bytes], want[0][:q_bytes])
                and (kind == "encode" or np.array_equal(got[1], want[1])))
            row(f"int8 {kind} [{label}]", nbytes, timer.median_us(once),
                registers=_regs(cupy, fn), team=team, blocks=blocks, identical=same)
    copy_gbps = rows[0]["gbps"]
    for r in rows:
        r["of_copy"] = r["gbps"] / copy_gbps
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    head = (f"# int8 kernels against their own traffic's ceiling ({name}, {sms} SMs, "
            f"{n} float32, block {block}, median of {args.iters})")
    lines = [head, "", "| kernel | registers | team | blocks | identical | us | GB/s | of copy |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r.get('registers', '')} | {r.get('team', '')} | "
                     f"{r.get('blocks', '')} | {r.get('identical', '')} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {r['of_copy']:.0%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "elements": n, "block": block,
                                               "iters": args.iters, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
