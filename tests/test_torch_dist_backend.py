"""torch.distributed's "ringcomm" backend (ringcomm/torch/dist_backend.py), as users start it:
init_process_group("ringcomm") under torchrun (MPI underneath, its processes joined into one
MPI world, or gloo with RINGCOMM_TORCHRUN_MPI=0) and under mpiexec (MPI underneath), its
collectives checked against exact values, a refused op refused on every rank, sub-groups with
communicators of their own (hybrid sharding among them), and DDP training whose parameters
are bit-identical to the same training on gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from exit_checks import check_exit, run_job

# Each job has its own timeout (run_job kills its process group); the tests' is above them all.
pytestmark = pytest.mark.timeout(1200)

# How the jobs below start (arguments: the backend, then the launcher): as users start one.
START = r'''
import datetime, hashlib, inspect, json, sys
import torch, torch.distributed as dist
import ringcomm.torch  # registers "ringcomm"

backend, launcher = sys.argv[1], sys.argv[2]
if launcher == "mpiexec":
    from ringcomm.torch.process_group import init_process_group_from_mpi
    init_process_group_from_mpi(backend=backend)
else:
    dist.init_process_group(backend)


def trained(group=None, seed=100, steps=6, hidden=32, batch=16):
    """The sha256 of a small model's parameters after DDP training over ``group``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(batch, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
    return hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def sharded(mesh=None):
    """The sha256 of a small model's full parameters after FSDP2 training (fully_shard,
    over ``mesh``: the job's ranks when None)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
    full = [p.full_tensor() for p in model.parameters()]
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in full)).hexdigest()
'''


def _command(launcher: str, processes: int, job: Path, *args: str) -> list[str]:
    """The command that starts ``job`` under ``launcher`` ("torchrun" or "mpiexec")."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes), str(job), *args]
    return [str(Path(sys.executable).parent / "mpiexec"), "-n", str(processes),
            sys.executable, str(job), *args]


JOB = START + r'''
r, n = dist.get_rank(), dist.get_world_size()
report = {"backend": dist.get_backend()}
if backend == "ringcomm":
    t = torch.arange(6, dtype=torch.float32) + r
    dist.all_reduce(t)
    expected = (torch.arange(6, dtype=torch.float32) * n + sum(range(n)))
    assert torch.equal(t, expected), (t, expected)
    for op, want in ((dist.ReduceOp.MAX, float(n)), (dist.ReduceOp.MIN, 1.0),
                     (dist.ReduceOp.PRODUCT, float(torch.arange(1, n + 1).prod())),
                     (dist.ReduceOp.AVG, (n + 1) / 2)):
        v = torch.full((5,), float(r + 1))
        work = dist.all_reduce(v, op=op, async_op=True)
        work.wait()
        assert torch.allclose(v, torch.full((5,), want)), (op, v)
        assert torch.equal(work.get_future().value()[0], v)
    i = torch.tensor([3, 7], dtype=torch.int64) * (r + 1)
    dist.all_reduce(i)
    assert i.tolist() == [3 * n * (n + 1) // 2, 7 * n * (n + 1) // 2]
    b = torch.full((3,), float(r))
    dist.broadcast(b, src=n - 1)
    assert b.tolist() == [float(n - 1)] * 3
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([r, r + 0.5]))
    assert [o.tolist() for o in outs] == [[k, k + 0.5] for k in range(n)]
    o = torch.empty(2 * n)
    dist.all_gather_into_tensor(o, torch.tensor([r, r + 0.5]))
    assert o.tolist() == [v for k in range(n) for v in (k, k + 0.5)]
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + r)
    assert o.tolist() == [n * (2 * r + j) + sum(range(n)) for j in range(2)], o
    # Large ones, gathered straight into the output: the input a view of its own rows (as
    # FSDP gathers), blocking and not; into a strided output (copied there).
    k = 40_000
    whole = torch.cat([torch.arange(float(k)) + q for q in range(n)])
    o = torch.zeros(n * k)
    o[r * k:(r + 1) * k] = torch.arange(float(k)) + r
    dist.all_gather_into_tensor(o, o[r * k:(r + 1) * k])
    assert torch.equal(o, whole), o
    o = torch.zeros(n * k)
    dist.all_gather_into_tensor(o, torch.arange(float(k)) + r, async_op=True).wait()
    assert torch.equal(o, whole), o
    wide = torch.zeros(n * k, 2)
    dist.all_gather_into_tensor(wide[:, 1], torch.arange(float(k)) + r)
    assert torch.equal(wide[:, 1], whole) and not wide[:, 0].any(), wide
    o = torch.full((k,), -1.0)
    dist.reduce_scatter_tensor(o, torch.arange(float(n * k)) + r)
    assert torch.equal(o, n * (torch.arange(float(k)) + r * k) + sum(range(n))), o
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
    except ValueError as err:
        report["refused"] = str(err)
    try:  # refused on one rank only: every rank raises, none waits in the collective
        dist.all_reduce(torch.ones(2, dtype=torch.int32),
                        op=dist.ReduceOp.BXOR if r == 0 else dist.ReduceOp.SUM)
    except ValueError as err:
        report["refused_on_one"] = str(err)
    # Collectives the backend leaves to gloo still give exact results.
    g = torch.full((2,), float(r))
    dist.reduce(g, dst=0)
    if r == 0:
        assert g.tolist() == [float(sum(range(n)))] * 2
    # Point-to-point on gloo underneath, passing through the group; all-to-all on ringcomm's.
    if r == 0:
        dist.send(torch.arange(3.0), dst=1)
    elif r == 1:
        x = torch.empty(3)
        dist.recv(x, src=0)
        assert x.tolist() == [0.0, 1.0, 2.0], x
    a2a = torch.empty(n)
    dist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * r)
    assert a2a.tolist() == [10.0 * k + r for k in range(n)], a2a
    a2a = torch.arange(2.0 * n) + 100 * r  # in place (gloo's own gets it wrong at 3 ranks)
    dist.all_to_all_single(a2a, a2a)
    assert a2a.tolist() == [100.0 * s + 2 * r + j for s in range(n) for j in range(2)], a2a
    # A strided view: gloo (torch 2.13) moves as many consecutive elements from the view's
    # first one (3 ranks: rank 1's first row [0, 1, 2, 3], not [0, 1, 4, 6]).
    b = torch.arange(12.0).reshape(3, 4) * (r + 1)
    dist.broadcast(b[:, 1], src=0)
    want = torch.arange(12.0).reshape(3, 4) * (r + 1)
    want[:, 1] = torch.tensor([1.0, 5.0, 9.0])
    assert torch.equal(b, want), b
    # A negative view (x.conj().imag) broadcast as its values, written through the view
    # (gloo, torch 2.13, sends its memory: rank 1 of 2 kept -2.0, not rank 0's -1.0).
    z = torch.tensor([1 + 1j * (r + 1)])
    v = z.conj().imag
    dist.broadcast(v, src=0)
    assert v.tolist() == [-1.0] and z.tolist() == [1 + 1j], z
    # Sparse tensors go to gloo's sparse allreduce (DDP's sparse gradients); dtypes NumPy
    # lacks (float8, quantized) to gloo too, which refuses them alike on every rank.
    sp = torch.sparse_coo_tensor([[0, 2 + r]], [1.0 + r, 10.0], (n + 2,))
    dist.all_reduce(sp)
    assert sp.to_dense().tolist() == [n + n * (n - 1) / 2, 0.0] + [10.0] * n, sp
    try:
        dist.broadcast(torch.ones(2, dtype=torch.float8_e4m3fn), src=0)
    except RuntimeError as err:
        report["float8"] = str(err)
    sub = dist.new_group([0])
    if r == 0:
        s = torch.ones(3)
        dist.all_reduce(s, group=sub)
        assert s.tolist() == [1.0, 1.0, 1.0]
    # Arguments that differ between ranks: the same error on every rank, not a hang or a mix.
    for bad in (torch.ones(3 if r == 0 else 4), torch.ones(3, dtype=torch.float64 if r else
                                                               torch.float32)):
        try:
            dist.all_reduce(bad)
        except Exception as err:
            report.setdefault("mismatch", []).append(f"{type(err).__name__}: {err}")
    # An output of the wrong size on one rank: refused on every rank, before anything moves.
    o = torch.empty(2 if r else 3)
    try:
        dist.reduce_scatter_tensor(o, torch.arange(2.0 * n))
        report["reduce_scatter_bad_output"] = o.tolist()
    except ValueError as err:
        report["reduce_scatter_bad_output"] = str(err)
    try:  # an output of the wrong size on rank 0, coalesced with a good one: refused
        outs = [torch.empty(2 * n + (1 if r == 0 else 0)), torch.empty(n)]
        with dist._coalescing_manager():
            for out, x in zip(outs, (torch.ones(2), torch.ones(1))):
                dist.all_gather_into_tensor(out, x)
        report["all_gather_bad_output"] = outs[1].tolist()
    except (ValueError, RuntimeError) as err:
        report["all_gather_bad_output"] = str(err)
    o = torch.empty(2)  # the list form: rank r's output sums every rank's r-th input
    dist.reduce_scatter(o, [torch.full((2,), float(q + 10 * r)) for q in range(n)])
    assert o.tolist() == [float(r * n + 10 * sum(range(n)))] * 2, o
    pieces = [torch.ones(3), torch.ones(1)] if r == 0 else [torch.ones(2), torch.ones(2)]
    try:  # the same total, pieces of another size on rank 0: refused on every rank
        dist.reduce_scatter(torch.empty(2), pieces)
        report["reduce_scatter_bad_piece"] = "ok"
    except ValueError as err:
        report["reduce_scatter_bad_piece"] = str(err)
    dist.barrier()
    comm = dist.group.WORLD.communicator
    report["communicator"] = comm.backend
    report["calls"] = comm.stats.calls
report["params"] = trained()
if backend == "ringcomm":
    report["calls_after_ddp"] = dist.group.WORLD.communicator.stats.calls


def joined():
    """The sha256 after DDP training under Join with uneven inputs (the rank that ran out
    matches the others' collectives), no_sync() accumulation, gradients as views of the buckets
    and a layer that never gets a gradient."""
    from torch.distributed.algorithms.join import Join
    class Forked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 2),
                                           torch.nn.Linear(16, 2))

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Forked()
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(300 + r)
    with Join([ddp]):
        for _ in range(4 + 2 * r):
            opt.zero_grad()
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else torch.enable_grad():
                    ddp(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
    return hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def sparse_gradients():
    """The sha256 after DDP training of an embedding with sparse gradients (DDP reduces each
    in a bucket of its own, with the backend's all_reduce of a sparse tensor)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(400 + r)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randint(0, 20, (6,), generator=gen)).pow(2).mean().backward()
        opt.step()
    return hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def failed_in_backward():
    """What backward() raises where DDP's bucket allreduce fails on every rank (before any
    data moves, so the ranks stay in step): the error, in a RuntimeError of DDP's."""
    from ringcomm.comm.base import Communicator
    real = Communicator.allreduce
    def failing(self, *args, **kwargs):
        raise ValueError("the bucket's allreduce failed here")
    Communicator.allreduce = failing
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
        ddp(torch.ones(2, 64)).sum().backward()
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        Communicator.allreduce = real


def zero(overlap_hook=None):
    """The sha256 after DDP training with ZeroRedundancyOptimizer (Adam's state and the step
    sharded between the ranks, the parameters broadcast from each shard's owner); with
    ``overlap_hook`` ("torch": PyTorch's allreduce_hook, "ringcomm": ringcomm's hook), each
    shard's step runs inside the bucket's hook (overlap_with_ddp, which PyTorch refuses
    on gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    optimizer = torch.optim.SGD if overlap_hook else torch.optim.Adam
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer, lr=0.02,
                                  overlap_with_ddp=overlap_hook is not None)
    if overlap_hook == "ringcomm":
        ddp.register_comm_hook(ringcomm.torch.RingcommState(),
                               hook_with_zero_step(ringcomm.torch.ringcomm_hook, ddp, opt))
    elif overlap_hook == "torch":
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, opt))
    def digest():
        return hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    start, gen = digest(), torch.Generator().manual_seed(500 + r)
    for _ in range(6):  # overlapped: the first two or three iterations make no step
        opt.zero_grad()
        ddp(torch.randn(8, 8, generator=gen)).pow(2).mean().backward()
        if overlap_hook is None:
            opt.step()
    assert digest() != start, "ZeroRedundancyOptimizer made no step"
    return digest()


def torch_hook(kind):
    """The sha256 after DDP training with one of PyTorch's own Python hooks: its PowerSGD
    hook calls collectives in a future's callback and waits for them (run by the thread that
    completes the bucket's allreduce), fp16's chains one without, in tiny buckets. (PowerSGD
    in tiny buckets waits forever on gloo itself, whose two threads all wait in callbacks;
    torch 2.13's batched_powerSGD_hook fails its own assertion on both backends.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if kind == "fp16":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2, min_compression_rate=0.5,
                                            random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(600 + r)
    for _ in range(6):
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
    return hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


report["torch_hooks"] = [torch_hook(kind) for kind in ("powersgd", "fp16")]
report["joined"] = joined()
report["sparse"] = sparse_gradients()
report["zero"] = zero()
if backend == "ringcomm":
    report["zero_overlap"] = [zero("torch"), zero("ringcomm")]
if backend == "ringcomm":
    report["failed_in_backward"] = failed_in_backward()
    dist.barrier()
with open(f"report_{r}.json", "w") as f:  # a file each: the ranks' stdout interleaves
    json.dump({"rank": r, **report}, f)
dist.destroy_process_group()
'''


def _reports(where: Path) -> list[dict]:
    rows = [json.loads(path.read_text()) for path in where.glob("report_*.json")]
    for path in where.glob("report_*.json"):
        path.unlink()
    return sorted(rows, key=lambda row: row["rank"])


# The same job on PyTorch's own gloo under torchrun (no ringcomm in the way), run once for
# every launcher's ringcomm run to be compared with: its parameters do not depend on the
# launcher.
_GLOO_RUNS: dict[str, list[dict]] = {}


def _gloo_run(kind: str, tmp_path_factory: pytest.TempPathFactory,
              run: Callable[[Path], list[dict]]) -> list[dict]:
    """``run(directory)``'s reports for job ``kind`` on gloo, run at its first request."""
    if kind not in _GLOO_RUNS:
        _GLOO_RUNS[kind] = run(tmp_path_factory.mktemp(f"gloo-{kind}"))
    return _GLOO_RUNS[kind]


def _run(tmp_path: Path, env: dict[str, str], launcher: str, backend: str) -> list[dict]:
    """Run JOB on ``backend`` under ``launcher`` ("torchrun", "mpiexec", or "torchrun-gloo":
    torchrun with RINGCOMM_TORCHRUN_MPI=0, the ringcomm backend's communicator over gloo)."""
    if launcher == "torchrun-gloo":
        launcher, env = "torchrun", {**env, "RINGCOMM_TORCHRUN_MPI": "0"}
    job = tmp_path / "job.py"
    job.write_text(JOB)
    proc = run_job(_command(launcher, 2, job, backend, launcher), timeout=240, env=env,
                   cwd=tmp_path)
    reports = _reports(tmp_path)
    # Under mpiexec ringcomm's init_process_group_from_mpi made the gloo group, and its exit
    # pause (gloo_held.pause_at_exit) must keep even PyTorch's gloo from aborting.
    _check_exit(proc, reports, f"{backend} under {launcher}",
                gloo_baseline=backend == "gloo" and launcher == "torchrun")
    return reports


def _check_exit(proc: subprocess.CompletedProcess[str], reports: list[dict], what: str, *,
                ranks: int = 2, gloo_baseline: bool = False) -> None:
    """The job ended well, every one of its ``ranks`` having written its report: a process
    that aborts at exit after its work is done (as one on this backend did, now and then,
    before gloo_held) fails it; ``gloo_baseline``: the same job on PyTorch's own gloo
    backend (see exit_checks)."""
    out = proc.stdout[-3000:] + proc.stderr[-4000:]
    assert [row["rank"] for row in reports] == list(range(ranks)), f"{what}\n{out}"
    check_exit(proc.returncode, proc.stdout + proc.stderr, what, gloo_baseline=gloo_baseline)


@pytest.mark.slow
@pytest.mark.parametrize("launcher, underneath", [("torchrun", "mpi"), ("torchrun-gloo", "gloo"),
                                                  ("mpiexec", "mpi")])
def test_ringcomm_backend_trains_ddp_as_gloo_does(tmp_path, tmp_path_factory, subprocess_env,
                                                  mpiexec, launcher, underneath):
    ours = _run(tmp_path, subprocess_env, launcher, "ringcomm")
    theirs = _gloo_run("ddp", tmp_path_factory,
                       lambda where: _run(where, subprocess_env, "torchrun", "gloo"))
    for row in ours:
        assert row["backend"] == "ringcomm" and row["communicator"] == underneath, row
        assert row["refused"] == (
            "all_reduce: the ringcomm backend reduces with SUM, AVG, MIN, MAX, PRODUCT; "
            "allreduce failed on ranks 0, 1: unknown op 'band'; expected one of 'sum', 'avg', "
            "'min', 'max', 'prod'"), row
        assert row["refused_on_one"] == (
            "all_reduce: the ringcomm backend reduces with SUM, AVG, MIN, MAX, PRODUCT; "
            "allreduce failed on rank 0: unknown op 'bxor'; expected one of 'sum', 'avg', "
            "'min', 'max', 'prod'"), row
        shape, dtype = row["mismatch"]
        assert "ArgumentMismatchError" in shape and "shape differs between ranks" in shape, row
        assert "dtype differs between ranks" in dtype, row
    # An output or piece of the wrong size on rank 0 only: refused on every rank, before
    # anything moves, naming rank 0's problem (the same message on both).
    for name, words in (("reduce_scatter_bad_output", "reduce_scatter_tensor: the input has "
                         "4 elements, expected 6 (the output's 3 times the group's 2 ranks)"),
                        ("all_gather_bad_output", "all_gather_into_tensor: the output has 5 "
                         "elements, expected 4 (the input's 2 times the group's 2 ranks)"),
                        ("reduce_scatter_bad_piece", "reduce_scatter: input list 0's tensor "
                         "for rank 0 is 3 elements of float32, its output 2 of float32")):
        got = [row[name] for row in ours]
        assert got[0] == got[1] and "differ between ranks" in got[0] and words in got[0], got
        # DDP's broadcast of the parameters and its bucket allreduces went through ringcomm.
        assert row["calls_after_ddp"] >= row["calls"] + 6, row
    # Two ranks: a + b is b + a, so ringcomm's ring and gloo give the same bits.
    digests = {row["params"] for row in ours + theirs}
    assert len(digests) == 1, (ours, theirs)
    assert len({row["joined"] for row in ours + theirs}) == 1, (ours, theirs)
    assert len({row["sparse"] for row in ours + theirs}) == 1, (ours, theirs)
    assert len({row["zero"] for row in ours + theirs}) == 1, (ours, theirs)
    # PyTorch's PowerSGD hook, whose future callbacks call collectives and wait (they waited
    # for themselves on this backend), and its fp16 hook: gloo's parameters.
    assert len({tuple(row["torch_hooks"]) for row in ours + theirs}) == 1, (ours, theirs)
    # ZeRO's step inside the hook: ringcomm's hook gives PyTorch's allreduce_hook's bits.
    overlapped = {digest for row in ours for digest in row["zero_overlap"]}
    assert len(overlapped) == 1, ours
    assert len({row["float8"] for row in ours}) == 1 and ours[0]["float8"], ours
    # A collective that fails in DDP's backward: its error reaches backward() on every rank
    # (the failed future read as done by DDP's C++ crashed both ranks, the error lost).
    for row in ours:
        assert "ValueError: the bucket's allreduce failed here" in row["failed_in_backward"], row


FUNCTIONAL_JOB = r"""
import json, sys, warnings
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
import ringcomm.torch  # registers "ringcomm"

warnings.simplefilter("ignore", FutureWarning)  # the functional API's renamed functions
dist.init_process_group("ringcomm")
r, n = dist.get_rank(), dist.get_world_size()
g = dist.group.WORLD
done = lambda t: fc.wait_tensor(t)
for i in range(int(sys.argv[1])):
    x = torch.full((100,), float(r + i))
    got = done(fc.all_gather_tensor(x, 0, g))
    assert got.tolist() == [float(k + i) for k in range(n) for _ in range(100)], (i, got)
    got = done(fc.reduce_scatter_tensor(torch.arange(4.0 * n) + r, "sum", 0, g))
    assert got.tolist() == [n * (4 * r + j) + sum(range(n)) for j in range(4)], (i, got)
    got = [done(t) for t in fc.all_reduce_coalesced([torch.ones(3) * r, torch.ones(2)],
                                                    "sum", g)]
    assert [t.tolist() for t in got] == [[float(sum(range(n)))] * 3, [float(n)] * 2], got
    got = [done(t) for t in fc.all_gather_into_tensor_coalesced(
        [torch.tensor([r, i], dtype=torch.int64), torch.full((2,), float(r))], g)]
    assert got[0].tolist() == [v for k in range(n) for v in (k, i)], got
    got = [done(t) for t in fc.reduce_scatter_tensor_coalesced(
        [torch.ones(2 * n), torch.arange(float(n))], "sum", [0, 0], g)]
    assert [t.tolist() for t in got] == [[float(n)] * 2, [float(n * r)]], got
    half = done(fc.all_gather_tensor(torch.full((3,), float(r), dtype=torch.bfloat16), 0, g))
    assert half.tolist() == [float(k) for k in range(n) for _ in range(3)], half  # on gloo
    got = [done(t) for t in fc.all_gather_into_tensor_coalesced(   # on gloo, as one work
        [torch.full((2,), float(r), dtype=torch.bfloat16), torch.full((1,), r + 0.5,
                                                                      dtype=torch.bfloat16)], g)]
    assert [t.tolist() for t in got] == [[float(k) for k in range(n) for _ in range(2)],
                                         [k + 0.5 for k in range(n)]], got
    got = [done(t) for t in fc.reduce_scatter_tensor_coalesced(
        [torch.ones(2 * n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)], "sum",
        [0, 0], g)]
    assert [t.tolist() for t in got] == [[float(n)] * 2, [float(n)]], got
with open(f"report_{r}.json", "w") as f:
    json.dump({"rank": r, "calls": g.communicator.stats.calls}, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_functional_collectives_on_the_ringcomm_backend(tmp_path, subprocess_env):
    """The functional collectives (what DTensor, FSDP2 and torch.compile call) reach the group
    through PyTorch's C++ trampoline, which holds the GIL while it calls a method the Python
    group lacks: the coalesced forms then went to the gloo fallback with the GIL held, and
    deadlocked with gloo's worker thread (which takes the GIL to release a finished
    collective's tensors while it holds its queue's lock) in 3 of 4 runs of 400 rounds. The
    group now runs them itself; 300 rounds, exact values, through ringcomm's communicator."""
    job = tmp_path / "functional.py"
    job.write_text(FUNCTIONAL_JOB)
    rounds = 300
    proc = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(job), str(rounds)],
                   timeout=180, env=subprocess_env, cwd=tmp_path)
    reports = _reports(tmp_path)
    _check_exit(proc, reports, "functional collectives on ringcomm")
    for row in reports:
        # per round: one allgather, one reduce-scatter, two allreduces, two allgathers, two
        # reduce-scatters through the communicator (the bfloat16 allgather is gloo's)
        assert row["calls"] >= 8 * rounds, row


FSDP_JOB = START + r"""
import functools
from torch.distributed.fsdp import fully_shard

compiled = functools.partial(torch.compile, backend="aot_eager")  # dynamo's tracing, no C++
r = dist.get_rank()


def bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 2))


def fit(model, step_model, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + r)
    for _ in range(steps):
        opt.zero_grad()
        step_model(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
    tensors = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()


report = {"rank": r, "backend": dist.get_backend(), "params": sharded()}
comm = getattr(dist.group.WORLD, "communicator", None)
report["calls"] = None if comm is None else comm.stats.calls
model = bn_model()  # DDP rebuilds its buckets and broadcasts the BatchNorm's buffers
report["ddp"] = fit(model, compiled(torch.nn.parallel.DistributedDataParallel(model)))
if backend == "ringcomm":  # ringcomm's own hook on the compiled model
    from ringcomm.torch import register_ddp_hook
    model = bn_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = register_ddp_hook(ddp)
    report["ddp_hook"] = fit(model, compiled(ddp))
    report["hook_calls"] = state.stats.calls
model = bn_model()
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
report["fsdp"] = fit(model, compiled(model))  # FSDP2, compiled

# FSDP1 (FullyShardedDataParallel, what Accelerate's and Lightning's "fsdp" wrap with), each
# sharding strategy, its full parameters gathered on every rank (its BatchNorm buffers stay
# each rank's own: FSDP does not broadcast them).
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType

report["fsdp1"] = []
names = [name for name, _ in bn_model().named_parameters()]
for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                 ShardingStrategy.NO_SHARD):
    wrapped = FSDP(bn_model(), sharding_strategy=strategy, device_id=torch.device("cpu"),
                   use_orig_params=True)
    fit(wrapped, wrapped)
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=False)):
        full = wrapped.state_dict()
    report["fsdp1"].append(hashlib.sha256(
        b"".join(full[name].detach().numpy().tobytes() for name in names)).hexdigest())


def digest(model):
    full = [p.full_tensor() for p in model.parameters()]
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in full)).hexdigest()


# torch.distributed.checkpoint: the sharded state saved (its plan gathered and broadcast as
# objects), the parameters spoiled, then loaded back from the files each rank wrote.
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

opt = torch.optim.Adam(model.parameters(), lr=0.01)
model(torch.randn(4, 8)).pow(2).mean().backward()
opt.step()
saved = digest(model)
model_state, optim_state = get_state_dict(model, opt)
dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"ckpt_{backend}")
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
model_state, optim_state = get_state_dict(model, opt)
state = {"model": model_state, "optim": optim_state}
dcp.load(state, checkpoint_id=f"ckpt_{backend}")
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
report["dcp_saved"], report["dcp_loaded"] = saved, digest(model)
with open(f"report_{r}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp_and_compiled_models_on_the_ringcomm_backend(tmp_path, subprocess_env):
    """FSDP (fully_shard) shards, gathers and reduce-scatters through the backend's
    all_gather_into_tensor and reduce_scatter_tensor, to gloo's parameters (2 ranks under
    torchrun). Then torch.compile over DDP and FSDP2 models: c10d calls the group's Python
    collectives from C++ inside the compiled forward (DDP rebuilding its buckets), where
    TorchDynamo traced them and stopped at the group's attributes (UnsafeScriptObjectError;
    gloo's C++ has nothing to trace). Now the same parameters as on gloo, bit for bit, with
    and without ringcomm's DDP hook. FSDP1 (FullyShardedDataParallel), fully sharded,
    gradients and optimizer state sharded, and not sharded: gloo's full parameters, bit
    for bit. Then torch.distributed.checkpoint saves the FSDP2
    model and its optimizer, and loads them back after the parameters were spoiled: the
    saved state returns, and it is gloo's."""
    pytest.importorskip("torch.distributed.fsdp")
    job = tmp_path / "fsdp.py"
    job.write_text(FSDP_JOB)
    runs = {}
    for backend in ("ringcomm", "gloo"):
        proc = run_job(_command("torchrun", 2, job, backend, "torchrun"), timeout=300,
                       env=subprocess_env, cwd=tmp_path)
        runs[backend] = _reports(tmp_path)
        _check_exit(proc, runs[backend], f"FSDP, {backend}", gloo_baseline=backend == "gloo")
    for name in ("params", "ddp", "fsdp", "fsdp1", "dcp_saved"):
        assert len({str(row[name]) for rows in runs.values() for row in rows}) == 1, (name,
                                                                                       runs)
    for row in runs["ringcomm"] + runs["gloo"]:  # the checkpoint gave the saved state back
        assert row["dcp_loaded"] == row["dcp_saved"], row
    for row in runs["ringcomm"]:
        assert row["backend"] == "ringcomm" and row["calls"] >= 10, row
        # two ranks: the hook's a + b is DDP's own, bit for bit
        assert row["ddp_hook"] == row["ddp"] and row["hook_calls"] > 0, row

NUMBERING_JOB = r'''
import functools, json, os, sys
import torch, torch.distributed as dist
import ringcomm, ringcomm.torch  # registers "ringcomm"

if sys.argv[2] == "mpi":  # the group's communicator over MPI, numbered as mpiexec numbers
    ringcomm.init = functools.partial(ringcomm.init, "mpi")
mpi_rank = int(os.environ["PMI_RANK"])
torch_rank = [0, 2, 1][mpi_rank]  # numbered otherwise than the launcher numbers them
dist.init_process_group("ringcomm", init_method=f"file://{sys.argv[1]}", rank=torch_rank,
                        world_size=3)
try:
    t = torch.full((2,), float(torch_rank))
    dist.all_reduce(t)
    outcome = f"ok {t.tolist()}"
except RuntimeError as err:
    outcome = f"{type(err).__name__}: {err}"
comm = dist.group.WORLD.communicator
with open(f"report_{torch_rank}.json", "w") as f:
    json.dump({"rank": torch_rank, "outcome": outcome,
               "communicator": None if comm is None else comm.backend}, f)
'''


@pytest.mark.slow
@pytest.mark.parametrize("underneath", ["auto", "mpi"])
def test_a_group_numbered_unlike_the_launcher(tmp_path, subprocess_env, mpiexec, underneath):
    """mpiexec numbers the 3 processes 0, 1, 2 and init_process_group 0, 2, 1. ringcomm.init
    sees it and runs gloo over torch's numbering (auto), or MPI's world renumbered as torch's
    group (MPI, asked for: it kept the launcher's numbering before, and the backend's check
    of the numbering made the first collective raise on every rank)."""
    job = tmp_path / "job.py"
    job.write_text(NUMBERING_JOB)
    proc = run_job([mpiexec, "-n", "3", sys.executable, str(job),
                    str(tmp_path / "store"), underneath],
                   timeout=120, env=subprocess_env, cwd=tmp_path)
    reports = _reports(tmp_path)
    assert [row["rank"] for row in reports] == [0, 1, 2], proc.stdout[-2000:] + proc.stderr[-3000:]
    used = "gloo" if underneath == "auto" else "mpi"
    assert all(row == {"rank": row["rank"], "outcome": "ok [3.0, 3.0]", "communicator": used}
               for row in reports), reports


AUTOLOAD_JOB = r'''
import json, sys
import torch, torch.distributed as dist  # no import of ringcomm: PyTorch's entry point

dist.init_process_group("ringcomm")
r, n = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), float(r + 1))
dist.all_reduce(t)
with open(f"report_{r}.json", "w") as f:
    json.dump({"rank": r, "sum": t.tolist(), "backend": dist.get_backend(),
               "communicator": dist.group.WORLD.communicator.backend}, f)
dist.destroy_process_group()
'''


def test_the_backend_is_registered_as_torch_starts(tmp_path, subprocess_env):
    """The "torch.backends" entry point (pyproject.toml) registers "ringcomm" at the end of
    ``import torch``, so a program that never imports ringcomm can name the backend (here a
    torchrun job); TORCH_DEVICE_BACKEND_AUTOLOAD=0, PyTorch's switch, turns it off. Every
    ``import torch`` in the environment pays for that registration, so it loads none of the
    heavy modules torch leaves for later (TorchDynamo, 2.6 s here, was loaded so and doubled
    the time of ``import torch``), nor MPI, Numba, CuPy or a framework."""
    heavy = ("torch._dynamo", "numba", "mpi4py.MPI", "cupy", "lightning", "accelerate")
    code = ("import sys, torch, torch.distributed as dist; "
            "print('ringcomm' in dist.Backend.backend_list, 'ringcomm.torch' in sys.modules, "
            f"[m for m in {heavy!r} if m in sys.modules])")
    seen = {}
    for autoload in ("1", "0"):
        env = {**subprocess_env, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
        proc = run_job([sys.executable, "-c", code], timeout=120, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen[autoload] = proc.stdout.strip()
    assert seen == {"1": "True True []", "0": "False False []"}, seen
    job = tmp_path / "job.py"
    job.write_text(AUTOLOAD_JOB)
    proc = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(job)], timeout=240, env=subprocess_env,
                   cwd=tmp_path)
    reports = _reports(tmp_path)
    _check_exit(proc, reports, "init_process_group('ringcomm') without importing ringcomm")
    for row in reports:
        assert row["sum"] == [3.0, 3.0, 3.0] and row["backend"] == "ringcomm", row
        assert row["communicator"] == "mpi", row  # torchrun's processes joined one MPI world


# A job of attempts: each call's outcome (its result, or its error's kind and first line) and
# seconds, then an all_reduce that checks the group is still usable, and in step.
ATTEMPTS = r'''
import datetime, json, sys, time
import torch, torch.distributed as dist
import ringcomm.torch  # registers "ringcomm"

dist.init_process_group("ringcomm", timeout=datetime.timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
outcomes = {}

def attempt(name, call):
    start = time.monotonic()
    try:
        outcomes[name] = ("ok", call())
    except Exception as err:
        outcomes[name] = (type(err).__name__, str(err).split(chr(10))[0])
    outcomes[name] += (round(time.monotonic() - start, 1),)
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 3, (name, t)
'''

def _attempted(where: Path, env: dict[str, str], text: str, what: str) -> list[dict]:
    """The reports of an ATTEMPTS job ``text`` run by torchrun at 2 ranks in ``where``."""
    job = where / "attempts.py"
    job.write_text(text)
    proc = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(job)], timeout=240, env=env, cwd=where)
    reports = _reports(where)
    _check_exit(proc, reports, what)
    return reports


MIXED_PATHS_JOB = ATTEMPTS + r'''

# bfloat16 (no NumPy dtype) takes the gloo fallback, float32 ringcomm's communicator:
# here on rank 1 only.
odd = torch.bfloat16 if r == 1 else torch.float32
def gather_into():
    out = torch.empty(2 * n, dtype=odd)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r), dtype=odd))
    return out.float().tolist()
attempt("all_gather_into_tensor", gather_into)
def gather_list():
    outs = [torch.empty(2, dtype=odd) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(r), dtype=odd))
    return [o.float().tolist() for o in outs]
attempt("all_gather", gather_list)
def scatter():
    out = torch.empty(2, dtype=odd)
    dist.reduce_scatter_tensor(out, torch.ones(2 * n, dtype=odd))
    return out.float().tolist()
attempt("reduce_scatter_tensor", scatter)
def queued_then_fallback():  # ringcomm's calls queued before: they run first, as on rank 0
    works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(3)]
    out = torch.empty(2 * n, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r), dtype=torch.bfloat16))
    return [w.wait() for w in works] and out.float().tolist()
attempt("fallback on every rank", queued_then_fallback)
def strided():  # a strided input on one rank: ringcomm's path on both
    x = torch.arange(4.0).reshape(2, 2) + 10 * r
    src = x.t()[0] if r == 1 else x.t()[0].contiguous()
    out = torch.empty(2 * n)
    dist.all_gather_into_tensor(out, src)
    return out.tolist()
attempt("strided", strided)
def queued_behind():  # a collective called while another runs waits for it, in call order
    import threading
    a, b = torch.full((3,), 1.0 + r), torch.full((3,), 10.0 + r)
    if r == 0:
        first = {}
        runs = threading.Thread(target=lambda: first.update(
            work=dist.all_reduce(a)))  # waited for: runs there, waiting for rank 1
        runs.start()
        time.sleep(0.3)
        second = dist.all_reduce(b, async_op=True)  # queued behind it
        runs.join()
        second.wait()
    else:
        time.sleep(0.6)
        dist.all_reduce(a)
        dist.all_reduce(b)
    threads = sorted(t.name for t in threading.enumerate()
                     if t.name.startswith("ringcomm-process-group"))
    return [a.tolist(), b.tolist(), threads]
attempt("queued behind", queued_behind)
# Both ranks on the gloo fallback, with tensors of one byte size but different dtypes: gloo
# would mix their bytes, silently; every rank raises instead.
def fallback_dtypes():
    x = torch.ones(4, dtype=torch.bfloat16) if r == 0 else torch.ones(8, dtype=torch.bool)
    out = torch.empty(n * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out.float().tolist()
attempt("fallback dtypes", fallback_dtypes)
def all_to_all_dtypes():
    x = torch.ones(2 * n, dtype=torch.float32 if r == 0 else torch.int32)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out.tolist()
attempt("all_to_all dtypes", all_to_all_dtypes)
def all_to_all():  # uneven splits: sizes may differ between ranks
    x = torch.arange(3.0 + r) + 10 * r
    splits = [[1, 2], [2, 2]][r]
    out = torch.empty([[1, 2], [2, 2]][0][r] + [[1, 2], [2, 2]][1][r])
    dist.all_to_all_single(out, x, output_split_sizes=[[1, 2], [2, 2]][0][r:r + 1]
                           + [[1, 2], [2, 2]][1][r:r + 1], input_split_sizes=splits)
    return out.tolist()
attempt("all_to_all", all_to_all)
with open(f"report_{r}.json", "w") as f:
    json.dump({"rank": r, "outcomes": outcomes,
               "calls": dist.group.WORLD.communicator.stats.calls}, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_ranks_whose_tensors_take_different_paths(tmp_path, subprocess_env):
    """Which path a collective takes (ringcomm's communicator, or the gloo fallback for
    tensors it cannot take) depends on each rank's own tensors. A rank on the other path used
    to wait there until the timeout (60 s here); now every rank raises the same
    ArgumentMismatchError at once, and the group goes on in step. Strided tensors take
    ringcomm's path, which copies them."""
    reports = _attempted(tmp_path, subprocess_env, MIXED_PATHS_JOB,
                         "collectives whose ranks take different paths")
    for name in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor"):
        got = [row["outcomes"][name] for row in reports]
        assert all(kind == "ArgumentMismatchError" and seconds < 20
                   for kind, _, seconds in got), (name, got)
        assert got[0][1] == got[1][1], got  # the same message on both ranks
        assert "on the gloo fallback on rank 1" in got[0][1], got
    for row in reports:
        outcomes = row["outcomes"]
        assert outcomes["fallback on every rank"][:2] == ["ok", [0.0, 0.0, 1.0, 1.0]]
        assert outcomes["strided"][:2] == ["ok", [0.0, 2.0, 10.0, 12.0]], outcomes
        # Collectives waited for at once run on their caller's thread where none is pending,
        # else on the group's (started on both ranks by the async calls of "fallback on
        # every rank"), in call order.
        assert outcomes["queued behind"][:2] == ["ok", [[3.0] * 3, [21.0] * 3, [
            "ringcomm-process-group 0"]]], outcomes
        assert outcomes["all_to_all"][:2] == (["ok", [0.0, 10.0, 11.0]] if row["rank"] == 0
                                              else ["ok", [1.0, 2.0, 12.0, 13.0]]), outcomes
    for name, error, words in (
            ("fallback dtypes", "ArgumentMismatchError",
             "all_gather_into_tensor of bfloat16 [4] on the gloo fallback on rank 0; "
             "all_gather_into_tensor of bool [8] on the gloo fallback on rank 1"),
            ("all_to_all dtypes", "DtypeMismatchError",
             "all_to_all_single: tensors of different dtypes (rank 0: float32, rank 1: "
             "int32)")):
        got = [row["outcomes"][name] for row in reports]
        assert got[0][:2] == got[1][:2] and got[0][0] == error, (name, got)
        assert words in got[0][1], (name, got)


OUTPUTS_JOB = ATTEMPTS + r"""

def gather(count, shape=(2, 3)):
    outs = [torch.zeros(shape) for _ in range(count)]
    dist.all_gather(outs, torch.arange(6.0).reshape(2, 3) + 10 * r)
    return [o.tolist() for o in outs]
attempt("all_gather short here", lambda: gather(1 if r == 1 else n))
attempt("all_gather short everywhere", lambda: gather(1))
attempt("all_gather long here", lambda: gather(n + 1 if r == 0 else n))
attempt("all_gather reshaped", lambda: gather(n, (3, 2)))
def into(dtype):
    out = torch.zeros(2 * n, dtype=dtype)
    dist.all_gather_into_tensor(out, torch.tensor([1.0001, 70000.0]))
    return out.tolist()
attempt("all_gather_into_tensor float16", lambda: into(torch.float16))
attempt("all_gather_into_tensor float16 here",
        lambda: into(torch.float16 if r == 0 else torch.float32))
attempt("all_gather_into_tensor short here", lambda: dist.all_gather_into_tensor(
    torch.zeros(2 * n - (r == 1)), torch.ones(2)))
def scatter_into(dtype):
    out = torch.zeros(2, dtype=dtype)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * n) * 0.75)
    return out.tolist()
attempt("reduce_scatter_tensor int32", lambda: scatter_into(torch.int32))
def scatter_pieces():
    sizes = [5, 7] if r == 0 else [6, 6]
    out = torch.zeros(6)
    dist.reduce_scatter(out, [torch.ones(k) for k in sizes])
    return out.tolist()
attempt("reduce_scatter misaligned here", scatter_pieces)
def narrow(dtype):  # summed on the gloo fallback, wrapping around as torch does
    out = torch.zeros(2, dtype=dtype)
    dist.reduce_scatter_tensor(out, (torch.arange(2 * n) * 60 + r).to(dtype))
    return out.tolist()
for name in ("int8", "uint8"):
    attempt(f"reduce_scatter_tensor {name}", lambda name=name: narrow(getattr(torch, name)))
def result():
    t = torch.full((2,), float(r))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return [x.tolist() for x in work.result()]
attempt("result", result)
def twice():
    t = torch.full((2,), 1.0 + r)
    dist.all_reduce_coalesced([t, t])
    return t.tolist()
attempt("coalesced twice", twice)
def views(second):  # two views of one tensor, reduced once (the overlap was summed twice)
    b = torch.full((8,), 1.0 + r)
    dist.all_reduce_coalesced([b[:6], b[2:]] if second == "slices" else [b, b.view(2, 4)])
    return b.tolist()
attempt("coalesced slices", lambda: views("slices"))
attempt("coalesced reshaped", lambda: views("reshaped"))
def gathered_from_an_output():  # the second member's input is the first's output
    out1, out2 = torch.zeros(4), torch.zeros(4)
    out1[:2] = 10.0 * (r + 1)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(out1, torch.full((2,), r + 1.0))
        dist.all_gather_into_tensor(out2, out1[:2])
    cm.wait()
    return out2.tolist()
attempt("coalesced gather of an output", gathered_from_an_output)
def scattered_from_an_output():
    buf = torch.full((4,), 100.0 * (r + 1))
    out2 = torch.zeros(2)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(buf[:2], torch.full((4,), r + 1.0))
        dist.reduce_scatter_tensor(out2, buf)
    cm.wait()
    return out2.tolist()
attempt("coalesced reduce_scatter of an output", scattered_from_an_output)
with open(f"report_{r}.json", "w") as f:
    json.dump({"rank": r, "outcomes": outcomes}, f)
dist.destroy_process_group()
"""


def _wrapped(value: int, bits: int, signed: bool) -> int:
    """``value`` as an integer of ``bits`` bits holds it (wrapping around)."""
    value %= 1 << bits
    return value - (1 << bits) if signed and value >= 1 << (bits - 1) else value


@pytest.mark.slow
def test_outputs_refused_on_every_rank(tmp_path, subprocess_env):
    """Outputs that do not fit their collective (an all_gather list of another length or
    shapes, an all_gather_into_tensor or reduce_scatter_tensor output of another dtype or
    size, reduce_scatter pieces of other sizes) are refused before anything moves, on every
    rank, as gloo refuses them: they were filled in part, cast (a finite 70000.0 into float16
    Inf), or raised on one rank only after the collective. Work.result() gives the outputs,
    and a tensor listed twice in all_reduce_coalesced is reduced once, as on gloo. 8-bit
    integers reduce-scatter as on gloo (wrapping around), where the communicator refused
    them."""
    reports = _attempted(tmp_path, subprocess_env, OUTPUTS_JOB,
                         "outputs that do not fit their collective")
    everywhere = {  # refused alike on every rank: the same problem on each
        "all_gather short everywhere": "output list 0 has 1 tensors, expected one per rank",
        "all_gather reshaped": "output 0 of list 0 is float32 (3, 2), expected the input's "
                               "float32 (2, 3)",
        "all_gather_into_tensor float16": "the output's dtype is float16, expected the "
                                          "input's, float32",
        "reduce_scatter_tensor int32": "the output's dtype is int32, expected the input's, "
                                       "float32"}
    here = {  # on one rank only: every rank raises the same mismatch, naming that rank's
        "all_gather short here": "output list 0 has 1 tensors",
        "all_gather long here": "output list 0 has 3 tensors",
        "all_gather_into_tensor float16 here": "the output's dtype is float16",
        "all_gather_into_tensor short here": "the output has 3 elements, expected 4",
        "reduce_scatter misaligned here": "input list 0's tensor for rank 0 is 5 elements"}
    for name, words in (*everywhere.items(), *here.items()):
        got = [row["outcomes"][name] for row in reports]
        kind = "ValueError" if name in everywhere else "ArgumentMismatchError"
        assert all(g[0] == kind and words in g[1] and g[2] < 20 for g in got), (name, got)
        assert got[0][1] == got[1][1], (name, got)  # the same message on both ranks
    for row in reports:
        for name, bits, signed in (("int8", 8, True), ("uint8", 8, False)):
            sums = [_wrapped(120 * k + 1, bits, signed) for k in range(4)]  # 60k + 0, 60k + 1
            assert row["outcomes"][f"reduce_scatter_tensor {name}"][:2] == [
                "ok", sums[2 * row["rank"]: 2 * row["rank"] + 2]], (name, row)
        assert row["outcomes"]["result"][:2] == ["ok", [[1.0, 1.0]]], row
        assert row["outcomes"]["coalesced twice"][:2] == ["ok", [3.0, 3.0]], row
        # Members of one coalesced call that share memory read their inputs as they were
        # (gloo's answers; before: [3, 3, 6, 6, 6, 6, 3, 3], 6s, [1, 1, 1, 1], and [6, 6] on
        # rank 0 only).
        assert row["outcomes"]["coalesced slices"][:2] == ["ok", [3.0] * 8], row
        assert row["outcomes"]["coalesced reshaped"][:2] == ["ok", [3.0] * 8], row
        assert row["outcomes"]["coalesced gather of an output"][:2] == [
            "ok", [10.0, 10.0, 20.0, 20.0]], row
        assert row["outcomes"]["coalesced reduce_scatter of an output"][:2] == [
            "ok", [300.0, 300.0]], row


PLAIN_INIT_JOB = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist  # ringcomm's entry point registers the backend

backend, world_size = sys.argv[1], int(sys.argv[2])
timeout = datetime.timedelta(seconds=float(os.environ.get("RENDEZVOUS_TIMEOUT", "600")))
try:
    dist.init_process_group(backend, timeout=timeout,
                            **({"world_size": world_size} if world_size else {}))
except Exception as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
    sys.exit(0)
r, n = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), float(r + 1))
dist.all_reduce(t)
print(json.dumps({"rank": r, "size": n, "backend": dist.get_backend(), "sum": t.tolist()}),
      flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_plain_init_process_group_under_mpiexec(tmp_path, subprocess_env, mpiexec):
    """``dist.init_process_group("ringcomm")`` (and "gloo") as written for torchrun, launched
    by mpiexec without torchrun's variables: rank and size from MPI (it raised "environment
    variable RANK expected"), never a group of one; a world_size (or WORLD_SIZE) that is not the
    job's, RANK set on some ranks only, or an MPI world that is not the launcher's job, raises
    on every rank."""
    job = tmp_path / "plain.py"
    job.write_text(PLAIN_INIT_JOB)

    def rows(cmd: list[str], env: dict[str, str] = subprocess_env) -> list[dict]:
        proc = run_job(cmd, timeout=120, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        found, decoder, at = [], json.JSONDecoder(), proc.stdout.find("{")
        while at >= 0:  # the ranks' lines, which mpiexec may run together
            row, end = decoder.raw_decode(proc.stdout, at)
            found.append(row)
            at = proc.stdout.find("{", end)
        return found

    # Each backend once (the same reading of MPI's rank and size serves both), at an odd
    # size and at two.
    for backend, n in (("ringcomm", 3), ("gloo", 2)):
        got = rows([mpiexec, "-n", str(n), sys.executable, str(job), backend, "0"])
        assert sorted(row["rank"] for row in got) == list(range(n)), got
        assert all(row["size"] == n and row["backend"] == backend
                   and row["sum"] == [n * (n + 1) / 2] * 3 for row in got), got
    got = rows([mpiexec, "-n", "2", sys.executable, str(job), "ringcomm", "3"])
    assert len(got) == 2 and all("world_size=3 on rank 0; world_size=3 on rank 1, but the job"
                                 in row["error"] for row in got), got
    # WORLD_SIZE wrong on one rank (it was not read): every rank raises.
    got = rows([mpiexec, "-n", "1", "-env", "WORLD_SIZE", "3", sys.executable, str(job),
                "ringcomm", "0", ":", "-n", "1", sys.executable, str(job), "ringcomm", "0"])
    assert len(got) == 2 and all("WORLD_SIZE=3 on rank 0, but the job" in row["error"]
                                 for row in got), got
    # A launcher's variables for 2 processes around one process alone: MPI's world is 1.
    alone = rows([sys.executable, str(job), "gloo", "0"],
                 {**subprocess_env, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert len(alone) == 1 and "PMI_SIZE=2 (mpich), but MPI.COMM_WORLD has 1 process" in \
        alone[0]["error"], alone
    # No launcher at all: torch's own rendezvous and its own error.
    plain = rows([sys.executable, str(job), "gloo", "0"])
    assert len(plain) == 1 and "RANK expected" in plain[0]["error"], plain


SUBGROUPS_JOB = START + r'''
r, n = dist.get_rank(), dist.get_world_size()
keeps_order = "sort_ranks" in inspect.signature(dist.new_group).parameters
# Every rank makes every group (torch's rule); the backend's creator and each group's
# collectives run on its members only.
pair = dist.new_group([0, 2])
flipped = dist.new_group([2, 1], **({"sort_ranks": False} if keeps_order else {}))
alone = dist.new_group([1])
# Every rank, in another order than the job's (numbered as given where torch keeps it).
backwards = dist.new_group([2, 1, 0], **({"sort_ranks": False} if keeps_order else {}))
report = {"rank": r}

def communicator(group):
    comm = getattr(group, "communicator", None)
    return None if comm is None else [comm.backend, comm.rank, comm.size]

def gather_and_broadcast(name, group, width):
    o = torch.empty(width * group.size())
    dist.all_gather_into_tensor(o, torch.full((width,), float(r)), group=group)
    report[f"{name}_gather"] = o.tolist()
    b = torch.full((width,), float(r))
    dist.broadcast(b, src=2, group=group)  # src: a global rank
    report[f"{name}_broadcast"] = b.tolist()

def attempt(name, call):
    try:
        report[name] = call()
    except Exception as err:
        report[name] = f"{type(err).__name__}: {str(err).splitlines()[0]}"

if r in (0, 2):
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t, group=pair)
    report["pair_sum"] = t.tolist()
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pair)
    report["pair_max"] = t.tolist()
    gather_and_broadcast("pair", pair, 2)
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(4.0) + r, group=pair)
    report["pair_reduce_scatter"] = o.tolist()
    if backend == "ringcomm":  # (gloo itself ends the process for these)
        # Arguments that differ between the members: the same error on both, at once.
        attempt("pair_mismatch", lambda: dist.all_reduce(torch.ones(3 if r == 0 else 5),
                                                          group=pair))
        attempt("pair_dtype", lambda: dist.all_reduce(  # the same bytes, another dtype
            torch.ones(2, dtype=torch.float32 if r == 0 else torch.int32), group=pair))
        odd = torch.bfloat16 if r == 2 else torch.float32  # the gloo fallback on rank 2 only
        attempt("pair_paths", lambda: dist.all_gather_into_tensor(
            torch.empty(4, dtype=odd), torch.ones(2, dtype=odd), group=pair))
    ok = True  # ringcomm's collectives (queued) and gloo's (reduce: the fallback) in turn
    for k in range(20):
        a, g = torch.full((1000,), float(k + r)), torch.full((3,), float(k * r))
        work = dist.all_reduce(a, group=pair, async_op=True)
        dist.reduce(g, dst=2, group=pair)
        work.wait()
        ok &= a.tolist() == [2.0 * k + 2] * 1000 and (r != 2 or g.tolist() == [2.0 * k] * 3)
    report["pair_interleaved"] = ok
    # DDP over the pair: a replica group, as in hybrid sharding
    report["pair_params"] = trained(pair, seed=50, steps=4, hidden=16, batch=8)
    report["pair_comm"] = communicator(pair)
if r in (1, 2):
    o = torch.empty(4)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)), group=flipped)
    report["flipped_gather"] = o.tolist()
    report["flipped_rank"] = dist.get_group_rank(flipped, r)
    report["flipped_comm"] = communicator(flipped)
    if backend == "ringcomm":  # the group's communicator splits, by its members alone
        import numpy as np
        comm = flipped.communicator
        x = np.arange(1 << 18, dtype=np.float32) * (r + 1)
        report["two_level_equal"] = bool(np.array_equal(
            comm.allreduce(x, algorithm="hierarchical"),
            comm.allreduce(x, algorithm="flat")))
        half = comm.transport.split(0, -comm.rank)  # what the two-level allreduce calls
        report["split"] = [half.rank, half.size, half.allgather_object(r)]
        half.close()
if r == 1:
    t = torch.full((3,), 7.0)
    dist.all_reduce(t, group=alone)
    report["alone_sum"] = t.tolist()
    report["alone_comm"] = communicator(alone)
gather_and_broadcast("backwards", backwards, 1)
report["backwards_comm"] = communicator(backwards)
t = torch.full((2,), float(r))  # the job's group, after its sub-groups
dist.all_reduce(t)
report["world_sum"] = t.tolist()
report["keeps_order"] = keeps_order
with open(f"report_{r}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


def _run_subgroups(tmp_path: Path, env: dict[str, str], launcher: str,
                   backend: str) -> list[dict]:
    job = tmp_path / "subgroups.py"
    job.write_text(SUBGROUPS_JOB)
    proc = run_job(_command(launcher, 3, job, backend, launcher), timeout=240, env=env,
                   cwd=tmp_path)
    reports = _reports(tmp_path)
    _check_exit(proc, reports, f"{backend} under {launcher}", ranks=3,
                gloo_baseline=backend == "gloo")
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("launcher, underneath", [("mpiexec", "mpi"), ("torchrun", "gloo")])
def test_sub_groups_on_the_ringcomm_backend(tmp_path, tmp_path_factory, subprocess_env, mpiexec,
                                            launcher, underneath):
    """Groups of some of the job's ranks (new_group): torch makes them, and runs their
    collectives, on their members only. Under mpiexec each gets a ringcomm communicator of
    its members alone, numbered as the group is (in the order given where torch keeps it):
    over MPI (MPI_Comm_create_group) under mpiexec, over the group's own gloo group under
    torchrun; so does a group of every rank in another order than the job's (the job's
    communicator numbers them as torch's default group). Exact values, the same error on
    every member for arguments that differ (plain
    gloo ends the process for some of those, and reads others' bytes for the wrong dtype),
    and DDP over a two-rank sub-group ends with the same parameters, bit for bit, as on
    gloo."""
    ours = _run_subgroups(tmp_path, subprocess_env, launcher, "ringcomm")
    theirs = _gloo_run("subgroups", tmp_path_factory,
                       lambda where: _run_subgroups(where, subprocess_env, "torchrun", "gloo"))
    first = [2, 1] if ours[1]["keeps_order"] else [1, 2]  # flipped's members, in its order
    every = [2, 1, 0] if ours[1]["keeps_order"] else [0, 1, 2]  # backwards's
    for row in ours:
        r = row["rank"]
        assert row["world_sum"] == [3.0, 3.0], row
        assert row["backwards_gather"] == [float(g) for g in every], row
        assert row["backwards_broadcast"] == [2.0], row
        assert row["backwards_comm"] == [underneath, every.index(r), 3], row
        if r in (0, 2):
            assert row["pair_sum"] == [4.0] * 4 and row["pair_max"] == [3.0, 3.0], row
            assert row["pair_gather"] == [0.0, 0.0, 2.0, 2.0], row
            assert row["pair_broadcast"] == [2.0, 2.0], row
            assert row["pair_interleaved"], row
            me = [0, 2].index(r)
            assert row["pair_reduce_scatter"] == [2 * (2 * me + j) + 2.0 for j in range(2)]
            assert row["pair_comm"] == [underneath, me, 2], row
        if r in (1, 2):
            assert row["flipped_gather"] == [float(g) for g in first for _ in range(2)], row
            assert row["flipped_rank"] == first.index(r), row
            assert row["flipped_comm"] == [underneath, first.index(r), 2], row
            assert row["two_level_equal"] and row["split"] == [
                1 - first.index(r), 2, first[::-1]], row
        if r == 1:
            assert row["alone_sum"] == [7.0] * 3, row
            assert row["alone_comm"] == [underneath, 0, 1], row
    pair = [row for row in ours if row["rank"] in (0, 2)]
    for name, words in (("pair_mismatch", "ArgumentMismatchError: allreduce: shape differs"),
                        ("pair_dtype", "DtypeMismatchError: allreduce: dtype differs between "
                                       "ranks: float32 on rank 0; int32 on rank 1"),
                        ("pair_paths", "ArgumentMismatchError: collective calls differ")):
        assert pair[0][name] == pair[1][name], (name, pair)  # the same on both members
        assert pair[0][name].startswith(words), (name, pair[0][name])
    assert "on the gloo fallback on rank 1" in pair[0]["pair_paths"], pair
    digests = {row["pair_params"] for row in pair + [row for row in theirs
                                                     if row["rank"] in (0, 2)]}
    assert len(digests) == 1, (ours, theirs)


HSDP_JOB = START + r'''
from torch.distributed.device_mesh import init_device_mesh

r = dist.get_rank()
# Hybrid sharding: shard within pairs of ranks, replicate across them (sub-groups of 2).
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
params = sharded(mesh)
comms = [getattr(mesh.get_group(d), "communicator", None) for d in ("replicate", "shard")]
report = {"rank": r, "params": params,
          "comms": [None if c is None else [c.backend, c.rank, c.size, c.stats.calls]
                    for c in comms]}
if backend == "ringcomm":
    from ringcomm.torch import register_ddp_hook

    def hooked_over(group, comm):
        # DDP over the replicate group {r, r +- 2}, the hook on ``comm``.
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(4, 1, bias=False), process_group=group)
        try:
            register_ddp_hook(model, comm=comm)
        except ValueError as err:
            return f"ValueError: {err}"
        model(torch.full((1, 4), float(r))).sum().backward()
        return model.module.weight.grad.reshape(-1).tolist()

    # The replicate group's own communicator, then the shard group's: as many ranks, others.
    report["hooked"] = [hooked_over(mesh.get_group("replicate"), c) for c in comms]
with open(f"report_{r}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.parametrize("launcher, underneath", [("mpiexec", "mpi"), ("torchrun", "gloo")])
def test_hybrid_sharding_on_the_ringcomm_backend(tmp_path, tmp_path_factory, subprocess_env,
                                                 mpiexec, launcher, underneath):
    """FSDP2 over a 2 x 2 device mesh (HSDP), 4 processes: its replicate and shard groups are
    sub-groups of two ranks, each with a ringcomm communicator of its members; the parameters
    end bit-identical to the same training on gloo, on every rank. ringcomm's hook on DDP
    over the replicate group averages over it with that group's communicator, and
    register_ddp_hook refuses the shard group's (as many ranks, but others: each rank's
    gradients were averaged with the wrong rank), the same error on both of its ranks."""

    def hsdp(where: Path, launcher: str, backend: str) -> list[dict]:
        job = where / "hsdp.py"
        job.write_text(HSDP_JOB)
        proc = run_job(_command(launcher, 4, job, backend, launcher), timeout=300,
                       env=subprocess_env, cwd=where)
        reports = _reports(where)
        _check_exit(proc, reports, f"HSDP, {backend}", ranks=4,
                    gloo_baseline=backend == "gloo")
        return reports

    reports = {"ringcomm": hsdp(tmp_path, launcher, "ringcomm"),
               "gloo": _gloo_run("hsdp", tmp_path_factory,
                                 lambda where: hsdp(where, "torchrun", "gloo"))}
    for row in reports["ringcomm"]:
        r = row["rank"]
        (rb, rr, rn, rcalls), (sb, sr, sn, scalls) = row["comms"]
        assert (rb, rr, rn, sb, sr, sn) == (underneath, r // 2, 2, underneath, r % 2, 2), row
        assert rcalls > 0 and scalls > 0, row
        right, wrong = row["hooked"]
        assert right == [float(1 + r % 2)] * 4, row  # (r + the other replica's r) / 2
        assert wrong.startswith("ValueError: the state's communicator spans other processes "
                                "than the DDP model's process group"), wrong
        assert ("a DDP model over ranks 0, 2 on rank 0; register_ddp_hook, a DDP model over "
                "ranks 1, 3 on rank 1") in wrong, wrong
    for pair in ((0, 1), (2, 3)):  # each shard group's two ranks: the same error
        errors = {reports["ringcomm"][r]["hooked"][1] for r in pair}
        assert len(errors) == 1, errors
    digests = {row["params"] for rows in reports.values() for row in rows}
    assert len(digests) == 1, reports


CUDA_JOB = r'''
import hashlib, json, os
import torch, torch.distributed as dist
import ringcomm.torch  # registers "ringcomm"

torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
dist.init_process_group("ringcomm")
r, n = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", torch.cuda.current_device())
report = {"rank": r,
          "cuda_backend": type(dist.group.WORLD._get_backend(dev)).__name__}
t = torch.arange(6.0, device=dev) + r
dist.all_reduce(t)
assert torch.equal(t.cpu(), torch.arange(6.0) * n + sum(range(n))), t
cpu = torch.full((3,), float(r + 1))  # CPU tensors between: ringcomm's communicator
dist.all_reduce(cpu)
assert cpu.tolist() == [n * (n + 1) / 2] * 3, cpu
b = torch.full((3,), float(r), device=dev)
dist.broadcast(b, src=n - 1)
assert b.tolist() == [float(n - 1)] * 3
o = torch.empty(2 * n, device=dev)
dist.all_gather_into_tensor(o, torch.tensor([r, r + 0.5], device=dev))
assert o.tolist() == [v for k in range(n) for v in (k, k + 0.5)], o
o = torch.empty(2, device=dev)
dist.reduce_scatter_tensor(o, torch.arange(2.0 * n, device=dev) + r)
assert o.tolist() == [n * (2 * r + j) + sum(range(n)) for j in range(2)], o
a2a = torch.empty(n, device=dev)
dist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32, device=dev) + 10 * r)
assert a2a.tolist() == [10.0 * k + r for k in range(n)], a2a
a2a = torch.arange(2.0 * n, device=dev) + 100 * r  # in place: the input copied first
dist.all_to_all_single(a2a, a2a)
assert a2a.tolist() == [100.0 * s + 2 * r + j for s in range(n) for j in range(2)], a2a
g = torch.full((2,), float(r), device=dev)
dist.reduce(g, dst=0)  # from torch's C++ to the group's CUDA backend
if r == 0:
    assert g.tolist() == [float(sum(range(n)))] * 2

def trained(group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev],
                                                    process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + r)
    for _ in range(6):
        opt.zero_grad()
        ddp(torch.randn(16, 8, generator=gen).to(dev)).pow(2).mean().backward()
        opt.step()
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()

report["ringcomm"] = trained(None)
report["nccl"] = trained(dist.new_group(backend="nccl"))
with open(f"report_{r}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


@pytest.mark.gpu
def test_cuda_tensors_on_the_ringcomm_backend_run_on_nccl(tmp_path, subprocess_env):
    """On a GPU, the backend's CUDA tensors run on torch's NCCL (as torch's own
    "cpu:gloo,cuda:nccl"), its CPU tensors on ringcomm's communicator, in one group: exact
    collectives, reduce from torch's C++, and DDP on CUDA ending with the parameters of DDP on
    a plain NCCL group."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("needs a GPU and NCCL")
    job = tmp_path / "cuda.py"
    job.write_text(CUDA_JOB)
    proc = run_job(_command("torchrun", 1, job), timeout=300, env=subprocess_env,
                   cwd=tmp_path)
    reports = _reports(tmp_path)
    _check_exit(proc, reports, "CUDA tensors on the ringcomm backend", ranks=1)
    for row in reports:
        assert row["cuda_backend"] == "ProcessGroupNCCL", row
        assert row["ringcomm"] == row["nccl"], row
