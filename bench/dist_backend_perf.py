"""torch.distributed's "ringcomm" backend against gloo, side by side in one job: an all_reduce
sweep and DDP training steps, each timed on a group of either backend in turn.

    mpiexec -n 2 python bench/dist_backend_perf.py --markdown bench/results/dist_backend_n2.md
    torchrun --nproc-per-node 2 bench/dist_backend_perf.py --collective all_to_all_single --no-ddp

The default group is gloo; a second group over the same ranks uses the "ringcomm" backend
(torch.distributed.new_group(backend="ringcomm")), and every size or step runs on both, the
order alternating. With ``--members K`` both groups are sub-groups of the job's first K ranks
(new_group(ranks=...)), which the others leave alone: a sub-group's ringcomm communicator is
its members' own (over MPI_Comm_create_group where MPI's world is the job: under mpiexec, and
under torchrun unless RINGCOMM_TORCHRUN_MPI=0). Figures are medians of the
slowest rank; ratios are gloo's time over ringcomm's (above 1: ringcomm faster). The DDP
model's parameters after the steps must be bit-identical on both groups (2 ranks: a + b =
b + a).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ringcomm.torch  # noqa: F401  (registers "ringcomm")
from ringcomm.core import launch
from ringcomm.perf.options import parse_size
from ringcomm.torch.process_group import init_process_group_from_mpi


def _median_slowest(samples: list[float], control: Any) -> float:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
    return float(t.median())


def _call(collective: str, x: torch.Tensor, group: Any) -> None:
    if collective == "all_reduce":
        dist.all_reduce(x, group=group)
    else:  # all_to_all_single, equal parts
        dist.all_to_all_single(torch.empty_like(x), x, group=group)


def sweep(groups: dict[str, Any], sizes: list[int], iters: int,
          collective: str = "all_reduce", calls: int = 1) -> list[dict]:
    """Median time of a call of ``collective`` on each group, per size: each sample is
    ``calls`` calls back to back after a barrier (on gloo's group), the groups alternating."""
    rows = []
    n = dist.get_world_size(groups["gloo"])
    for nbytes in sizes:
        x = torch.randn(max(n, nbytes // 4 // n * n))
        times: dict[str, list[float]] = {name: [] for name in groups}
        for i in range(iters + 3):
            order = list(groups) if i % 2 == 0 else list(reversed(groups))
            for name in order:
                y = x.clone()
                dist.barrier(group=groups["gloo"])
                t0 = time.perf_counter()
                for _ in range(calls):
                    _call(collective, y, groups[name])
                if i >= 3:
                    times[name].append((time.perf_counter() - t0) / calls)
        row = {"size": x.numel() * 4, **{name: _median_slowest(s, groups["gloo"])
                                         for name, s in times.items()}}
        rows.append(row)
    return rows


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def ddp_steps(groups: dict[str, Any], steps: int) -> dict[str, Any]:
    """DDP (no hook) on each group, steps alternating; the parameters after the steps."""
    models = {name: _model() for name in groups}
    ddps = {name: torch.nn.parallel.DistributedDataParallel(m, process_group=groups[name])
            for name, m in models.items()}
    times = _train(ddps, groups, steps)
    return _summary(times, {name: list(m.parameters()) for name, m in models.items()}, groups)


def fsdp_steps(groups: dict[str, Any], steps: int, reshard: bool = True) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on each layer and on the model) on each group's device mesh,
    steps alternating; the full parameters after the steps. ``reshard``: parameters resharded
    after forward (FULL_SHARD: an all-gather per layer in forward and again in backward, a
    reduce-scatter per layer), else kept to backward (SHARD_GRAD_OP: one all-gather)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    models = {}
    for name, group in groups.items():
        mesh = DeviceMesh.from_group(group, "cpu")
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        models[name] = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    times = _train(models, groups, steps)
    full = {name: [p.full_tensor() for p in m.parameters()] for name, m in models.items()}
    return _summary(times, full, groups)


def _train(models: dict[str, Any], groups: dict[str, Any], steps: int
           ) -> dict[str, list[float]]:
    """Each step's time on each model (SGD, batch 64 per rank), the models alternating and
    every step after a barrier; the first two steps are not timed."""
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    gens = {name: torch.Generator().manual_seed(10 + dist.get_rank()) for name in groups}
    times: dict[str, list[float]] = {name: [] for name in groups}
    for i in range(steps + 2):
        order = list(groups) if i % 2 == 0 else list(reversed(groups))
        for name in order:
            x = torch.randn(64, 256, generator=gens[name])
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            opts[name].zero_grad()
            torch.nn.functional.cross_entropy(models[name](x), torch.zeros(64, dtype=torch.long)
                                              ).backward()
            opts[name].step()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def _summary(times: dict[str, list[float]], params: dict[str, list[torch.Tensor]],
             groups: dict[str, Any]) -> dict[str, Any]:
    """Median step (slowest rank), the parameters' digest and whether every rank has it, per
    backend, and the largest difference between the backends' parameters."""
    out: dict[str, Any] = {}
    for name, ps in params.items():
        digest, same = _digest(ps, groups["gloo"])
        out[name] = {"step_s": _median_slowest(times[name], groups["gloo"]), "params": digest,
                     "same_on_every_rank": same}
    flat = {name: torch.cat([p.detach().reshape(-1) for p in ps]) for name, ps in params.items()}
    out["max_abs_difference"] = float((flat["gloo"] - flat["ringcomm"]).abs().max())
    return out


def _digest(params: list[torch.Tensor], group: Any) -> tuple[str, bool]:
    """The sha256 (16 hex digits) of ``params`` and whether every rank of ``group`` has it."""
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)
                            ).hexdigest()[:16]
    everyone: list[str] = [""] * group.size()
    dist.all_gather_object(everyone, digest, group=group)
    return digest, len(set(everyone)) == 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=8)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--members", type=int, default=0,
                   help="run on sub-groups of the first K ranks (default: every rank)")
    p.add_argument("--collective", choices=["all_reduce", "all_to_all_single"],
                   default="all_reduce", help="the collective of the sweep")
    p.add_argument("--calls", type=int, default=1,
                   help="calls back to back in each timed sample (default 1: each call after "
                        "a barrier)")
    p.add_argument("--no-ddp", action="store_true", help="no DDP steps")
    p.add_argument("--fsdp", action="store_true",
                   help="also FSDP2 steps (fully_shard) of the same model, with parameters "
                        "resharded after forward and kept")
    p.add_argument("--no-sweep", action="store_true", help="no collective sweep")
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args()
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    if launch.mpi_launched():
        init_process_group_from_mpi(backend="gloo")
    else:  # torchrun: the ringcomm group's communicator joins MPI (or, told, stays on gloo)
        dist.init_process_group("gloo")
    job = dist.get_world_size()
    k = args.members or job
    if not 1 <= k <= job:
        raise SystemExit(f"--members must be 1 to {job}, got {k}")
    members = list(range(k))
    groups = ({"gloo": dist.group.WORLD, "ringcomm": dist.new_group(backend="ringcomm")}
              if k == job else {"gloo": dist.new_group(members, backend="gloo"),
                                "ringcomm": dist.new_group(members, backend="ringcomm")})
    if dist.get_rank() not in members:
        dist.barrier()  # the members' runs, then the end together
        dist.destroy_process_group()
        return
    sizes, s = [], args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= args.stepfactor
    rows = [] if args.no_sweep else sweep(groups, sizes, args.iters, args.collective,
                                          args.calls)
    ddp = None if args.no_ddp else ddp_steps(groups, args.steps)
    fsdp = fsdp_steps(groups, args.steps) if args.fsdp else None
    grad_op = fsdp_steps(groups, args.steps, reshard=False) if args.fsdp else None
    if dist.get_rank() == 0:
        title = (f"{k} ranks" if k == job
                 else f"a sub-group of {k} of a job's {job} ranks (the others idle)")
        underneath = groups["ringcomm"].communicator.backend
        under = ("mpiexec (ringcomm's group over MPI)" if launch.mpi_launched()
                 else f"torchrun (ringcomm's group over {underneath}"
                 + (": torchrun's processes joined one MPI world)" if underneath == "mpi"
                    else ", a gloo group of its own)"))
        lines = [f"# torch.distributed backend \"ringcomm\" against gloo, {title}", "",
                 f"- machine: {platform.processor() or platform.machine()}, "
                 f"{platform.platform()}; torch {torch.__version__}; NumPy {np.__version__}; "
                 f"under {under}; load average before {load}, after "
                 f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}",
                 f"- {args.collective}: float32 (size: each rank's input), median of "
                 f"{args.iters} samples (slowest rank) of {args.calls} call(s) back to back "
                 "after a barrier, backends alternating"
                 + ("" if ddp is None and fsdp is None else
                    f"; {' and '.join(w for w, r in (('DDP', ddp), ('FSDP2', fsdp)) if r)}: "
                    f"{args.steps} steps of a 256-1024-1024-10 MLP, batch 64 per rank"), "",
                 "| size | gloo | ringcomm | gloo / ringcomm |", "| ---: | ---: | ---: | ---: |"]
        for row in rows:
            lines.append(f"| {row['size']} B | {row['gloo'] * 1e6:.1f} us | "
                         f"{row['ringcomm'] * 1e6:.1f} us | {row['gloo'] / row['ringcomm']:.2f}x |")
        if ddp is not None:
            lines += _ddp_lines(ddp, "DDP")
        if fsdp is not None:
            lines += _ddp_lines(fsdp, "FSDP2")
        if grad_op is not None:
            lines += _ddp_lines(grad_op, "FSDP2, parameters kept after forward")
        if ddp is not None or fsdp is not None:
            lines += ["", "With more than 2 ranks the backends add the ranks' gradients in "
                      "different orders, so their parameters may differ in the last bits; "
                      "each backend's are the same on every rank."]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
    if k < job:
        dist.barrier()
    dist.destroy_process_group()


def _ddp_lines(ddp: dict[str, Any], what: str) -> list[str]:
    g, r = ddp["gloo"], ddp["ringcomm"]
    return ["", f"| {what} | gloo | ringcomm | gloo / ringcomm | parameters: gloo's = "
            "ringcomm's | max abs difference | each the same on every rank |",
            "| --- | ---: | ---: | ---: | --- | ---: | --- |",
            f"| step | {g['step_s'] * 1e3:.2f} ms | {r['step_s'] * 1e3:.2f} ms | "
            f"{g['step_s'] / r['step_s']:.2f}x | {g['params'] == r['params']} "
            f"({r['params']}) | {ddp['max_abs_difference']:.1e} | "
            f"{g['same_on_every_rank'] and r['same_on_every_rank']} |"]


if __name__ == "__main__":
    main()
