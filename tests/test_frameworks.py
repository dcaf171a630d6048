"""ringcomm's DDP hook under PyTorch Lightning, Lightning Fabric and Hugging Face Accelerate,
each run for real: two CPU processes over gloo, started by the framework's own launcher.

Each job trains a small model three times (DDP's own allreduce, ringcomm's hook, ringcomm's
hook with int8), and every rank saves its final parameters and the hook's call count; the tests
compare the ranks' files. The jobs also check that the frameworks' own ways of passing a hook
(``DDPStrategy(ddp_comm_hook=...)`` on CPU, ``DistributedDataParallelKwargs(comm_hook=...)``)
are ignored, which is why ringcomm.torch has its own.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from exit_checks import check_exit, run_job
from ports import free_port

torch = pytest.importorskip("torch")

from ringcomm.torch import register_ddp_hook, ringcomm_hook  # noqa: E402

STEPS = 4  # optimizer steps per run; the model fits in one DDP bucket, so one hook call each

# A small LightningModule and its data, for the Lightning scripts below (after their imports).
_LIGHTNING_MODEL = r"""
class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # a "mean" over ranks: AVG but on gloo,
        x, y = batch                              # of its int64 batch sizes too
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
"""

# The Accelerate scripts' model, data and steps (after their imports; ``hook(model)``, if
# given, registers a hook on the prepared model and returns its state).
_ACCELERATE_FIT = r"""
def fit(accelerator, rank, hook=None, batches=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = None if hook is None else hook(model)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS if batches is None else batches):
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        # A step a batch, or one every gradient_accumulation_steps (DDP's no_sync() between).
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    return model, state
"""

LIGHTNING_SCRIPT = r"""
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import ringcomm
from ringcomm.torch import RingcommState, ringcomm_hook
from ringcomm.torch.lightning import RingcommDDPStrategy

torch.set_num_threads(1)
OUT, STEPS = Path(sys.argv[1]), int(sys.argv[2])
""" + _LIGHTNING_MODEL + r"""

def synced_metrics(model, rank):  # torchmetrics' sync: all_gather of uneven tensors
    import torchmetrics
    from torchmetrics.classification import MulticlassAccuracy
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(37 + 11 * rank, 32, generator=gen), torch.randint(0, 4, (37 + 11 * rank,))
    with torch.no_grad():
        logits = model.net(x)
    accuracy, cat = MulticlassAccuracy(num_classes=4), torchmetrics.CatMetric()
    accuracy.update(logits, y)
    cat.update(logits[:, 0])
    return [accuracy.compute().item(), cat.compute().shape[0], cat.compute().sum().item()]


def fit(tag, strategy, state=None):
    pl.seed_everything(0, verbose=False)
    model = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                         deterministic=True, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader())
    val_loss = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
    state = state or getattr(strategy, "ringcomm_state", None)
    comm = None if state is None else state.comm
    stats = None if state is None else state.stats  # the state's own calls
    if tag == "backend":  # the process group's own communicator
        comm = torch.distributed.group.WORLD.communicator
        stats = comm.stats
    torch.save({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "metrics": synced_metrics(model, trainer.global_rank),
                "val_loss": val_loss,
                "calls": None if stats is None else stats.calls,
                "size": None if comm is None else comm.size,
                "transport": None if comm is None else comm.backend,
                "backend": torch.distributed.get_backend()},
               OUT / f"{tag}_{trainer.global_rank}.pt")


if sys.argv[3:] == ["backend"]:  # torch.distributed's "ringcomm" backend, no hook
    fit("backend", pl.strategies.DDPStrategy(process_group_backend="ringcomm"))
    sys.exit(0)
if sys.argv[3:] == ["plain"]:  # Lightning's DDP on gloo alone: the backend's baseline
    fit("plain", pl.strategies.DDPStrategy())
    sys.exit(0)
fit("plain", pl.strategies.DDPStrategy())
fit("ringcomm", RingcommDDPStrategy())
fit("int8", RingcommDDPStrategy(state_kwargs={"compression": ringcomm.Int8(), "start_iter": 1,
                                              "min_compress_bytes": 0}))
# Lightning's own way: on CPU the hook is never registered (torch.distributed is up by now).
state = RingcommState(comm=ringcomm.init())
fit("ignored", pl.strategies.DDPStrategy(ddp_comm_hook=ringcomm_hook, ddp_comm_state=state),
    state)
"""

ACCELERATE_SCRIPT = r"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
import ringcomm
from ringcomm.comm.base import Communicator
from ringcomm.torch import RingcommState, register_ddp_hook, ringcomm_hook
from ringcomm.backends.gloo import TorchDistTransport

torch.set_num_threads(1)
OUT, STEPS = Path(sys.argv[1]), int(sys.argv[2])
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
assert accelerator.num_processes == 2, accelerator.state
""" + _ACCELERATE_FIT + r"""

def train(tag, hooked=True, **state_kwargs):
    hook = (lambda model: register_ddp_hook(model, **state_kwargs)) if hooked else None
    model, state = fit(accelerator, rank, hook)
    torch.save({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "calls": None if state is None else state.stats.calls,
                "size": None if state is None else state.comm.size},
               OUT / f"{tag}_{rank}.pt")
    return model


model = train("plain", hooked=False)
hooked = train("ringcomm")
train("int8", compression=ringcomm.Int8(), start_iter=1, min_compress_bytes=0)

try:
    register_ddp_hook(accelerator.unwrap_model(model))
    raise AssertionError("no TypeError")
except TypeError as err:
    assert "expects a torch.nn.parallel.DistributedDataParallel" in str(err), err
try:
    register_ddp_hook(hooked, object(), start_iter=1)
    raise AssertionError("no TypeError")
except TypeError as err:
    assert "a state or state keyword arguments, not both" in str(err), err

# A communicator of one process in this job of two is refused on both ranks.
world = TorchDistTransport()
alone = Communicator(world.split(rank, 0))
try:
    register_ddp_hook(accelerator.prepare(torch.nn.Linear(3, 3)), RingcommState(comm=alone))
    raise AssertionError("no ValueError")
except ValueError as err:
    assert "has 1 process(es) but the DDP model's process group has 2" in str(err), err
alone.close()
world.close()

# One state per model: a state already running another model's hook is refused.
first = accelerator.prepare(torch.nn.Linear(3, 3))
state = register_ddp_hook(first)
try:
    register_ddp_hook(accelerator.prepare(torch.nn.Linear(3, 3)), state)
    raise AssertionError("no ValueError")
except ValueError as err:
    assert "already runs the hook of another DDP model" in str(err), err

# A DDP model compiled after prepare(): the hook goes on the DDP model inside, which runs it.
compiled = torch.compile(accelerator.prepare(torch.nn.Linear(3, 3)), backend="eager")
compiled_state = register_ddp_hook(compiled)
compiled(torch.ones(2, 3)).sum().backward()
assert compiled_state.stats.calls == 1, compiled_state.stats

# Accelerate's own way: a callable comm_hook is ignored (registered, it would run with state
# None and fail in backward).
ignored = Accelerator(cpu=True, kwargs_handlers=[
    DistributedDataParallelKwargs(comm_hook=ringcomm_hook)])
net = ignored.prepare(torch.nn.Linear(3, 3))
ignored.backward(net(torch.ones(2, 3)).sum())


# Parameters after 9 batches under accumulate() (DDP's no_sync() on two of every three: the
# hook runs on every third), and the state. Last in the script: the accumulation steps are
# Accelerate's, process-wide, from here on.
def accumulated(hooked):
    accumulating = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model, state = fit(accumulating, rank, register_ddp_hook if hooked else None, batches=9)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state


plain_accumulated, _ = accumulated(False)
hooked_accumulated, state = accumulated(True)
assert torch.equal(hooked_accumulated, plain_accumulated)
assert state.stats.calls == 3, state.stats  # one bucket, on the 3 synced steps
print(f"rank {rank} ok", flush=True)
"""



def _env(subprocess_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The children's environment: no launcher variables of an enclosing job, one thread,
    no Accelerate config of the user's."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in subprocess_env.items() if k not in launcher}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, *,
         gloo_baseline: bool = False) -> subprocess.CompletedProcess[str]:
    """Run a launcher to its end (180 s at most, then its whole process group is killed); it
    must end well, every process included (an abort at exit fails the test);
    ``gloo_baseline``: a job on PyTorch's own gloo backend (see exit_checks)."""
    proc = run_job(cmd, timeout=180, env=env, cwd=cwd)
    check_exit(proc.returncode, proc.stdout + proc.stderr, str(cmd[:4]),
               gloo_baseline=gloo_baseline)
    return proc


def train_plain(out: Path, subprocess_env: dict[str, str]) -> None:
    """Lightning's DDP on gloo alone under Lightning's own launcher: ``plain_<rank>.pt`` in
    ``out`` (the ``lightning_plain`` fixture's, shared by the tests)."""
    script = out / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    env = {**_env(subprocess_env, out), "MASTER_PORT": str(free_port())}
    _run([sys.executable, str(script), str(out), str(STEPS), "plain"], env, out,
         gloo_baseline=True)


def _ranks(out: Path, tag: str) -> list[dict]:
    return [torch.load(out / f"{tag}_{rank}.pt") for rank in (0, 1)]


def _check_runs(out: Path) -> None:
    """The hooked runs called the hook once per step over both processes, ended with
    bit-identical parameters on both ranks, and uncompressed equal DDP's own allreduce."""
    plain, hooked, int8 = (_ranks(out, tag) for tag in ("plain", "ringcomm", "int8"))
    for runs in (plain, hooked, int8):
        assert torch.equal(runs[0]["params"], runs[1]["params"])
    for run in hooked + int8:
        assert (run["calls"], run["size"]) == (STEPS, 2), (run["calls"], run["size"])
    # Halving is exact, so (a + b) / 2 == a / 2 + b / 2 bit for bit at two ranks.
    assert torch.equal(hooked[0]["params"], plain[0]["params"])
    assert not torch.equal(int8[0]["params"], plain[0]["params"])  # int8 did quantize
    assert torch.isfinite(int8[0]["params"]).all()


def _check_backend_runs(out: Path, launcher: str, plain_in: Path | None = None) -> None:
    """Lightning's DDP on the "ringcomm" backend went through ringcomm (over MPI, or gloo under
    Lightning's own launcher) and trained to its gloo run's parameters (in ``plain_in``, by
    default beside it), bit for bit."""
    backend, plain = _ranks(out, "backend"), _ranks(plain_in or out, "plain")
    for run in backend:
        assert run["backend"] == "ringcomm" and run["size"] == 2, run
        assert run["transport"] == ("gloo" if launcher == "lightning" else "mpi"), run
        assert run["calls"] >= STEPS, run  # DDP's bucket allreduces went through ringcomm
    assert [run["backend"] for run in plain] == ["gloo", "gloo"]
    assert torch.equal(backend[0]["params"], backend[1]["params"])
    assert torch.equal(backend[0]["params"], plain[0]["params"])
    # torchmetrics' sync (all_gather of tensors whose sizes differ between ranks)
    assert backend[0]["metrics"][1] == 37 + 48
    assert backend[0]["metrics"] == backend[1]["metrics"] == plain[0]["metrics"]
    # self.log(sync_dist=True): the "ringcomm" backend averages the int64 batch sizes
    assert backend[0]["val_loss"] == backend[1]["val_loss"] == plain[0]["val_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_on_cpu_with_its_own_launcher(tmp_path, subprocess_env):
    """``python train.py`` with ``Trainer(devices=2)``: RingcommDDPStrategy's hook (plain DDP's
    parameters uncompressed, identical on both ranks with int8), DDPStrategy's own hook
    argument ignored on CPU, and DDPStrategy(process_group_backend="ringcomm"), whose
    processes stay on gloo, the same on both ranks: Lightning itself started MPI in each
    process, alone (its MPIEnvironment check imports mpi4py.MPI)."""
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    for mode in ((), ("backend",)):
        env = {**_env(subprocess_env, tmp_path), "MASTER_PORT": str(free_port())}
        _run([sys.executable, str(script), str(tmp_path), str(STEPS), *mode], env, tmp_path)
    _check_runs(tmp_path)
    ignored = _ranks(tmp_path, "ignored")
    assert [run["calls"] for run in ignored] == [0, 0]  # DDPStrategy(ddp_comm_hook=) on CPU
    _check_backend_runs(tmp_path, "lightning")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_lightning_on_the_ringcomm_backend(tmp_path, subprocess_env, launcher, request,
                                           lightning_plain):
    """DDPStrategy(process_group_backend="ringcomm") under torchrun (the backend's processes
    join one MPI world) and mpiexec (Lightning's MPIEnvironment: they are one already), to the
    parameters of the same training on gloo (the session's, under Lightning's launcher)."""
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    if launcher == "torchrun":
        start = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2"]
    else:
        start = [request.getfixturevalue("mpiexec"), "-n", "2", sys.executable]
    env = {**_env(subprocess_env, tmp_path), "MASTER_PORT": str(free_port())}
    _run([*start, str(script), str(tmp_path), str(STEPS), "backend"], env, tmp_path)
    _check_backend_runs(tmp_path, launcher, lightning_plain)


LIGHTNING_FORK_SCRIPT = r"""
import hashlib, json, sys
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
import ringcomm.torch  # noqa: F401  (registers "ringcomm")

torch.set_num_threads(1)
""" + _LIGHTNING_MODEL + r"""

class ForkedNet(Net):
    def on_train_end(self):  # in the forked processes: the launching one has no group
        comm = getattr(torch.distributed.group.WORLD, "communicator", None)
        params = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
        row = {"backend": torch.distributed.get_backend(),
               "size": None if comm is None else comm.size,
               "params": hashlib.sha256(params.numpy().tobytes()).hexdigest()}
        Path(OUT, f"{BACKEND}_{self.global_rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    OUT = sys.argv[1]
    for BACKEND in ("ringcomm", "gloo"):  # each fit forks its processes anew
        torch.manual_seed(0)
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=4, logger=False,
                             strategy=DDPStrategy(start_method="fork",
                                                  process_group_backend=BACKEND),
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(ForkedNet(), loader())
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_ddp_fork_on_the_ringcomm_backend(tmp_path, subprocess_env):
    """Lightning's "ddp_fork" (``DDPStrategy(start_method="fork")``, what notebooks get) on the
    "ringcomm" backend: 2 forked CPU processes train to the parameters of the same run on gloo
    (forked next from the same process), bit for bit, and the job ends well (its processes end
    with ``os._exit``)."""
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_FORK_SCRIPT)
    proc = run_job([sys.executable, str(script), str(tmp_path)], timeout=200,
                   env={**subprocess_env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = {b: [json.loads((tmp_path / f"{b}_{r}.json").read_text()) for r in (0, 1)]
            for b in ("ringcomm", "gloo")}
    assert [row["backend"] for row in rows["ringcomm"]] == ["ringcomm"] * 2, rows
    assert [row["size"] for row in rows["ringcomm"]] == [2, 2], rows
    assert len({row["params"] for runs in rows.values() for row in runs}) == 1, rows

FABRIC_SCRIPT = r"""
import sys
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
import ringcomm
from ringcomm.torch import register_ddp_hook
from ringcomm.torch.fabric import RingcommDDPStrategy

torch.set_num_threads(1)
OUT, STEPS, MODE = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kwargs = ({"compression": ringcomm.Int8(), "start_iter": 1, "min_compress_bytes": 0}
          if MODE == "int8" else {})
if MODE == "backend":  # Fabric's own DDP on torch.distributed's "ringcomm" backend
    strategy = L.fabric.strategies.DDPStrategy(process_group_backend="ringcomm")
else:
    strategy = RingcommDDPStrategy(state_kwargs=kwargs)
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()  # the main process starts the other, which runs this script again
rank = fabric.global_rank


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def fit(model, opt, quiet, backward):
    # Two micro-batches a step, the first under DDP's no_sync(): one hook call a step.
    gen = torch.Generator().manual_seed(rank)
    for i in range(2 * STEPS):
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        with quiet(i % 2 == 0):
            backward(torch.nn.functional.cross_entropy(model(x), y))
        if i % 2:
            opt.step()
            opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


model, opt = fabric.setup(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(net()))
hooked = fit(model, opt, lambda on: fabric.no_backward_sync(model, enabled=on), fabric.backward)
if MODE == "backend":
    comm = torch.distributed.group.WORLD.communicator
    torch.save({"params": hooked, "backend": torch.distributed.get_backend(),
                "calls": comm.stats.calls}, OUT / f"fabric_backend_{rank}.pt")
    sys.exit(0)
state = strategy.ringcomm_state
# Plain DDP over the same gloo group: the baseline.
plain_model = torch.nn.parallel.DistributedDataParallel(net())
plain = fit(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1),
            lambda on: plain_model.no_sync() if on else nullcontext(),
            lambda loss: loss.backward())
# A second model set up gets a state of its own.
second, _ = fabric.setup(net(), torch.optim.SGD(net().parameters(), lr=0.1))
assert len(strategy.ringcomm_states) == 2 and strategy.ringcomm_state is not state
try:
    register_ddp_hook(second)
    raise AssertionError("no TypeError")
except TypeError as err:
    assert "pass strategy=ringcomm.torch.fabric.RingcommDDPStrategy" in str(err), err
torch.save({"hooked": hooked, "plain": plain, "calls": state.stats.calls,
            "size": state.comm.size}, OUT / f"fabric_{MODE}_{rank}.pt")
print(f"rank {rank} ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_on_cpu_with_its_own_launcher(tmp_path, subprocess_env):
    """``python train.py`` with ``Fabric(devices=2, strategy=RingcommDDPStrategy(...))`` and
    ``fabric.launch()``, two micro-batches a step under ``fabric.no_backward_sync``:
    uncompressed, plain DDP's parameters bit for bit with one hook call a step; with int8,
    identical on both ranks; a second model set up gets a state of its own, and
    register_ddp_hook given Fabric's wrapper says to use the strategy. And Fabric's own
    DDPStrategy on torch.distributed's "ringcomm" backend gives plain DDP's parameters."""
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(FABRIC_SCRIPT)
    for mode in ("ringcomm", "int8", "backend"):
        env = {**_env(subprocess_env, tmp_path), "MASTER_PORT": str(free_port())}
        _run([sys.executable, str(script), str(tmp_path), str(STEPS), mode], env, tmp_path)
    runs = {mode: [torch.load(tmp_path / f"fabric_{mode}_{rank}.pt") for rank in (0, 1)]
            for mode in ("ringcomm", "int8")}
    for run in runs["ringcomm"] + runs["int8"]:
        assert (run["calls"], run["size"]) == (STEPS, 2), (run["calls"], run["size"])
        assert torch.equal(run["plain"], runs["ringcomm"][0]["plain"])
    for mode in ("ringcomm", "int8"):
        assert torch.equal(runs[mode][0]["hooked"], runs[mode][1]["hooked"])
    assert torch.equal(runs["ringcomm"][0]["hooked"], runs["ringcomm"][0]["plain"])
    int8 = runs["int8"][0]["hooked"]
    assert not torch.equal(int8, runs["ringcomm"][0]["plain"]) and torch.isfinite(int8).all()
    for rank in (0, 1):
        backend = torch.load(tmp_path / f"fabric_backend_{rank}.pt")
        assert backend["backend"] == "ringcomm" and backend["calls"] >= STEPS, backend
        assert torch.equal(backend["params"], runs["ringcomm"][0]["plain"])


ACCELERATE_BACKEND_SCRIPT = r"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
import ringcomm.torch  # registers "ringcomm"

torch.set_num_threads(1)
OUT, STEPS = Path(sys.argv[1]), int(sys.argv[2])
# On CPU Accelerate takes gloo or mpi only; a group made first is the one it keeps.
dist.init_process_group("ringcomm")
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
""" + _ACCELERATE_FIT + r"""
model, _ = fit(accelerator, rank)
comm = dist.group.WORLD.communicator
torch.save({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "backend": dist.get_backend(), "transport": comm.backend,
            "calls": comm.stats.calls},
           OUT / f"accelerate_ringcomm_{rank}.pt")
print(f"rank {rank} ok", flush=True)
"""


def _accelerate(script: Path, args: list[str], subprocess_env: dict[str, str],
                out: Path) -> None:
    """``accelerate launch --multi_gpu --num_processes 2 script args`` (torchrun underneath)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           str(script), *args]
    proc = _run(cmd, _env(subprocess_env, out), out)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_launch_on_cpu(tmp_path, subprocess_env):
    """``accelerate launch --multi_gpu`` starts two processes with torchrun (``--cpu
    --num_processes 2`` starts one: two CPU processes need mpirun there), and
    ``Accelerator(cpu=True)`` runs DDP over gloo: the hook as with Lightning (also under
    ``accumulate()``, which skips the hook on the steps between); and Accelerate's
    DDP on torch.distributed's "ringcomm" backend (the group made before the Accelerator)
    trains to the parameters of the plain gloo run, bit for bit."""
    pytest.importorskip("accelerate")
    hooks, backend = tmp_path / "train.py", tmp_path / "backend.py"
    hooks.write_text(ACCELERATE_SCRIPT)
    backend.write_text(ACCELERATE_BACKEND_SCRIPT)
    _accelerate(hooks, [str(tmp_path), str(STEPS)], subprocess_env, tmp_path)
    _check_runs(tmp_path)
    _accelerate(backend, [str(tmp_path), str(STEPS)], subprocess_env, tmp_path)
    plain = _ranks(tmp_path, "plain")
    for run in _ranks(tmp_path, "accelerate_ringcomm"):
        assert run["backend"] == "ringcomm" and run["calls"] >= STEPS, run
        assert run["transport"] == "mpi", run  # torchrun's processes joined one MPI world
        assert torch.equal(run["params"], plain[0]["params"])


HF_TRAINER_SCRIPT = r"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import ringcomm
from ringcomm.torch.hf_trainer import register_trainer_hook

torch.set_num_threads(1)
OUT, STEPS, MODE = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if MODE == "backend":  # the Trainer keeps a group made before its TrainingArguments
    dist.init_process_group("ringcomm")
from transformers import Trainer, TrainingArguments  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))

    def forward(self, x, labels=None):
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 32, generator=gen)
        self.y = torch.randint(0, 4, (64,), generator=gen)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(hooked=False, compiled=False, **state_kwargs):
    # Two micro-batches a step (Accelerate's accumulate(): DDP's no_sync() on the first).
    # compiled: the Trainer trains torch.compile of its DDP model.
    args = TrainingArguments(output_dir=str(OUT / "hf"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, max_steps=STEPS, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, seed=0, torch_compile=compiled,
                             torch_compile_backend="eager" if compiled else None)
    trainer = Trainer(model=Net(), args=args, train_dataset=Data())
    hook = register_trainer_hook(trainer, **state_kwargs) if hooked else None
    trainer.train()
    return trainer, hook


if MODE == "alone":  # one process: no DDP model, nothing to hook
    trainer, hook = train(hooked=True)
    assert hook.state is None
    try:
        register_trainer_hook(trainer.model)
        raise AssertionError("no TypeError")
    except TypeError as err:
        assert "expects a transformers.Trainer" in str(err), err
    torch.save({"params": params(trainer.model)}, OUT / "hf_alone.pt")
    sys.exit(0)
if MODE == "backend":
    trainer, _ = train()
    comm = dist.group.WORLD.communicator
    torch.save({"params": params(trainer.model), "backend": dist.get_backend(),
                "calls": comm.stats.calls}, OUT / f"hf_backend_{dist.get_rank()}.pt")
    sys.exit(0)
plain, _ = train()
rank = dist.get_rank()
hooked, hook = train(hooked=True)
first = params(hooked.model)
hooked.train()  # a second train() of the same DDP model keeps its hook and state
int8, int8_hook = train(hooked=True, compression=ringcomm.Int8(), start_iter=1,
                        min_compress_bytes=0)
compiled, compiled_hook = train(hooked=True, compiled=True)
assert type(compiled.model_wrapped).__name__ == "OptimizedModule", type(compiled.model_wrapped)
# model_init: each train() makes a model, and each DDP model gets a state of its own.
args = TrainingArguments(output_dir=str(OUT / "hf"), per_device_train_batch_size=8,
                         max_steps=STEPS, use_cpu=True, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True, seed=0)
remade = Trainer(model_init=Net, args=args, train_dataset=Data())
remade_hook = register_trainer_hook(remade)
remade.train()
first_state = remade_hook.state
remade.train()
assert remade_hook.state is not first_state
assert remade_hook.state.comm is first_state.comm is hook.state.comm  # the states share one
assert first_state.stats.calls == remade_hook.state.stats.calls == STEPS
try:
    register_trainer_hook(plain, state=hook.state, start_iter=1)
    raise AssertionError("no TypeError")
except TypeError as err:
    assert "takes state or state_kwargs, not both" in str(err), err
torch.save({"plain": params(plain.model), "hooked": first, "again": params(hooked.model),
            "int8": params(int8.model), "compiled": params(compiled.model),
            "compiled_calls": compiled_hook.state.stats.calls,
            "calls": hook.state.stats.calls,
            "size": hook.state.comm.size, "int8_calls": int8_hook.state.stats.calls},
           OUT / f"hf_{rank}.pt")
print(f"rank {rank} ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hugging_face_trainer_under_torchrun(tmp_path, subprocess_env):
    """transformers' Trainer (two micro-batches a step) under torchrun on CPU:
    register_trainer_hook's hook ends with the plain Trainer's parameters bit for bit, one
    hook call a step, also with ``torch_compile=True`` (the DDP model inside the compiled one
    hooked), and keeps its state over a second train(); with int8, identical on both
    ranks; and on torch.distributed's "ringcomm" backend the plain Trainer trains to the
    same parameters as on gloo. In one process (no DDP model) the hook does nothing."""
    pytest.importorskip("transformers")
    script = tmp_path / "train.py"
    script.write_text(HF_TRAINER_SCRIPT)
    start = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(script), str(tmp_path), str(STEPS)]
    env = {**_env(subprocess_env, tmp_path), "TRANSFORMERS_VERBOSITY": "error"}
    _run([*start, "hooks"], env, tmp_path)
    _run([*start, "backend"], env, tmp_path)
    _run([sys.executable, str(script), str(tmp_path), str(STEPS), "alone"], env, tmp_path)
    runs = [torch.load(tmp_path / f"hf_{rank}.pt") for rank in (0, 1)]
    for key in ("plain", "hooked", "again", "int8", "compiled"):
        assert torch.equal(runs[0][key], runs[1][key]), key
    for run in runs:
        assert (run["calls"], run["size"], run["int8_calls"], run["compiled_calls"]) == (
            2 * STEPS, 2, STEPS, STEPS), run
    assert torch.equal(runs[0]["hooked"], runs[0]["plain"])
    assert torch.equal(runs[0]["compiled"], runs[0]["plain"])
    assert not torch.equal(runs[0]["again"], runs[0]["hooked"])  # trained on
    assert not torch.equal(runs[0]["int8"], runs[0]["plain"])
    assert torch.isfinite(runs[0]["int8"]).all()
    for rank in (0, 1):
        backend = torch.load(tmp_path / f"hf_backend_{rank}.pt")
        assert backend["backend"] == "ringcomm" and backend["calls"] >= STEPS, backend
        assert torch.equal(backend["params"], runs[0]["plain"])
    assert torch.isfinite(torch.load(tmp_path / "hf_alone.pt")["params"]).all()


NOTEBOOK_SCRIPT = r"""
import sys
from pathlib import Path

import torch
from accelerate import notebook_launcher

OUT, STEPS = Path(sys.argv[1]), int(sys.argv[2])
""" + _ACCELERATE_FIT + r"""

def train():
    from accelerate import Accelerator
    import ringcomm.torch as hvd
    from ringcomm.torch import register_ddp_hook

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    hvd.init()                   # torch.distributed is up (Accelerate's gloo group): the job
    rank = hvd.rank()
    big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)
    assert torch.equal(hvd.allreduce(big, op=hvd.Sum), torch.arange(300_000.0) * 3)
    model, state = fit(accelerator, rank, register_ddp_hook)
    torch.save({"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "calls": state.stats.calls, "size": state.comm.size,
                "mpi": hvd.mpi_enabled()}, OUT / f"notebook_{rank}.pt")


notebook_launcher(train, num_processes=2)   # forks the processes, as in a notebook
print("launcher ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_accelerate_notebook_launcher(tmp_path, subprocess_env):
    """Accelerate's ``notebook_launcher`` (processes forked from a notebook's kernel, their
    torch.distributed started by the Accelerator): ``hvd.init()`` spans both, over one MPI
    world, and the hook trains them to identical parameters."""
    pytest.importorskip("accelerate")
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK_SCRIPT)
    proc = _run([sys.executable, str(script), str(tmp_path), str(STEPS)],
                _env(subprocess_env, tmp_path), tmp_path)
    assert "launcher ok" in proc.stdout
    runs = _ranks(tmp_path, "notebook")
    for run in runs:
        assert (run["calls"], run["size"], run["mpi"]) == (STEPS, 2, True), run
    assert torch.equal(runs[0]["params"], runs[1]["params"])


def test_register_ddp_hook_refuses_a_module():
    with pytest.raises(TypeError, match=r"expects a torch.nn.parallel.DistributedDataParallel"
                                        r".*got torch.nn.modules.linear.Linear"):
        register_ddp_hook(torch.nn.Linear(2, 2))


def test_importing_ringcomm_torch_imports_no_framework(subprocess_env):
    code = ("import sys, ringcomm.torch, ringcomm.torch.accelerate; "
            "assert not {'lightning', 'pytorch_lightning', 'accelerate', 'transformers'} "
            "& set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], env=subprocess_env, check=True, timeout=60)


@pytest.mark.parametrize(("module", "missing", "install"), [
    ("ringcomm.torch.lightning", ("lightning", "lightning.pytorch",
                                  "lightning.pytorch.strategies"), "pip install lightning"),
    ("ringcomm.torch.fabric", ("lightning", "lightning.fabric", "lightning.fabric.strategies"),
     "pip install lightning"),
    ("ringcomm.torch.hf_trainer", ("transformers",), "pip install transformers"),
])
def test_framework_module_without_its_framework_says_what_to_install(monkeypatch, module,
                                                                     missing, install):
    monkeypatch.delitem(sys.modules, module, raising=False)
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match=install):
        importlib.import_module(module)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"ddp_comm_hook": ringcomm_hook}, ValueError, "registers ringcomm_hook itself; got "
                                                   "ddp_comm_hook"),
    ({"ddp_comm_wrapper": print}, ValueError, "got ddp_comm_wrapper"),
    ({"state": object()}, TypeError, "state must be a ringcomm.torch.RingcommState"),
])
def test_lightning_strategy_refuses_other_hooks(kwargs, error, message):
    lightning = pytest.importorskip("ringcomm.torch.lightning", exc_type=ImportError)
    with pytest.raises(error, match=message):
        lightning.RingcommDDPStrategy(**kwargs)


def test_lightning_strategy_takes_state_or_kwargs():
    lightning = pytest.importorskip("ringcomm.torch.lightning", exc_type=ImportError)
    with pytest.raises(TypeError, match="state or state_kwargs, not both"):
        lightning.RingcommDDPStrategy(state=object(), state_kwargs={"start_iter": 3})
    strategy = lightning.RingcommDDPStrategy(state_kwargs={"start_iter": 3}, bucket_cap_mb=1)
    assert strategy.ringcomm_state is None  # made when DDP wraps the model


def test_fabric_strategy_takes_state_or_kwargs():
    fabric = pytest.importorskip("ringcomm.torch.fabric", exc_type=ImportError)
    with pytest.raises(TypeError, match="state or state_kwargs, not both"):
        fabric.RingcommDDPStrategy(state=object(), state_kwargs={"start_iter": 3})
    with pytest.raises(TypeError, match=r"state must be a ringcomm\.torch\.RingcommState"):
        fabric.RingcommDDPStrategy(state=object())
    strategy = fabric.RingcommDDPStrategy(state_kwargs={"start_iter": 3}, bucket_cap_mb=1)
    assert strategy.ringcomm_state is None and strategy.ringcomm_states == ()


def test_trainer_hook_refuses_what_is_no_trainer():
    hf_trainer = pytest.importorskip("ringcomm.torch.hf_trainer", exc_type=ImportError)
    with pytest.raises(TypeError, match=r"expects a transformers\.Trainer, got builtins\.object"):
        hf_trainer.register_trainer_hook(object())
    with pytest.raises(TypeError, match=r"state must be a ringcomm\.torch\.RingcommState"):
        hf_trainer.register_trainer_hook(object(), state=object())
