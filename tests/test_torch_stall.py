"""Operations that some ranks never submit: reported with their names and ranks, never mixed.

Each case is a 2-rank ``mpiexec`` job with a 3-second stall limit
(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS). Every rank writes what it saw as JSON lines; the test
checks the errors' types and messages and that the job ended in bounded time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

STALL_S = 3.0
pytestmark = pytest.mark.timeout(120)

JOB = r"""
import json, os, sys, time
import torch
import ringcomm.torch as hvd

case = sys.argv[1]
if case == "limits" and os.environ["PMI_RANK"] == "1":  # rank 1's own limit: 60 s
    os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "60"
hvd.init()
rank = hvd.rank()


def report(what, **fields):
    with open(f"{sys.argv[3]}/rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(dict(rank=rank, what=what, **fields)) + "\n")


def attempt(what, fn):
    start = time.monotonic()
    try:
        fn()
        report(what, ok=True)
    except Exception as err:
        report(what, ok=False, type=type(err).__name__, message=str(err),
               runtime=isinstance(err, RuntimeError), elapsed=time.monotonic() - start)


if case == "crossed":      # each rank submits an operation the other never does
    name = f"only_on_{rank}"
    attempt("crossed", lambda: hvd.allreduce(torch.ones(3), name=name))
    attempt("after", lambda: hvd.allreduce(torch.ones(3), name="after"))
elif case == "barrier":     # rank 0 in a barrier, rank 1 in an allreduce
    if rank == 0:
        attempt("barrier", hvd.barrier)
    else:
        attempt("barrier", lambda: hvd.allreduce(torch.ones(3), name="metric"))
    attempt("after", lambda: hvd.allreduce(torch.ones(3), name="after"))
elif case == "idle":        # rank 1 submits nothing at all
    if rank == 0:
        attempt("idle", lambda: hvd.allreduce(torch.ones(3), name="lonely"))
    else:
        time.sleep(2 * float(sys.argv[2]))
elif case == "limits":      # stall limits that differ: rank 0's decides on every rank
    stall = float(sys.argv[2])
    first, later = {}, {}
    if rank == 0:
        first["b"] = hvd.allreduce_async(torch.full((1000,), 10.0), name="b", op=hvd.Sum)
        time.sleep(stall + 1.5)
    else:
        first["c"] = hvd.allreduce_async(torch.full((1000,), 20.0), name="c", op=hvd.Sum)
        time.sleep(stall + 2)
        later["b"] = hvd.allreduce_async(torch.full((1000,), 20.0), name="b", op=hvd.Sum)
    later["x"] = hvd.allreduce_async(torch.full((1000,), 1000.0 * (rank + 1)), name="x",
                                     op=hvd.Sum)
    for what, handle in [*first.items(), *later.items()]:
        attempt(what, lambda: report(f"{what}.value",
                                     value=sorted(set(hvd.synchronize(handle).tolist()))))
elif case == "buckets":     # fusion thresholds that differ: the ranks cut other buckets
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   fusion_threshold_bytes=64 if rank else 1 << 20)
    model(torch.ones(2, 4)).sum().backward()
    attempt("buckets", opt.synchronize)
elif case == "sparse":      # an embedding used on rank 0 only: a sparse gradient there, none on 1
    emb, lin = torch.nn.Embedding(10, 2, sparse=True), torch.nn.Linear(2, 1)
    named = [*emb.named_parameters(prefix="emb"), *lin.named_parameters(prefix="lin")]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=1.0),
                                   named_parameters=named)
    h = emb(torch.tensor([[1, 2]])).mean(1) if rank == 0 else torch.ones(1, 2)
    lin(h).sum().backward()
    attempt("sparse", opt.synchronize)
report("end")
"""


def run_case(mpiexec: str, env: dict[str, str], tmp_path: Path, case: str,
             limit: float = 90.0) -> tuple[list[dict], float, str]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(env, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=str(STALL_S))
    start = time.monotonic()
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, str(script), case,
                             str(STALL_S), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job did not end within {limit} s:\n{out}\n{err}")
    elapsed = time.monotonic() - start
    lines = [json.loads(line) for path in sorted(tmp_path.glob("rank*.jsonl"))
             for line in path.read_text().splitlines()]
    return lines, elapsed, out + err


def by(lines: list[dict], what: str) -> dict[int, dict]:
    return {d["rank"]: d for d in lines if d["what"] == what}


def test_crossed_operations_fail_on_both_ranks_naming_them(mpiexec, subprocess_env, tmp_path):
    lines, _, err = run_case(mpiexec, subprocess_env, tmp_path, "crossed")
    crossed = by(lines, "crossed")
    assert set(crossed) == {0, 1}, err
    for rank, d in crossed.items():
        assert not d["ok"] and d["type"] == "StalledOperationError" and d["runtime"]
        assert f"'only_on_{rank}' was submitted by rank {rank} but not by rank {1 - rank}" \
            in d["message"]
        assert STALL_S <= d["elapsed"] < STALL_S + 10
    # The job goes on: a later operation that both submit runs.
    assert all(d["ok"] for d in by(lines, "after").values()) and len(by(lines, "after")) == 2


def test_barrier_against_an_allreduce_fails_on_both_ranks(mpiexec, subprocess_env, tmp_path):
    lines, _, err = run_case(mpiexec, subprocess_env, tmp_path, "barrier")
    seen = by(lines, "barrier")
    assert set(seen) == {0, 1}, err
    assert "'barrier' was submitted by rank 0 but not by rank 1" in seen[0]["message"]
    assert "'metric' was submitted by rank 1 but not by rank 0" in seen[1]["message"]
    assert all(d["type"] == "StalledOperationError" for d in seen.values())
    assert len(by(lines, "after")) == 2 and all(d["ok"] for d in by(lines, "after").values())


def test_a_rank_that_never_negotiates_is_reported_with_the_waiting_names(
        mpiexec, subprocess_env, tmp_path):
    lines, elapsed, err = run_case(mpiexec, subprocess_env, tmp_path, "idle")
    idle = by(lines, "idle")
    assert set(idle) == {0}, err
    d = idle[0]
    assert d["type"] == "StalledOperationError"
    assert "while rank 0 waited to run 'lonely'" in d["message"]
    assert STALL_S <= d["elapsed"] < STALL_S + 10
    assert elapsed < 4 * STALL_S + 30


def test_stall_limits_that_differ_between_ranks_fail_an_operation_on_every_rank(
        mpiexec, subprocess_env, tmp_path):
    """Rank 1 sets a 60 s limit, rank 0 3 s: rank 0's fails "b" (rank 0's) and "c" (rank 1's)
    on both ranks at once. With each rank's own limit, rank 0 failed "b" and rank 1 kept it,
    so rank 1's later "b" (20s) was summed into rank 0's "x" (1020, silently), and rank 1
    waited out the timeout."""
    lines, _, err = run_case(mpiexec, dict(subprocess_env, RINGCOMM_TIMEOUT="40"), tmp_path,
                             "limits")
    for what, submitted_by in (("b", 0), ("c", 1)):
        d = by(lines, what)[submitted_by]
        assert d["type"] == "StalledOperationError", (d, err)
        assert f"'{what}' was submitted by rank {submitted_by} but not by rank " \
            f"{1 - submitted_by} within {STALL_S:g} s" in d["message"]
    late_b = by(lines, "b")
    assert set(late_b) == {0, 1}  # rank 1's second "b", alone, stalls in turn
    assert not late_b[1]["ok"] and late_b[1]["type"] == "StalledOperationError"
    values = by(lines, "x.value")
    assert set(values) == {0, 1}, err
    assert all(d["value"] == [3000.0] for d in values.values()), values


def test_differing_optimizer_buckets_are_reported_as_such(mpiexec, subprocess_env, tmp_path):
    """DistributedOptimizer buckets that differ between ranks (here fusion_threshold_bytes) stall
    as in Horovod; the error says what makes the buckets differ."""
    lines, _, err = run_case(mpiexec, subprocess_env, tmp_path, "buckets")
    seen = by(lines, "buckets")
    assert set(seen) == {0, 1}, err
    for d in seen.values():
        assert d["type"] == "StalledOperationError", d
        assert "it is a DistributedOptimizer bucket, and the ranks cut different ones where " \
            "their parameters' names, which of them require a gradient, " \
            "fusion_threshold_bytes or the compression differ" in d["message"]


def test_a_sparse_gradient_missing_on_a_rank_is_reported_on_every_rank(mpiexec, subprocess_env,
                                                                       tmp_path):
    """An embedding with sparse gradients used by rank 0 only: rank 0 reduces each parameter
    apart (the sparse one by allgather), rank 1 the zeros it puts in for the missing gradient
    fused with the others. That stalls, as in Horovod; every rank's error (rank 0's named a
    plain allreduce of "lin.weight") says what makes the buckets differ and that
    sparse_as_dense=True reduces the embedding as the others' zeros."""
    lines, _, err = run_case(mpiexec, subprocess_env, tmp_path, "sparse")
    seen = by(lines, "sparse")
    assert set(seen) == {0, 1}, err
    names = {0: "'lin.weight'", 1: "'lin.weight..emb.weight'"}
    for rank, d in seen.items():
        assert d["type"] == "StalledOperationError", d
        assert f"allreduce {names[rank]} was submitted by rank {rank}" in d["message"], d
        assert "a gradient is sparse on some ranks and missing on others (an embedding used " \
            "by some ranks only: sparse_as_dense=True reduces it as the others' zeros)" \
            in d["message"], d


def test_a_stall_counts_from_after_every_rank_submitted():
    """Rank 0's clock at the start of the cycle that brings an operation can be earlier than
    another rank's submission of it (that rank sends its message later in the same cycle), so
    the stall counts from the next cycle's start: no rank ever sees it fail before the limit
    on its own clock."""
    from ringcomm.torch._errors import StalledOperationError
    from ringcomm.torch.horovod._control import ResponseCache
    from ringcomm.torch.horovod._table import PendingTable

    table = PendingTable(2, 0, ResponseCache(8), stall_limit=STALL_S, stall_warning=math.inf)
    meta = {"dtype": "torch.float32", "device": "cpu", "shape": (3,), "op": "SUM",
            "prescale": 1.0, "postscale": 1.0, "compression": None}
    only_on_1 = ("allreduce.x", "allreduce", "x", meta, True)
    t0 = 100.0
    assert table.absorb([([], False, t0), ([only_on_1], False, t0 + 0.5)], 1) == []
    # Past the limit from the bringing cycle's start, not from the next one's.
    t1 = t0 + 0.01
    assert table.absorb([([], False, t1), ([], False, t1)], 2) == []
    assert table.absorb([([], False, t1 + STALL_S - 0.001), ([], False, 0.0)], 3) == []
    assert table  # still pending
    [outcome] = table.absorb([([], False, t1 + STALL_S + 0.001), ([], False, 0.0)], 4)
    assert isinstance(outcome.error, StalledOperationError)
    assert "'x' was submitted by rank 1 but not by rank 0" in str(outcome.error)
    assert not table
