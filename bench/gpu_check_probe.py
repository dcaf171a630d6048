"""What the GPU check's interpreter has: packages, CUDA, NCCL, NVRTC, PyTorch, MPI, the kernels.

    python bench/gpu_check_probe.py

Part of bench/gpu_check.py, which runs it with the interpreter and environment of its steps and
reads the JSON object it prints last (:func:`run_probe`). Every question is asked on its own and
answered with the error when it fails: a probe never fails as a whole. The functions at the end
ask what needs no Python package of the machine's (nvidia-smi, git); gpu_check.py calls them
itself.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Distributions whose versions the report lists (absent ones as null).
DISTRIBUTIONS = (
    "numpy", "cupy-cuda13x", "cupy-cuda12x", "cuda-pathfinder", "nvidia-cuda-nvrtc",
    "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12",
    "nvidia-nccl-cu13", "nvidia-nccl-cu12", "torch", "mpi4py", "mpich", "numba", "numba-cuda",
    "pytest", "pytest-timeout", "hypothesis", "ml_dtypes",
)


def _ask(question: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``question()``, or ``{"error": ...}`` when it raises."""
    try:
        return question()
    except BaseException as err:  # SystemExit from a broken extension module counts too
        return {"error": f"{type(err).__name__}: {err}"[:500]}


def _versions() -> dict[str, Any]:
    found: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def _cupy() -> dict[str, Any]:
    import cupy

    runtime = cupy.cuda.runtime
    out: dict[str, Any] = {"version": cupy.__version__, "runtime": runtime.runtimeGetVersion()}
    out["driver"] = _ask(lambda: {"version": runtime.driverGetVersion()}).get("version")
    try:
        count = int(runtime.getDeviceCount())
    except Exception as err:  # no driver, or none new enough
        return {**out, "device_count": 0, "reason": f"{type(err).__name__}: {err}"}
    out["device_count"] = count
    out["devices"] = []
    for d in range(count):
        props = runtime.getDeviceProperties(d)
        name = props["name"]
        out["devices"].append({
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "memory_mib": int(props["totalGlobalMem"]) // 2**20,
            "multiprocessors": int(props["multiProcessorCount"]),
        })
    return out


def _nvrtc() -> dict[str, Any]:
    from cupy_backends.cuda.libs import nvrtc

    return {"version": ".".join(map(str, nvrtc.getVersion()))}


def _nccl() -> dict[str, Any]:
    from ringcomm.backends import _nccl_lib

    lib = _nccl_lib.load()
    return {"version": lib.version_string, "path": lib.path}


def _torch() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": bool(torch.cuda.is_available())}
    if out["cuda_available"]:
        out["device"] = torch.cuda.get_device_name(0)
        out["device_count"] = torch.cuda.device_count()
    return out


def _mpi() -> dict[str, Any]:
    import mpi4py

    mpi4py.rc.initialize = False  # the library version needs no MPI_Init (nor mpiexec)
    from mpi4py import MPI

    return {"mpi4py": mpi4py.__version__,
            "library": MPI.Get_library_version().strip().splitlines()[0]}


def _stack() -> dict[str, Any]:
    from ringcomm.ops import _cuda_stack

    found = _cuda_stack.detect()
    return {"cuda_major": found.major, "source": found.source,
            "extra": _cuda_stack.extra_for(found.major),
            "install_hint": _cuda_stack.install_hint(found.major),
            "headers": _cuda_stack.header_dir()}


def _kernels() -> dict[str, Any]:
    from ringcomm.ops import _cuda_source

    sizes = {name: len(_cuda_source.read_source(name)) for name in _cuda_source.SOURCES}
    return {"sources": sizes}


def probe() -> dict[str, Any]:
    """Every answer, by topic."""
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "versions": _ask(_versions),
        "cupy": _ask(_cupy),
        "nvrtc": _ask(_nvrtc),
        "nccl": _ask(_nccl),
        "torch": _ask(_torch),
        "mpi": _ask(_mpi),
        "stack": _ask(_stack),
        "kernels": _ask(_kernels),
    }


# ------------------------------------------------- asked from bench/gpu_check.py, outside
def machine() -> dict[str, Any]:
    """Host, CPU, OS and the GPUs as nvidia-smi lists them (no Python package needed)."""
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "gpus": [], "nvidia_smi": None}
    fields = "name,memory.total,driver_version,compute_cap"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        info["nvidia_smi"] = f"not run: {err}"
        return info
    if done.returncode != 0:
        info["nvidia_smi"] = f"exit {done.returncode}: {(done.stderr or done.stdout).strip()}"
        return info
    info["nvidia_smi"] = "ok"
    for line in done.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            info["gpus"].append({"name": parts[0], "memory_mib": parts[1], "driver": parts[2],
                                 "compute_cap": parts[3]})
    return info


def run_probe(python: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """bench/gpu_check_probe.py under the steps' interpreter and environment."""
    try:
        done = subprocess.run([python, "bench/gpu_check_probe.py"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        return {"error": f"the probe failed: {type(err).__name__}: {err}"}


def gpu_presence(probe: dict[str, Any], host: dict[str, Any]) -> tuple[bool, str]:
    """Whether a GPU is there (CuPy, PyTorch or nvidia-smi sees one), and why not."""
    cupy, torch = probe.get("cupy", {}), probe.get("torch", {})
    if cupy.get("device_count") or torch.get("cuda_available") or host["gpus"]:
        return True, ""
    why = [f"CuPy: {cupy.get('reason') or cupy.get('error') or 'no device'}",
           f"PyTorch: {torch.get('error') or 'torch.cuda.is_available() is False'}",
           f"nvidia-smi: {host['nvidia_smi']}"]
    return False, "; ".join(why)


def source_tree() -> dict[str, Any]:
    """The commit this tree is at, and whether it has changes (None where git cannot tell)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


if __name__ == "__main__":
    print(json.dumps(probe()), flush=True)
