"""torchrun's restarts (``--max-restarts``): a job whose rank failed starts again and trains,
though the store its workers share still holds what the failed attempt wrote."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from exit_checks import run_bounded

from ringcomm.core.restarts import attempt_prefix, stale_keys_warning

_SHARED = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1"}


@pytest.mark.parametrize(("env", "prefix"), [
    ({}, ""),                                                         # not under torchrun
    ({**_SHARED, "TORCHELASTIC_RESTART_COUNT": "0"}, ""),             # the first attempt
    ({**_SHARED, "TORCHELASTIC_RESTART_COUNT": "2"}, "ringcomm-attempt-2/"),
    ({**_SHARED, "TORCHELASTIC_USE_AGENT_STORE": "False",            # a store per attempt
      "TORCHELASTIC_RESTART_COUNT": "2"}, ""),
    ({**_SHARED, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2"}, ""),
])
def test_an_attempt_prefix_only_where_every_worker_counts_alike(env, prefix):
    assert attempt_prefix(env) == prefix
    several_agents = env.get("GROUP_WORLD_SIZE") == "2"
    warning = stale_keys_warning(env)
    assert (warning is not None) == several_agents
    if several_agents:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
        assert "TORCHELASTIC_RESTART_COUNT=2" in warning


# Rank 1 fails on the first attempt after one allreduce; torchrun starts both ranks again.
SCRIPT = r"""
import os, sys
import numpy as np

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if sys.argv[1] == "backend":
    import torch, torch.distributed as dist
    import ringcomm.torch  # noqa: F401  registers "ringcomm"
    dist.init_process_group("ringcomm")
    rank = dist.get_rank()
    def allreduce(x):
        t = torch.from_numpy(x)
        dist.all_reduce(t)
        return t.numpy()
    end = dist.destroy_process_group
else:
    import ringcomm
    comm = ringcomm.init()
    assert comm.backend == "mpi", comm.backend     # torchrun's processes joined one MPI world
    rank, allreduce, end = comm.rank, comm.allreduce, comm.close
small = np.full(4, rank + 1 + 10 * attempt, dtype=np.float32)
assert allreduce(small).tolist() == [3.0 + 20 * attempt] * 4
if attempt == 0 and rank == 1:
    raise RuntimeError("rank 1 fails on the first attempt")
big = np.arange(300_000, dtype=np.float32) * (rank + 1)          # the ring, not the inline path
assert np.array_equal(allreduce(big), np.arange(300_000, dtype=np.float32) * 3)
print(f"attempt {attempt} rank {rank} ok", flush=True)
end()
"""


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["backend", "init"])
def test_a_restarted_job_trains_on_its_second_attempt(tmp_path, subprocess_env, entry):
    """Under ``torchrun --max-restarts 1`` on one node, the second attempt of a job whose rank
    failed starts ringcomm again (the default group on the "ringcomm" backend, or
    ``ringcomm.init()`` over one MPI world) and gets exact sums. Before, it read the failed
    attempt's addresses from the agent's store and failed to connect (the PMI server's, or
    gloo's)."""
    pytest.importorskip("torch")
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("no torchrun next to the interpreter")
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    env = {k: v for k, v in subprocess_env.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = run_bounded([str(torchrun), "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", str(path), entry], timeout=150, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 1 fails on the first attempt" in out
    assert "attempt 1 rank 0 ok" in proc.stdout and "attempt 1 rank 1 ok" in proc.stdout
    assert "attempt 0 rank 0 ok" not in proc.stdout
