"""One rank of bench/ddp_cluster.py: DDP training of the digits MLP with one gradient variant.

Run under the launcher, inside the emulated cluster (bench/netns_exec.py puts each rank in its
own network namespace)::

    mpiexec -n 4 python bench/netns_exec.py python bench/ddp_cluster_worker.py \\
        --variant ringcomm-int8 --master-addr 10.213.0.1 --json out.json

Every rank trains the same wide MLP on its shard of the same global batches (fixed seeds), so
the variants differ only in how DDP's gradient buckets cross the links. Each rank records its
own step times, the bytes its ``eth0`` sent per step and the time spent inside the comm hook;
rank 0 gathers the raw figures and writes them as JSON. The orchestrator reduces them (slowest
rank per step, medians), so that the analysis lives in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# One BLAS thread per rank: four ranks already share two cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]

from ddp_cluster import VARIANTS  # noqa: E402
from ddp_perf import load_average, machine  # noqa: E402
from train_digits import load_data  # noqa: E402

import ringcomm  # noqa: E402
from ringcomm.backends.gloo import TorchDistCommunicator  # noqa: E402
from ringcomm.core import trace  # noqa: E402
from ringcomm.torch import RingcommState, ringcomm_hook  # noqa: E402
from ringcomm.torch.process_group import init_process_group_from_mpi  # noqa: E402

__all__ = ["main"]

#: DDP's bucket size for PowerSGD: above the model's 16.6 MiB, so one bucket (PowerSGD on gloo
#: hangs with several buckets).
SINGLE_BUCKET_MB = 64
_TX = Path("/sys/class/net/eth0/statistics/tx_bytes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=tuple(VARIANTS), required=True)
    p.add_argument("--steps", type=int, default=176, help="training steps (all epochs)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--hidden", type=int, default=2048, help="width of the two hidden layers")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--master-addr", help="rank 0's address for torch.distributed's store")
    p.add_argument("--iface", default="eth0", help="interface gloo binds to")
    p.add_argument("--profile", action="store_true",
                   help="wait for every rank before each hook (timed apart) and time "
                        "ringcomm's traced phases (ring steps, compress, ...)")
    p.add_argument("--json", required=True, help="where rank 0 writes the raw figures")
    return p.parse_args(argv)


def build(hidden: int, seed: int) -> torch.nn.Module:
    """64 -> hidden -> hidden -> 10, ReLU between; the same weights on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


class StepTimer:
    """Seconds of one step spent inside the comm hook, and (profiling) in ringcomm's phases.

    ``wrap`` times the hook (label "hook"); with ``barrier`` it first waits for every rank in
    an MPI barrier (label "wait": time lost to ranks that reach the bucket later), so that
    "hook" is the allreduce alone. As a ringcomm tracer it adds up the seconds of every traced
    phase ("RING_REDUCE_SCATTER", "COMPRESS", ...).
    """

    def __init__(self, barrier: Callable[[], None] | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls = 0
        self.buckets: set[int] = set()
        self._barrier = barrier
        self._open: dict[str, float] = {}

    def wrap(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook``, timed; DDP reads the wrapped hook's annotations, so they are kept."""

        @functools.wraps(hook)
        def timed(state: Any, bucket: Any) -> Any:
            if self._barrier is not None:
                with self.span("wait"):
                    self._barrier()
            self.calls += 1
            self.buckets.add(bucket.index())
            with self.span("hook"):
                return hook(state, bucket)

        return timed

    @contextlib.contextmanager
    def span(self, label: str) -> Iterator[None]:
        """Add the seconds of the ``with`` block to ``label``."""
        self.begin(label)
        try:
            yield
        finally:
            self.end(label)

    def begin(self, label: str) -> None:
        self._open[label] = time.perf_counter()

    def end(self, label: str) -> None:
        self.seconds[label] += time.perf_counter() - self._open.pop(label)

    def take(self) -> tuple[dict[str, float], int]:
        """The seconds per label and the hook calls since the last call, and reset."""
        taken, calls = dict(self.seconds), self.calls
        self.seconds.clear()
        self.calls = 0
        return taken, calls


def ringcomm_compression(variant: str) -> Any:
    """The compressor a ringcomm variant passes to RingcommState."""
    return {"ringcomm": None, "ringcomm-int8": ringcomm.Int8(),
            "ringcomm-topk": ringcomm.TopK(ratio=0.01), "ringcomm-auto": ringcomm.Auto(),
            "ringcomm-powersgd": ringcomm.PowerSGD(rank=1),
            "ringcomm-powersgd-gloo": ringcomm.PowerSGD(rank=1)}[variant]


def wrap(variant: str, net: torch.nn.Module, comm: Any,
         timer: StepTimer) -> tuple[torch.nn.Module, Any]:
    """The model as ``variant`` trains it, and its hook state (None without a hook)."""
    if variant == "local":
        return net, None
    if variant.startswith("fsdp"):  # on the default group: gloo's, or the backend's
        from torch.distributed.fsdp import fully_shard

        # FULL_SHARD gathers each layer in forward and again in backward; "grad-op"
        # (SHARD_GRAD_OP, ZeRO-2) keeps the gathered parameters from forward to backward.
        keep = {"reshard_after_forward": not variant.startswith("fsdp-grad-op")}
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, **keep)
        return fully_shard(net, **keep), None
    # "backend": no hook; the process group is the "ringcomm" backend's (see main)
    cap = SINGLE_BUCKET_MB if variant == "powersgd" else None
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap)
    state: Any = None
    if variant == "fp16":
        model.register_comm_hook(None, timer.wrap(default_hooks.fp16_compress_hook))
    elif variant == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, timer.wrap(powerSGD_hook.powerSGD_hook))
    elif variant.startswith("ringcomm"):
        state = RingcommState(comm, compression=ringcomm_compression(variant))
        model.register_comm_hook(state, timer.wrap(ringcomm_hook))
    return model, state


def read_tx() -> int:
    """Bytes this rank's eth0 has sent (0 outside the emulated cluster)."""
    try:
        return int(_TX.read_text())
    except (OSError, ValueError):
        return 0


class Trainer:
    """The training loop of one rank, and what it measured."""

    def __init__(self, args: argparse.Namespace, rank: int, size: int) -> None:
        self.args, self.rank, self.size = args, rank, size
        x_train, y_train, x_test, y_test = load_data(args.seed)
        self.x_train, self.y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
        self.x_test, self.y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)
        self.global_batch = args.batch * size
        self.steps_per_epoch = len(y_train) // self.global_batch
        self.step_s: list[float] = []
        self.phase_s: list[dict[str, float]] = []  # per step: "hook", "wait", traced phases
        self.tx: list[int] = []
        self.ringcomm_bytes: list[int] = []
        self.stats: Any = None  # ringcomm's wire accounting, set by run()
        self.hook_calls = 0  # of the last step: the buckets, once DDP has rebuilt them
        self.epochs: list[dict[str, Any]] = []

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's sample indices for each step of ``epoch`` (same on every variant)."""
        order = np.random.default_rng(self.args.seed + 1 + epoch).permutation(len(self.y_train))
        lo, hi = self.rank * self.args.batch, (self.rank + 1) * self.args.batch
        return [order[s * self.global_batch:(s + 1) * self.global_batch][lo:hi]
                for s in range(self.steps_per_epoch)]

    def run(self, model: torch.nn.Module, timer: StepTimer, world: Any, stats: Any) -> None:
        """Train for ``args.steps`` steps, evaluating after every epoch (and at the end);
        ``stats`` is ringcomm's wire accounting."""
        self.stats = stats
        opt = torch.optim.SGD(model.parameters(), lr=self.args.lr, momentum=self.args.momentum,
                              weight_decay=self.args.weight_decay)
        epoch = 0
        while len(self.step_s) < self.args.steps:
            world.Barrier()  # evaluation is not training time: start every epoch together
            start, losses = time.perf_counter(), []
            for mine in self.batches(epoch)[: self.args.steps - len(self.step_s)]:
                losses.append(self.step(model, opt, timer, mine))
            train_s = time.perf_counter() - start
            self.epochs.append({"epoch": epoch + 1, "steps": len(losses), "train_s": train_s,
                                "loss": float(np.mean(losses)),
                                "test_accuracy": self.accuracy(model)})
            epoch += 1

    def step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, timer: StepTimer,
             mine: np.ndarray) -> float:
        """One training step on the samples ``mine``; records its time, hook time and bytes."""
        x, y = self.x_train[mine], self.y_train[mine]
        tx, sent = read_tx(), self.stats.bytes_sent
        timer.take()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        self.step_s.append(time.perf_counter() - start)
        phases, self.hook_calls = timer.take()
        self.phase_s.append(phases)
        self.tx.append(read_tx() - tx)
        self.ringcomm_bytes.append(self.stats.bytes_sent - sent)
        return float(loss.detach())

    @torch.no_grad()
    def accuracy(self, model: torch.nn.Module) -> float:
        net = getattr(model, "module", model)  # the plain module: no DDP hooks on evaluation
        return float((net(self.x_test).argmax(dim=1) == self.y_test).float().mean())


def describe(variant: str, model: torch.nn.Module, state: Any, comm: Any, timer: StepTimer,
             calls_last_step: int) -> dict[str, Any]:
    """How the variant was configured, as run (buckets, ringcomm's choice under auto)."""
    info: dict[str, Any] = {"variant": variant, "label": VARIANTS[variant]}
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        info["bucket_sizes"] = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        info["hook_bucket_indices"] = sorted(timer.buckets)
        info["hook_calls_last_step"] = calls_last_step
    if isinstance(state, RingcommState):
        info.update(start_iter=state.start_iter, error_feedback=state.error_feedback,
                    min_compress_bytes=state.min_compress_bytes, overlap=state.overlap,
                    compression=repr(state.compression))
        if getattr(state, "auto_choice", None) is not None:  # the hook's iteration trials
            info["auto_chose"] = [state.auto_choice]
        else:
            chosen = {repr(c) for _, c in comm.auto_figures.choices.values()}
            if chosen:
                info["auto_chose"] = sorted(chosen)
    if isinstance(state, powerSGD_hook.PowerSGDState):
        info.update(matrix_approximation_rank=state.matrix_approximation_rank,
                    start_powerSGD_iter=state.start_powerSGD_iter,
                    error_feedback=state.use_error_feedback, warm_start=state.warm_start,
                    bucket_cap_mb=SINGLE_BUCKET_MB)
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.iface)
    load_before = load_average()
    # "backend": DDP without a hook on torch.distributed's "ringcomm" backend, whose process
    # group runs DDP's bucket allreduces on a ringcomm communicator (MPI here).
    on_backend = args.variant == "backend" or args.variant.endswith("-backend")
    backend = "ringcomm" if on_backend else "gloo"
    init_process_group_from_mpi(backend, master_addr=args.master_addr)
    comm = ringcomm.init("mpi")
    if args.variant.endswith("-gloo"):
        # ringcomm's ring over torch.distributed's gloo group (as under torchrun): its waits
        # block in the kernel where MPI's poll, which matters with more ranks than cores.
        mpi_comm, comm = comm, TorchDistCommunicator()
    timer = StepTimer(world.Barrier if args.profile else None)
    if args.profile:
        trace.set_tracer(timer)
    model, state = wrap(args.variant, build(args.hidden, args.seed), comm, timer)
    trainer = Trainer(args, world.Get_rank(), world.Get_size())
    stats = comm.stats
    if on_backend:  # the process group's communicator (made by the first collective)
        dist.barrier()
        stats = torch.distributed.group.WORLD.communicator.stats
    trainer.run(model, timer, world, stats)
    trace.set_tracer(None)
    mine = {"step_s": trainer.step_s, "phase_s": trainer.phase_s, "tx_bytes": trainer.tx,
            "ringcomm_bytes": trainer.ringcomm_bytes,
            "epoch_train_s": [e["train_s"] for e in trainer.epochs]}
    ranks = world.gather(mine, root=0)
    if world.Get_rank() == 0:
        info = describe(args.variant, model, state, comm, timer, trainer.hook_calls)
        info["machine"] = machine()
        info["machine"]["load"] = f"{load_before} / {load_average()}"
        info.update(ranks=world.Get_size(), steps=len(trainer.step_s), batch=args.batch,
                    hidden=args.hidden, steps_per_epoch=trainer.steps_per_epoch,
                    grad_bytes=sum(p.numel() * 4 for p in model.parameters()),
                    epochs=trainer.epochs, per_rank=ranks)
        Path(args.json).write_text(json.dumps(info, indent=1))
    world.Barrier()  # leave the process group together
    comm.close()
    if args.variant.endswith("-gloo"):
        mpi_comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
