"""Step time of DDP with ringcomm's comm hook against DDP's own gloo allreduce, same model.

Run under the launcher, one process per rank::

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/ddp_perf.py --markdown ddp_perf_n2.md

Every variant trains its own copy of the same MLP on the same batches. Variants take turns step
by step (in a rotating order, after a barrier), so that machine noise hits all of them alike;
a step's time is the slowest rank's, and the table reports medians and the ratio to DDP's
default gloo allreduce (below 1.0: ringcomm is faster). Variants:

- gloo: DDP as users have it (allreduce on the gloo process group, overlapped with backward).
- ringcomm: ``ringcomm_hook`` as configured by default (on CPU the allreduce runs inside the
  hook, ``overlap=False``).
- ringcomm-overlap: ``ringcomm_hook`` with ``overlap=True`` (the allreduce runs on ringcomm's
  background thread while backward goes on; with ``--backend gloo`` an uncompressed bucket is
  handed to gloo's own allreduce, started on gloo's threads).
- ringcomm-int8: the default hook with int8 compression (dense for the first 2 steps).
- local: the same step without any communication (a floor, not a competitor).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringcomm
from ringcomm.torch import RingcommState, ringcomm_hook
from ringcomm.torch.process_group import init_process_group

_VARIANTS = ("gloo", "ringcomm", "ringcomm-overlap", "ringcomm-int8", "local")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, nargs="+", default=[256, 1024, 2048],
                   help="hidden width(s) of the MLP; one table row per width")
    p.add_argument("--depth", type=int, default=4, help="linear layers")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("-n", "--iters", type=int, default=30, help="timed steps per variant")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed steps per variant")
    p.add_argument("--variants", default=",".join(_VARIANTS),
                   help=f"comma list of {', '.join(_VARIANTS)}")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (default: cores / ranks, at least 1)")
    p.add_argument("--backend", choices=("mpi", "gloo"), default="mpi",
                   help="ringcomm's communicator: MPI's, or a gloo group (as under torchrun)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    p.add_argument("--json", metavar="FILE", help="write rows and machine as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    p.add_argument("--append", action="store_true",
                   help="append to the --markdown file instead of replacing it")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(_VARIANTS)
    if unknown or args.iters < 1:
        p.error(f"unknown variants {sorted(unknown)}" if unknown else "need iters >= 1")
    return args


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = f"{len(names)} x {names[0]}" if names else platform.processor()
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        info["memory"] = f"{kib / (1 << 20):.0f} GiB"
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    from mpi4py import MPI

    info["mpi"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
    info["mpich_env"] = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                 if k.startswith(("MPIR_CVAR_", "MPICH_"))) or "defaults"
    return info


def load_average() -> str:
    """The 1-minute load average (other jobs on the machine skew every variant alike)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def build(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, width)]
    for _ in range(depth - 2):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    layers += [torch.nn.ReLU(), torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers)


def variant(name: str, net: torch.nn.Module, comm: Any, cap: float) -> torch.nn.Module:
    """The model as ``name`` trains it."""
    if name == "local":
        return copy.deepcopy(net)
    model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=cap)
    if name == "ringcomm":
        model.register_comm_hook(RingcommState(comm), ringcomm_hook)
    elif name == "ringcomm-overlap":
        model.register_comm_hook(RingcommState(comm, overlap=True), ringcomm_hook)
    elif name == "ringcomm-int8":
        state = RingcommState(comm, compression=ringcomm.Int8(), start_iter=2)
        model.register_comm_hook(state, ringcomm_hook)
    return model


def run_width(args: argparse.Namespace, width: int, names: list[str], comm: Any,
              world: Any) -> dict[str, Any]:
    """Time every variant on an MLP of ``width``; return the row."""
    from mpi4py import MPI

    net = build(width, args.depth)
    models = {n: variant(n, net, comm, args.bucket_cap_mb) for n in names}
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
    gen = torch.Generator().manual_seed(world.Get_rank())
    x = torch.randn(args.batch, width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(args.warmup + args.iters):
        order = names[it % len(names):] + names[: it % len(names)]
        for n in order:
            world.Barrier()
            start = time.perf_counter()
            opts[n].zero_grad()
            torch.nn.functional.cross_entropy(models[n](x), y).backward()
            opts[n].step()
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if it >= args.warmup:
                times[n].append(elapsed)
    params = sum(p.numel() for p in net.parameters())
    row: dict[str, Any] = {"width": width, "params": params, "grad_mb": params * 4 / 2**20}
    for n in names:
        row[f"{n}_ms"] = statistics.median(times[n]) * 1e3
    return row


def table(rows: list[dict[str, Any]], names: list[str], ranks: int, info: dict[str, Any],
          args: argparse.Namespace) -> str:
    base = "gloo" if "gloo" in names else None
    head = ["width", "params", "grads (MiB)"] + [f"{n} (ms)" for n in names]
    head += [f"{n} / gloo" for n in names if base and n not in ("gloo", "local")]
    lines = [
        f"## DDP step time, ringcomm_hook vs DDP's gloo allreduce: {ranks} ranks, ringcomm's "
        f"communicator over {args.backend}, MPICH {info['mpich_env']}",
        "",
        f"Machine: {info['cpu']}, {info.get('memory', '?')}, Python {info['python']}, "
        f"torch {info['torch']} CPU, {info['mpi']} from the mpich wheel; "
        f"{args.threads} torch thread(s) per rank. Load average {info['load']} at the start "
        "and end of the run.",
        f"MLP of {args.depth} linear layers, batch {args.batch} per rank, SGD; DDP "
        f"bucket_cap_mb={args.bucket_cap_mb:g}. Median of {args.iters} steps after "
        f"{args.warmup} warm-up steps, variants interleaved step by step; a step's time is the "
        "slowest rank's. Ratio < 1: ringcomm is faster.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [str(r["width"]), f"{r['params']:,}", f"{r['grad_mb']:.1f}"]
        cells += [f"{r[f'{n}_ms']:.1f}" for n in names]
        cells += [f"{r[f'{n}_ms'] / r['gloo_ms']:.2f}x" for n in names
                  if base and n not in ("gloo", "local")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = world.Get_size()
    if not args.threads:
        args.threads = max(1, (os.cpu_count() or 1) // ranks)
    torch.set_num_threads(args.threads)
    init_process_group(backend="gloo")
    comm = ringcomm.init(args.backend)
    names = args.variants.split(",")
    load_before = load_average()
    rows = [run_width(args, w, names, comm, world) for w in args.width]
    if world.Get_rank() == 0:
        info = machine()
        info["load"] = f"{load_before} / {load_average()}"
        text = table(rows, names, ranks, info, args)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "a" if args.append else "w") as f:
                f.write(("\n" if args.append else "") + text)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "ranks": ranks,
                                                   "rows": rows}, indent=2))
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
