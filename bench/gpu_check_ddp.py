"""DDP's comm hook on CUDA tensors: ringcomm_hook against DDP's own allreduce, on every backend.

    python bench/gpu_check_ddp.py [--sizes 1,2] [--mpiexec PATH] [--timeout 240]

Starts its own jobs (one GPU may be shared by every rank): for each size N, N processes with
torchrun's environment variables, each training a small model on CUDA under DDP, first with
DDP's own allreduce (gloo), then with ``ringcomm_hook`` on the gloo and NCCL backends (NCCL
only where every rank has a GPU of its own), uncompressed in the background and inline, and
int8 with error feedback; with ``--mpiexec``, also one job of 2 ranks on the MPI backend.
Part of bench/gpu_check.py, which reads its output: one line per check,
``CHECK {"name": ..., "status": "passed" | "failed" | "skipped", "detail": ...}``.
The exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = 6  # training steps per run
FAILED_CHECK = 3  # a worker's exit status when one of its checks failed (1 is a crash)
_DEVICE = ["cuda"]  # the worker's torch device (set once, by worker())
GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # of torch.distributed's collectives
# (case, RingcommState keyword arguments) of each hooked run.
# On gloo the uncompressed background case hands each bucket to gloo's own allreduce (which
# copies it through pinned host memory itself), started; the "piece by piece" case (the
# backend moves the device array) runs that allreduce in the call; the inline and staged
# cases, and an MPI without CUDA support, go through ringcomm's pinned host copies of the
# buckets; the host-codec case checks the compressed path through them.
CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("uncompressed, background", {"overlap": True}),
    ("uncompressed, inline", {"overlap": False}),
    ("uncompressed, staged whole", {"host_staging": True}),
    ("uncompressed, piece by piece", {"host_staging": False}),
    ("int8 with error feedback", {"compression": "int8", "start_iter": 1,
                                  "min_compress_bytes": 0}),
    ("int8 with error feedback, host codecs", {"compression": "int8", "start_iter": 1,
                                               "min_compress_bytes": 0, "host_staging": True}),
    ("PowerSGD rank 1 with error feedback", {"compression": "powersgd", "start_iter": 1,
                                             "min_compress_bytes": 0}),
)


def emit(name: str, status: str, detail: str = "") -> None:
    """Print one check's outcome as gpu_check.py reads it."""
    print("CHECK " + json.dumps({"name": name, "status": status, "detail": detail}), flush=True)


# ----------------------------------------------------------------------------- one rank
def _train(torch: Any, state: Any, hook: Any) -> Any:
    """Train a small MLP on this rank's device under DDP; the flat parameters after STEPS
    steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _DEVICE[0]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10)).to(device)
    model = DDP(net, bucket_cap_mb=0.1)  # several buckets, so the hook runs several times a step
    if state is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    for _ in range(STEPS):
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _agree(dist: Any, ok: bool, detail: str) -> tuple[bool, str]:
    """Every rank's verdict combined: passed only if it passed everywhere."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (ok, detail))
    bad = [(r, d) for r, (o, d) in enumerate(everyone) if not o]
    if not bad:
        return True, detail
    if len(bad) == len(everyone) > 1 and len({d for _, d in bad}) == 1:
        return False, f"every rank: {bad[0][1]}"
    return False, "; ".join(f"rank {r}: {d}" for r, d in bad)


def _fingerprint(flat: Any) -> str:
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


def _run_case(torch: Any, comm: Any, kwargs: dict[str, Any], expected: Any) -> tuple[bool, str]:
    """Train with the hook; compare with DDP's allreduce (uncompressed) and across ranks."""
    import ringcomm
    from ringcomm.torch import RingcommState, ringcomm_hook

    kwargs = dict(kwargs)
    named = {"int8": ringcomm.Int8, "powersgd": lambda: ringcomm.PowerSGD(rank=1)}
    if kwargs.get("compression") in named:
        kwargs["compression"] = named[kwargs["compression"]]()
    got = _train(torch, RingcommState(comm, **kwargs), ringcomm_hook)
    prints = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(prints, _fingerprint(got))
    if len(set(prints)) != 1:
        return False, "parameters differ between ranks"
    if not bool(torch.isfinite(got).all()):
        return False, "non-finite parameters"
    diff = float((got - expected).abs().max())
    if "compression" not in kwargs:
        try:
            torch.testing.assert_close(got, expected)
        except AssertionError:
            return False, f"differs from DDP's allreduce by up to {diff:.3g}"
    return True, f"max |hook - DDP allreduce| = {diff:.3g}"


def _start(backend: str, size: int, devices: int) -> tuple[Any, str, bool]:
    """ringcomm.init(backend); (communicator or None, why not, whether that is a failure)."""
    import ringcomm

    try:
        return ringcomm.init(backend, abort_on_exception=False, timeout=120), "", False
    except Exception as err:  # a backend that cannot start here: the reason is the finding
        shared = backend == "nccl" and size > devices
        why = f"{type(err).__name__}: {err}"
        return None, ("ranks share a GPU, NCCL needs one per rank: " if shared else "") + why, \
            not shared


def worker(backends: list[str], device: str) -> int:
    """One rank: DDP's allreduce, then the hook on each backend; rank 0 prints the checks.

    ``device`` "cpu" runs the same on CPU tensors, to check this script without a GPU."""
    from ringcomm.core import launch

    info = launch.detect()
    tag = f"n={info.size} {'mpiexec' if info.launcher != 'torchrun' else 'torchrun'}"
    try:
        import torch
        import torch.distributed as dist

        from ringcomm.torch.process_group import init_process_group_from_mpi
    except ImportError as err:
        if info.rank == 0:
            emit(f"{tag} PyTorch", "skipped", f"PyTorch cannot be imported ({err})")
        return 0
    _DEVICE[0] = device
    devices = torch.cuda.device_count() if device == "cuda" else info.size
    if device == "cuda" and not torch.cuda.is_available():
        if info.rank == 0:
            emit(f"{tag} CUDA", "skipped", f"torch {torch.__version__} (CUDA build "
                 f"{torch.version.cuda}) sees no CUDA device")
        return 0
    if device == "cuda":
        torch.cuda.set_device(info.local_rank % devices)
    # A rank that fails mid-collective leaves the others waiting: bounded, not 30 minutes.
    if info.launcher == "torchrun":
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    else:
        init_process_group_from_mpi("gloo", timeout=GROUP_TIMEOUT)
    try:
        expected = _train(torch, None, None)
        ok, why = bool(torch.isfinite(expected).all()), "ran"
    except Exception as err:  # DDP itself fails on CUDA here: nothing to compare the hook with
        expected, ok, why = None, False, f"{type(err).__name__}: {err}"
    ok, why = _agree(dist, ok, why)
    if info.rank == 0:
        emit(f"{tag} DDP's own allreduce (gloo)", "passed" if ok else "failed", why)
    if not ok:
        return FAILED_CHECK
    failed = False
    for backend in backends:
        comm, why, is_failure = _start(backend, info.size, devices)
        everyone = [None] * info.size
        dist.all_gather_object(everyone, is_failure)
        ok, why = _agree(dist, comm is not None, why or "started")
        if not ok:
            is_failure = any(everyone)  # skipped only if every rank's reason is expected
            if info.rank == 0:
                emit(f"{tag} {backend}: start", "failed" if is_failure else "skipped", why)
            failed |= is_failure
            if comm is not None:
                comm.close()
            continue
        for case, kwargs in CASES:
            try:
                ok, detail = _run_case(torch, comm, kwargs, expected)
            except Exception as err:  # reported as this check's failure; the next one runs
                ok, detail = False, f"{type(err).__name__}: {err}"
            ok, detail = _agree(dist, ok, detail)
            failed |= not ok
            if info.rank == 0:
                emit(f"{tag} {comm.backend}: {case}", "passed" if ok else "failed", detail)
        comm.close()
    # The DDP models hold the process group in cycles that only the collector frees: freed
    # here, while every rank is still up, not during interpreter shutdown. Then every rank
    # leaves the group together.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return FAILED_CHECK if failed else 0


# ----------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(argvs: list[list[str]], envs: list[dict[str, str]],
                  timeout: float) -> tuple[list[int | None], list[str]]:
    """Run one job's processes to the end (killed at ``timeout`` seconds); each one's exit
    status (None: killed at the timeout) and output."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp, f"rank{r}.log") for r in range(len(argvs))]
        procs = []
        for argv, env, out in zip(argvs, envs, outs, strict=True):
            with open(out, "w") as f:
                procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=f,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        return codes, [out.read_text(errors="replace") for out in outs]


def torchrun_envs(base: dict[str, str], n: int) -> list[dict[str, str]]:
    """The environment torchrun gives each of ``n`` processes on one host."""
    port = str(_free_port())
    return [dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                 LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            for r in range(n)]


def launcher_env() -> dict[str, str]:
    """This environment without an MPI launcher's variables (the jobs start their own)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_LOCAL"))}
    base["PYTHONUNBUFFERED"] = "1"
    return base


def _job(argvs: list[list[str]], envs: list[dict[str, str]], timeout: float, name: str) -> bool:
    """Run one job; print rank 0's output, and any other rank's that failed. Whether every
    process exited 0 in time (a failed CHECK line when not)."""
    codes, texts = run_processes(argvs, envs, timeout)
    sys.stdout.write(texts[0])
    bad = [(r, c) for r, c in enumerate(codes) if c not in (0, FAILED_CHECK)]
    for r, _ in bad:
        if r:
            sys.stdout.write(f"----- rank {r} -----\n{texts[r][-4000:]}\n")
    if bad:
        emit(f"{name} job", "failed", ", ".join(
            f"rank {r} {'timed out' if c is None else f'exited {c}'}" for r, c in bad))
    return not bad and not any(codes)


def launch(sizes: list[int], mpiexec: str | None, timeout: float, device: str) -> int:
    """Every job in turn; the exit status: 0 when every check passed or was skipped."""
    jobs = len(sizes) + (1 if mpiexec else 0)
    per_job = timeout / max(jobs, 1)
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", device]
    base = launcher_env()
    ok = True
    for n in sizes:
        envs = torchrun_envs(base, n)
        backends = "gloo,nccl" if device == "cuda" else "gloo"
        ok &= _job([[*me, "--backends", backends]] * n, envs, per_job, f"n={n} torchrun")
    if mpiexec:
        ok &= _job([[mpiexec, "-n", "2", *me, "--backends", "mpi"]], [base], per_job,
                   "n=2 mpiexec")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2", help="process counts of the torchrun-style jobs")
    p.add_argument("--mpiexec", default=None, help="also run a 2-rank job under this mpiexec")
    p.add_argument("--timeout", type=float, default=240, help="seconds for all jobs together")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backends", default="gloo,nccl", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same checks on CPU tensors (this script's own test)")
    args = p.parse_args(argv)
    if args.worker:
        return worker([b for b in args.backends.split(",") if b], args.device)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return launch(sizes, args.mpiexec, args.timeout, args.device)


if __name__ == "__main__":
    sys.exit(main())
