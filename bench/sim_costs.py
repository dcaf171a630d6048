"""Per-operation compute rates for the simulator, read from measured benchmark results.

- GPU: the kernel benchmark of the GPU check (``bench/results/gpu/gpu_check.json``, one NVIDIA
  H200, 64 Mi float32 elements per kernel). Operations it did not time borrow the rate of the
  kernel with the same memory traffic (named in ``GPU_KERNELS``).
- CPU: the compiled codecs against a memcpy (``bench/results/codecs_perf.json``, 64 MiB, one
  thread of this machine). The plain NumPy operations were not timed there; they are charged
  as multiples of the memcpy by their memory traffic (``CPU_MEMCPY_MULTIPLES``), an assumption.

Every rate is seconds per element (per selected pair for scatter_add).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sim_model import CostModel

__all__ = ["CPU_MEMCPY_MULTIPLES", "GPU_KERNELS", "cpu_costs", "gpu_costs"]

RESULTS = Path(__file__).resolve().parent / "results"

#: Rate key -> the GPU benchmark's kernel whose time it takes (a name prefix).
GPU_KERNELS = {
    "reduce": "reduce f32+f32",
    "compensate": "compensate",
    "copy": "d2d copy f32",
    "divide": "d2d copy f32",  # one read, one write: a copy's traffic
    "zeros": "d2d copy f32",
    "zero_nonfinite": "d2d copy f32",
    "int8_encode": "int8 quantize",
    "int8_encode+error": "int8 quantize+error",
    "int8_encode+stochastic+error": "int8 quantize stoch+error",
    "int8_decode": "int8 dequantize",
    "int8_hop": "int8 fused hop+error",
    "cast_encode": "fp16 encode+error",
    "cast_decode": "copy f32->f16",
    "cast_hop": "bf16 hop+error",
    "topk": "topk exact k=",
    "topk+approximate": "topk approximate",
    "scatter_add": "scatter_add k=",
    "sparse_residual": "sparse_residual in place",
}

#: Rate key -> codecs_perf row (compiled kernels) for the CPU.
CPU_ROWS = {
    "int8_encode": "int8 encode",
    "int8_encode+error": "int8 encode + error",
    "int8_encode+stochastic+error": "int8 encode stochastic + error",
    "int8_decode": "int8 decode",
    "int8_hop": "int8 hop (fused)",
    "int8_hop+error": "int8 hop + error",
    "cast_encode": "fp16 encode",
    "cast_encode+error": "fp16 encode + error",
    "cast_decode": "fp16 decode",
    "cast_hop": "fp16 hop + error",
    "topk": "top-k 0.01 exact",
}

#: Rate key -> time as a multiple of a float32 memcpy of the same elements (assumed from the
#: memory traffic: a copy reads one array and writes one; reduce and compensate read two).
CPU_MEMCPY_MULTIPLES = {
    "copy": 1.0, "divide": 1.0, "zeros": 0.5, "zero_nonfinite": 1.0, "reduce": 1.5,
    "compensate": 1.5, "sparse_residual": 1.0,
}
#: Seconds per selected pair of scatter_add on the CPU (a random access each): an assumption.
CPU_SCATTER_PAIR = 5e-9


def _gpu_rate(rows: list[dict[str, Any]], prefix: str, elements: int) -> float:
    """Seconds per element of the first kernel named ``prefix...``; per pair for a kernel
    whose name gives its pair count ("scatter_add k=...")."""
    for r in rows:
        if r["kernel"].startswith(prefix):
            pairs = re.match(r"scatter_add k=(\d+)", r["kernel"])
            return r["us"] * 1e-6 / (int(pairs.group(1)) if pairs else elements)
    raise KeyError(f"no kernel named {prefix!r} in the GPU benchmark")


def gpu_costs(path: Path | None = None, *, fixed: float = 5e-6) -> CostModel:
    """Rates of the GPU kernel benchmark; ``fixed``: seconds per launch (an assumption: a
    CuPy launch from Python plus the kernel's shortest run)."""
    path = path or RESULTS / "gpu" / "gpu_check.json"
    bench = json.loads(path.read_text())["benchmark"]
    rows, elements = bench["results"], int(bench["elements"])
    rates = {key: _gpu_rate(rows, prefix, elements) for key, prefix in GPU_KERNELS.items()}
    device = bench["device"]["name"]
    return CostModel(rates, fixed=fixed,
                     source=f"{device} kernel benchmark ({path.name}), {fixed * 1e6:g} us "
                            "per launch assumed")


def cpu_costs(path: Path | None = None, *, fixed: float = 2e-6,
              slowdown: float = 1.0) -> CostModel:
    """Rates of the CPU codec benchmark (64 MiB rows); ``fixed``: seconds per call (an
    assumption); ``slowdown``: ranks per core when ranks share cores."""
    path = path or RESULTS / "codecs_perf.json"
    data = json.loads(path.read_text())
    size = max(data["sizes"], key=lambda s: s["bytes"])
    elements = int(size["elements"])
    memcpy = size["memcpy_ms"] * 1e-3 / elements
    rows = {r["codec"]: r for r in size["rows"]}
    rates = {key: rows[name]["numba_ms"] * 1e-3 / elements for key, name in CPU_ROWS.items()}
    rates.update({key: m * memcpy for key, m in CPU_MEMCPY_MULTIPLES.items()})
    rates["scatter_add"] = CPU_SCATTER_PAIR
    return CostModel(rates, fixed=fixed, slowdown=slowdown,
                     source=f"CPU codec benchmark ({path.name}, {elements} elements), "
                            f"{fixed * 1e6:g} us per call, slowdown {slowdown:g}")
