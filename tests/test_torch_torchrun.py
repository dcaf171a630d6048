"""Jobs started by torchrun: the communicator runs over gloo, the hook and hvd work as under MPI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = r"""
import torch
import torch.distributed as dist
import ringcomm
import ringcomm.torch as hvd
from ringcomm.torch import RingcommState, ringcomm_hook

torch.set_num_threads(1)
hvd.init()                                  # torchrun's environment: a gloo group
rank, size = hvd.rank(), hvd.size()
assert dist.is_initialized() and size == dist.get_world_size() == 2, size
assert hvd.gloo_enabled() and hvd.local_size() == 2

t = torch.full((5,), float(rank))
assert torch.equal(hvd.allreduce(t, op=hvd.Sum), torch.full((5,), 1.0))
assert torch.equal(hvd.allgather(t[: rank + 1]), torch.tensor([0.0, 1.0, 1.0]))
assert torch.equal(hvd.broadcast(t, root_rank=1), torch.ones(5))
big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)     # the ring, not the inline path
assert torch.equal(hvd.allreduce(big, op=hvd.Sum), torch.arange(300_000.0) * 3)
try:
    hvd.allreduce(torch.ones(3 + rank))
    raise AssertionError("no error")
except hvd.HorovodInternalError as err:
    assert "shape differs between ranks" in str(err), err

def train(hooked, compression=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = torch.nn.parallel.DistributedDataParallel(net)
    if hooked:
        model.register_comm_hook(RingcommState(compression=compression, start_iter=1,
                                               min_compress_bytes=0), ringcomm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

expected, got = train(False), train(True)
torch.testing.assert_close(got, expected)
int8 = train(True, ringcomm.Int8())
assert torch.equal(hvd.broadcast(int8, root_rank=0), int8)   # identical on both ranks
print(f"rank {rank} ok", flush=True)
hvd.shutdown()
"""


@pytest.mark.slow
def test_hook_and_hvd_under_torchrun(tmp_path, subprocess_env):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("no torchrun next to the interpreter")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=110, env=subprocess_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
