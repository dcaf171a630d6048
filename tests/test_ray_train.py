"""ringcomm under Ray Train: two CPU workers of a ``TorchTrainer``, started by Ray on a local
cluster of its own, which sets torch.distributed up (gloo, or the "ringcomm" backend through
``TorchConfig``) and exports RANK, WORLD_SIZE and MASTER_ADDR without torchrun.

In each worker, ``ringcomm.init()`` and ``hvd.init()`` must span both workers (never a
communicator of one), ``register_ddp_hook`` on what ``prepare_model`` returns must train to
plain DDP's parameters bit for bit, and int8 must end identical on both ranks. The first run's
first attempt fails on one rank after the hook ran (``FailureConfig(max_failures=1)``): Ray
starts new workers, which must join each other afresh.
"""

from __future__ import annotations

import sys

import pytest
from exit_checks import check_exit, run_job

torch = pytest.importorskip("torch")

STEPS = 4

SCRIPT = r"""
import sys
from pathlib import Path

import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

OUT = Path(sys.argv[1])
STEPS = int(sys.argv[2])


def loop(config):
    import numpy as np
    import ray.train
    import torch.distributed as dist
    from ray.train.torch import prepare_model

    import ringcomm
    import ringcomm.torch as hvd
    from ringcomm.torch import register_ddp_hook

    torch.set_num_threads(1)
    mode, out = config["mode"], Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    failing = mode == "gloo" and not (out / "failed_once").exists()
    comm = ringcomm.init()
    total = comm.allreduce(np.full(300_000, rank + 1.0, np.float32))  # the ring, not inline
    hvd.init()
    summed = hvd.allreduce(torch.full((3,), rank + 1.0), op=hvd.Sum)

    def train(hooked, compression=None):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, 4))
        model = prepare_model(net)                  # Ray's DistributedDataParallel
        state = None
        if hooked:
            state = register_ddp_hook(model, compression=compression, start_iter=1,
                                      min_compress_bytes=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if failing and rank == 1:               # after the hook's first call
                (out / "failed_once").touch()
                raise RuntimeError("this attempt fails on rank 1")
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return params, (0 if state is None else state.stats.calls)

    plain, _ = train(False)
    hooked, calls = train(True)
    int8, int8_calls = train(True, ringcomm.Int8())
    torch.save({"backend": dist.get_backend(), "comm": (comm.backend, comm.size),
                "total": float(total[0]), "hvd": (hvd.size(), summed.tolist()),
                "plain": plain, "hooked": hooked, "int8": int8,
                "calls": (calls, int8_calls)}, out / f"{mode}_{rank}.pt")
    hvd.shutdown()


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
for mode, backend, failures in (("gloo", "gloo", 1), ("ringcomm", "ringcomm", 0)):
    trainer = TorchTrainer(
        loop, train_loop_config={"mode": mode, "out": str(OUT)},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=mode, storage_path=str(OUT / "ray_results"),
                             failure_config=FailureConfig(max_failures=failures)))
    trainer.fit()
ray.shutdown()
print("ray job ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_ray_train_workers_span_the_job_and_hook_like_ddp(tmp_path, subprocess_env):
    """Ray Train's TorchTrainer, 2 CPU workers, on gloo (a first attempt failing on one rank,
    then new workers) and on the "ringcomm" backend: init() spans both workers, the hook
    gives plain DDP's bits with one call a step, int8 is the same on both ranks, and DDP on
    the "ringcomm" backend gives gloo's bits."""
    pytest.importorskip("ray.train.torch")
    script = tmp_path / "ray_job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    # A local Ray cluster of the job's own: no address of another, no usage report.
    env = {k: v for k, v in subprocess_env.items()
           if k not in ("RAY_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    proc = run_job([sys.executable, str(script), str(out), str(STEPS)], timeout=300, env=env,
                   cwd=tmp_path)
    check_exit(proc.returncode, proc.stdout + proc.stderr, "ray job")
    assert "ray job ok" in proc.stdout
    assert (out / "failed_once").exists()           # the first attempt did fail
    gloo, backend = ([torch.load(out / f"{mode}_{rank}.pt") for rank in (0, 1)]
                     for mode in ("gloo", "ringcomm"))
    for run in gloo + backend:
        assert run["comm"] in (("mpi", 2), ("gloo", 2)), run["comm"]
        assert run["total"] == 3.0 and run["hvd"] == (2, [3.0, 3.0, 3.0]), run
        assert run["calls"] == (STEPS, STEPS), run["calls"]
    assert [run["backend"] for run in gloo] == ["gloo", "gloo"]
    assert [run["backend"] for run in backend] == ["ringcomm", "ringcomm"]
    plain = gloo[0]["plain"]
    for run in gloo + backend:
        # Halving is exact, so the hook's average is DDP's own at two ranks, bit for bit.
        assert torch.equal(run["plain"], plain) and torch.equal(run["hooked"], plain)
        assert torch.equal(run["int8"], gloo[0]["int8"])       # the same on every rank
    assert not torch.equal(gloo[0]["int8"], plain)             # int8 did quantize
    assert torch.isfinite(gloo[0]["int8"]).all()

