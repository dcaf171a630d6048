"""ringcomm under Slurm itself: srun's tasks, a batch script's launchers and Lightning's
SLURMEnvironment, on a private one-node cluster of Slurm's own daemons (tests/slurm_cluster.py;
skipped, saying why, where Slurm is not installed: ``make slurm`` installs it).

What these guard: a job srun starts is one job of all its tasks (MPI over srun's PMI-2,
numbered as srun numbers them), or fails on every task alike where srun's PMI cannot reach
MPI; never a communicator of one process per task. Inside a batch script, the batch shell's
own ``SLURM_*`` variables (task 0 of 2) neither shrink nor grow what mpiexec or torchrun start.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import slurm_cluster
from exit_checks import run_job

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Each process writes one JSON file into $ROWS (processes writing to one output file
# interleave their lines): what the launcher's variables say, then what
# init_process_group(<each backend named>), ringcomm.init() and hvd.init() give, or raise.
PROBE = r"""
import json, os, sys
import numpy as np
import torch
import torch.distributed as dist
import ringcomm
import ringcomm.torch as hvd

info = ringcomm.launch_info()
row = {"stage": os.environ.get("STAGE", ""), "task": int(os.environ.get("SLURM_PROCID", -1)),
       "launcher": info.launcher, "rank": info.rank, "size": info.size}


def attempt(name, fn):
    try:
        row[name] = fn()
    except Exception as err:
        row[name] = f"{type(err).__name__}: {err}"


def plain():
    comm = ringcomm.init()
    try:
        got = comm.allreduce(np.full(5, comm.rank + 1, np.float32))
        return [comm.rank, comm.size, comm.backend, got.tolist()]
    finally:
        comm.close()


def horovod():
    hvd.init()
    try:
        return [hvd.rank(), hvd.size(), hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist()]
    finally:
        hvd.shutdown()


def backend(name):
    def run():
        dist.init_process_group(name)
        try:
            t = torch.full((4,), float(dist.get_rank() + 1))
            dist.all_reduce(t)
            comm = getattr(dist.group.WORLD, "communicator", None)
            return [dist.get_rank(), dist.get_world_size(),
                    None if comm is None else comm.backend, t.tolist()]
        finally:
            dist.destroy_process_group()
    return run


for name in sys.argv[1:]:  # first: under torchrun, ringcomm.init() starts torch's default group
    attempt(name, backend(name))
attempt("init", plain)
attempt("hvd", horovod)
with open(os.path.join(os.environ["ROWS"], f"{row['stage']}-{os.getpid()}.json"), "w") as f:
    json.dump(row, f)
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running private cluster, stopped (with every job) after the module's tests."""
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def job_env(slurm, subprocess_env, tmp_path):
    """A client's environment: the cluster's configuration, no enclosing job's variables."""
    env = {k: v for k, v in subprocess_env.items()
           if not k.startswith(("SLURM_", "RINGCOMM_", "HOROVOD_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    (tmp_path / "rows").mkdir()
    return {**env, **slurm.env, "OMP_NUM_THREADS": "1", "RINGCOMM_TIMEOUT": "60",
            "ROWS": str(tmp_path / "rows"),
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}


def _rows(tmp_path: Path) -> list[dict]:
    """The probes' rows, by task (in a stage, by rank)."""
    rows = [json.loads(p.read_text()) for p in (tmp_path / "rows").glob("*.json")]
    return sorted(rows, key=lambda row: (row["stage"], row["task"], row["rank"]))


def _srun(slurm, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 150):
    proc = run_job(["srun", *args], timeout=timeout, env=env, cwd=cwd)
    if proc.returncode == -9:  # srun killed: its tasks live on under slurmstepd
        slurm.cancel_all()
    return proc


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_srun_tasks_are_one_job(slurm, job_env, tmp_path):
    """``srun -n 3 --mpi=pmi2``: every task sees one job of 3, numbered as srun numbers them,
    through ringcomm.init(), hvd.init() and init_process_group("ringcomm") and ("gloo")
    without torchrun's variables; sums exact."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = _srun(slurm, ["-n", "3", "--mpi=pmi2", sys.executable, str(probe), "ringcomm",
                         "gloo"], job_env, tmp_path)
    rows = _rows(tmp_path)
    assert proc.returncode == 0 and len(rows) == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    for task, row in enumerate(rows):
        assert row["task"] == task and (row["rank"], row["size"]) == (task, 3), row
        assert row["init"] == [task, 3, "mpi", [6.0] * 5], row
        assert row["hvd"] == [task, 3, [3.0] * 3], row
        assert row["ringcomm"] == [task, 3, "mpi", [6.0] * 4], row
        assert row["gloo"] == [task, 3, None, [6.0] * 4], row


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_srun_whose_pmi_misses_mpi_fails_every_task_alike(slurm, job_env, tmp_path):
    """``srun -n 2 --mpi=none``: MPI comes up as one world per task; every entry point raises
    on every task, alike, saying which srun plugin to pick, never a job of one per task."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = _srun(slurm, ["-n", "2", "--mpi=none", sys.executable, str(probe), "ringcomm",
                         "gloo"], job_env, tmp_path)
    rows = _rows(tmp_path)
    assert len(rows) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for key in ("init", "hvd", "ringcomm", "gloo"):
        assert rows[0][key] == rows[1][key], (key, rows)
        got = rows[0][key]
        assert isinstance(got, str) and got.startswith("RuntimeError: "), (key, got)
        assert "SLURM_STEP_NUM_TASKS=2 (slurm)" in got and "MPI.COMM_WORLD has 1 process" \
            in got and "srun --mpi=pmi2" in got, (key, got)


BATCH = """#!/bin/bash
#SBATCH -n 2
#SBATCH -o {out}
cd {cwd}
export STAGE=mpiexec; timeout 120 {bin}/mpiexec -n 2 {python} probe.py ringcomm
export STAGE=alone; timeout 120 {python} probe.py
export STAGE=srun; timeout 120 srun --mpi=pmi2 {python} probe.py ringcomm
export STAGE=torchrun; timeout 120 srun -n 1 {bin}/torchrun --standalone --nproc-per-node 2 \\
    probe.py ringcomm
echo BATCH-END
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launchers_inside_a_batch_script(slurm, job_env, tmp_path):
    """``sbatch -n 2`` of a script whose shell carries task 0 of 2's variables: mpiexec's
    2 ranks, the script's own python (one process: a job of one), srun's 2 tasks, and
    torchrun's 2 workers in a one-task step are each one job of what they started."""
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "batch.out"
    script = tmp_path / "job.sh"
    script.write_text(BATCH.format(out=out, cwd=tmp_path, bin=BIN, python=sys.executable))
    proc = run_job(["sbatch", "--wait", str(script)], timeout=280, env=job_env, cwd=tmp_path)
    if proc.returncode == -9:
        slurm.cancel_all()
    text = out.read_text() if out.exists() else ""
    assert proc.returncode == 0 and "BATCH-END" in text, proc.stderr[-2000:] + text[-4000:]
    stages: dict[str, list[dict]] = {}
    for row in _rows(tmp_path):
        stages.setdefault(row["stage"], []).append(row)
    assert sorted(stages) == ["alone", "mpiexec", "srun", "torchrun"], text[-4000:]
    (alone,) = stages.pop("alone")
    assert (alone["size"], alone["init"]) == (1, [0, 1, "mpi", [1.0] * 5]), alone
    assert alone["hvd"] == [0, 1, [1.0] * 3], alone
    for stage, rows in stages.items():
        rows.sort(key=lambda row: row["rank"])
        assert [row["rank"] for row in rows] == [0, 1], (stage, rows)
        for row in rows:
            assert row["size"] == 2 and row["init"][1:] == [2, "mpi", [3.0] * 5], (stage, row)
            assert row["hvd"][1:] == [2, [2.0] * 3], (stage, row)
            assert row["ringcomm"][1:] == [2, "mpi", [3.0] * 4], (stage, row)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_under_srun_on_the_ringcomm_backend(slurm, job_env, tmp_path,
                                                      lightning_plain):
    """Lightning's SLURMEnvironment (``srun --ntasks-per-node=2``) with
    ``DDPStrategy(process_group_backend="ringcomm")``: over MPI where srun's PMI reaches it,
    over a gloo group of the backend's own where it does not (``--mpi=none``: never MPI's
    one-process worlds), both ending with the parameters of the same training on gloo (the
    session's, under Lightning's own launcher), bit for bit."""
    pytest.importorskip("lightning")
    from test_frameworks import LIGHTNING_SCRIPT, STEPS

    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    runs = {}
    for name, mpi, mode in (("pmi2", "pmi2", "backend"), ("none", "none", "backend")):
        out = tmp_path / name
        out.mkdir()
        proc = _srun(slurm, ["-N", "1", "--ntasks-per-node=2", f"--mpi={mpi}", sys.executable,
                             str(script), str(out), str(STEPS), mode], job_env, tmp_path)
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
        runs[name] = [torch.load(out / f"{mode}_{rank}.pt") for rank in (0, 1)]
    runs["plain"] = [torch.load(lightning_plain / f"plain_{rank}.pt") for rank in (0, 1)]
    for name, transport in (("pmi2", "mpi"), ("none", "gloo")):
        for run in runs[name]:
            assert (run["backend"], run["size"], run["transport"]) == (
                "ringcomm", 2, transport), (name, run)
            assert run["calls"] >= STEPS, (name, run)
            assert torch.equal(run["params"], runs["plain"][0]["params"]), name
    assert [run["backend"] for run in runs["plain"]] == ["gloo", "gloo"]
    assert torch.equal(runs["plain"][0]["params"], runs["plain"][1]["params"])
