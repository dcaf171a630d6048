"""Settings that differ between ranks, or are invalid on one rank only, under a real mpiexec.

Each job gives one rank a different environment (mpiexec's ``-env`` with ``:`` between the
ranks' argument sets). Every rank must raise the same typed error from ``ringcomm.init``,
promptly: never a hang in MPI's start-up, never a wrong value.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each rank writes one bracketed line: what init raised, or what an allreduce returned.
PROBE = r"""
import os, sys, numpy as np, ringcomm
rank = int(os.environ["PMI_RANK"])
try:
    c = ringcomm.init("mpi", abort_on_exception=False)
    y = c.allreduce(np.ones(16, np.float32))
    out = f"ok {c.size} {y[0]} {bool(np.all(y == y[0]))}"
    c.close()
except Exception as err:
    out = f"{type(err).__name__}: {err}"
os.write(1, f"<{rank}|{out}>\n".encode())
"""


def _run_two(mpiexec: str, env: dict[str, str], variable: str, value: str,
             other: str | None = None, probe: str = PROBE,
             cwd: Path | None = None) -> dict[int, str]:
    """Run PROBE at 2 ranks, rank 0 with ``variable=value`` (rank 1 with ``other``, or
    without it); return each rank's line."""
    base = {k: v for k, v in env.items() if not k.startswith(("RINGCOMM_", "HOROVOD_"))}
    rank1 = [] if other is None else ["-env", variable, other]
    cmd = [mpiexec, "-n", "1", "-env", variable, value, sys.executable, "-c", probe, ":",
           "-n", "1", *rank1, sys.executable, "-c", probe]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=base, cwd=cwd)
    lines = dict(re.findall(r"^<(\d)\|(.*)>$", proc.stdout, re.MULTILINE))
    assert set(lines) == {"0", "1"}, (proc.returncode, proc.stdout, proc.stderr)
    return {int(r): line for r, line in lines.items()}


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("RINGCOMM_SEGMENT_BYTES", "abc", "RINGCOMM_SEGMENT_BYTES must be a byte count"),
    ("RINGCOMM_SEGMENT_BYTES", "99999999999999999999",
     "RINGCOMM_SEGMENT_BYTES must be from 64 B to 1 GiB, got 99999999999999999999"),
    ("RINGCOMM_INLINE_BYTES", "abc", "RINGCOMM_INLINE_BYTES must be a byte count"),
    ("RINGCOMM_INLINE_BYTES", "1G",
     "RINGCOMM_INLINE_BYTES must be a multiple of 8 bytes from 0 B to 1 MiB, got 1073741824"),
    ("RINGCOMM_TIMEOUT", "abc", "RINGCOMM_TIMEOUT must be a positive number of seconds"),
    ("RINGCOMM_CONSISTENCY_CHECK", "abc", "RINGCOMM_CONSISTENCY_CHECK must be 0 or 1"),
    ("RINGCOMM_ALGORITHM", "abc", "RINGCOMM_ALGORITHM must be one of"),
    ("RINGCOMM_RANKS_PER_NODE", "abc", "RINGCOMM_RANKS_PER_NODE must be a number of ranks"),
    ("RINGCOMM_LOG_LEVEL", "abc", "RINGCOMM_LOG_LEVEL must be one of DEBUG"),
    # Read at the first call before: rank 0 raised there alone, rank 1 went on.
    ("RINGCOMM_CPU_KERNELS", "bogus", "RINGCOMM_CPU_KERNELS must be one of numba, numpy, "
                                      "got 'bogus'"),
])
def test_bad_value_on_one_rank_fails_every_rank(mpiexec, subprocess_env, variable, value,
                                                 expected):
    """A bad value on rank 0 only: both ranks raise the same InvalidArgumentError, naming
    rank 0, the variable and its value (rank 0 used to exit before MPI started, leaving
    rank 1 in MPI's start-up forever)."""
    lines = _run_two(mpiexec, subprocess_env, variable, value)
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(f"InvalidArgumentError: init failed on rank 0: {expected}"), lines


@pytest.mark.parametrize(("variable", "value", "other", "expected"), [
    # Rank 0 without the check, rank 1 with it: the 16-float allreduce used to return
    # [1, 1.0000002, ...] on one rank and fail to allocate 7.94 EiB on the other.
    ("RINGCOMM_CONSISTENCY_CHECK", "0", None,
     "consistency_check differs between ranks: False on rank 0; True on rank 1"),
    ("RINGCOMM_SEGMENT_BYTES", "4096", "8192",
     "segment_bytes differs between ranks: 4096 on rank 0; 8192 on rank 1"),
    ("RINGCOMM_INLINE_BYTES", "0", None,
     "inline_bytes differs between ranks: 0 on rank 0; default on rank 1"),
    ("RINGCOMM_TIMEOUT", "60", None,
     "timeout differs between ranks: 60.0 on rank 0; 1800.0 on rank 1"),
    ("RINGCOMM_ALGORITHM", "flat", "hierarchical",
     "algorithm differs between ranks: flat on rank 0; hierarchical on rank 1"),
    ("RINGCOMM_RANKS_PER_NODE", "1", None,
     "topology differs between ranks: 1 on rank 0; auto on rank 1"),
])
def test_setting_that_differs_fails_every_rank(mpiexec, subprocess_env, variable, value, other,
                                               expected):
    """Valid values that differ between the ranks: the same ArgumentMismatchError on both,
    naming the setting and each rank's value."""
    lines = _run_two(mpiexec, subprocess_env, variable, value, other)
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(f"ArgumentMismatchError: init: {expected}"), lines


BACKEND_PROBE = PROBE.replace('ringcomm.init("mpi",',
                              'ringcomm.init(os.environ.get("PROBE_BACKEND", "mpi"), timeout=60,')


@pytest.mark.parametrize(("value", "other", "expected"), [
    ("bogus", None, "ArgumentMismatchError: init: backend differs between ranks: bogus on "
                    "rank 0; mpi on rank 1"),
    ("auto", None, "ArgumentMismatchError: init: backend differs between ranks: auto on "
                   "rank 0; mpi on rank 1"),
    ("nccl", None, "ArgumentMismatchError: init: backend differs between ranks: nccl on "
                   "rank 0; mpi on rank 1"),
    ("bogus", "bogus", "ValueError: unknown backend 'bogus'; expected one of auto, mpi"),
])
def test_backend_that_differs_fails_every_rank(mpiexec, subprocess_env, value, other, expected):
    """The backend asked for, agreed over MPI before any backend starts: an unknown one on
    rank 0 only left rank 1 in MPI's start-up forever (rank 0 raised before MPI started), and
    "auto" or "nccl" against "mpi" read each other's start-up messages (a TypeError on one
    rank, a timeout on the other)."""
    lines = _run_two(mpiexec, subprocess_env, "PROBE_BACKEND", value, other, BACKEND_PROBE)
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(expected), lines


def test_a_rank_running_another_release_fails_every_rank(mpiexec, subprocess_env, tmp_path):
    """A node with another install of ringcomm (here rank 1 imports a copy of the package
    whose version says 0.0.1-other, first on its PYTHONPATH): every rank raises the same
    ArgumentMismatchError at init, naming each rank's release, where the two used to run
    the job together, each framing and reducing calls as its own release does."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "ringcomm", other / "ringcomm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    version = other / "ringcomm" / "core" / "version.py"
    mine = re.search(r'^__version__ = "(.*)"$', version.read_text(), re.MULTILINE)[1]
    version.write_text(version.read_text().replace(f'"{mine}"', '"0.0.1-other"'))
    path = f"{other}{os.pathsep}{subprocess_env.get('PYTHONPATH', '')}"
    lines = _run_two(mpiexec, subprocess_env, "PYTHONPATH", subprocess_env["PYTHONPATH"],
                     path, cwd=tmp_path)  # not the tree's root: python -c puts it first
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(
        f"ArgumentMismatchError: init: ringcomm version differs between ranks: {mine} on "
        "rank 0; 0.0.1-other on rank 1. Every rank must run the same ringcomm release"), lines


def test_the_same_settings_on_every_rank_start(mpiexec, subprocess_env):
    lines = _run_two(mpiexec, subprocess_env, "RINGCOMM_SEGMENT_BYTES", "4096", "4K")
    assert lines == {0: "ok 2 2.0 True", 1: "ok 2 2.0 True"}, lines


def test_cpu_kernels_differing_are_allowed(mpiexec, subprocess_env):
    """NumPy's reference and the compiled codecs give the same bits: ranks may differ."""
    lines = _run_two(mpiexec, subprocess_env, "RINGCOMM_CPU_KERNELS", "numpy", "numba")
    assert lines == {0: "ok 2 2.0 True", 1: "ok 2 2.0 True"}, lines


def test_log_level_differing_is_allowed(mpiexec, subprocess_env):
    """Logging changes nothing that travels: ranks may log at different levels."""
    lines = _run_two(mpiexec, subprocess_env, "RINGCOMM_LOG_LEVEL", "DEBUG")
    assert lines == {0: "ok 2 2.0 True", 1: "ok 2 2.0 True"}, lines


# One job for every Horovod case (importing torch costs seconds a process): each rank sets
# its value (or none) before hvd.init(), which a failed init leaves free to be called again.
HVD_PROBE = r"""
import json, os, sys, torch, ringcomm.torch as hvd
rank = int(os.environ["PMI_RANK"])
for variable, value, other in json.loads(sys.argv[1]):
    mine = value if rank == 0 else other
    if mine is not None:
        os.environ[variable] = mine
    try:
        hvd.init()
        out = f"ok {hvd.size()} {hvd.allreduce(torch.ones(3), op=hvd.Sum)[0].item()}"
        hvd.shutdown()
    except Exception as err:
        out = f"{type(err).__name__}: {err}"
    os.environ.pop(variable, None)
    os.write(1, f"<{rank}|{out}>\n".encode())
"""

HVD_CASES = [
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe", None,
     "InvalidArgumentError: init failed on rank 0: HOROVOD_HIERARCHICAL_ALLREDUCE must be 0 "
     "or 1"),
    ("HOROVOD_CYCLE_TIME", "soon", None,
     "InvalidArgumentError: init failed on rank 0: HOROVOD_CYCLE_TIME must be a number"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-1", None,
     "InvalidArgumentError: init failed on rank 0: HOROVOD_STALL_CHECK_TIME_SECONDS must be a "
     "finite number >= 0"),
    ("HOROVOD_CYCLE_TIME", "5", None, "ok 2 2.0"),          # timing may differ between ranks
    ("HOROVOD_FUSION_THRESHOLD", "1024", None,
     "ArgumentMismatchError: init: HOROVOD_FUSION_THRESHOLD differs between ranks: 1024 on "
     "rank 0; 4194304 on rank 1"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", "0",
     "ArgumentMismatchError: init: HOROVOD_HIERARCHICAL_ALLREDUCE differs between ranks: "
     "hierarchical on rank 0; flat on rank 1"),
    ("HOROVOD_CACHE_CAPACITY", "0", None,
     "ArgumentMismatchError: init: HOROVOD_CACHE_CAPACITY differs between ranks: 0 on rank 0; "
     "1024 on rank 1"),
    ("HOROVOD_CACHE_CAPACITY", "lots", None,
     "InvalidArgumentError: init failed on rank 0: HOROVOD_CACHE_CAPACITY must be an integer"),
    # Rank 0 writes the timeline: its missing directory fails every rank (it used to raise
    # FileNotFoundError on rank 0 alone, the other rank going on to wait for it); another
    # rank's is never opened.
    ("HOROVOD_TIMELINE", "/nonexistent-ringcomm-dir/t.json", None,
     "InvalidArgumentError: init failed on rank 0: HOROVOD_TIMELINE: timeline file "
     "'/nonexistent-ringcomm-dir/t.json': directory '/nonexistent-ringcomm-dir' does not exist"),
    ("HOROVOD_TIMELINE", None, "/nonexistent-ringcomm-dir/t.json", "ok 2 2.0"),
    ("HOROVOD_CYCLE_TIME", "5", "5", "ok 2 2.0"),           # and init works after all of them
]


def test_horovod_variables_are_agreed(mpiexec, subprocess_env):
    """hvd.init() agrees on the Horovod variables as ringcomm.init() on its own: a bad value
    on one rank used to raise there before MPI started, leaving the other rank waiting. Each
    case in turn in one 2-rank job, after the cases before it failed or shut down."""
    pytest.importorskip("torch")
    base = {k: v for k, v in subprocess_env.items() if not k.startswith(("RINGCOMM_", "HOROVOD_"))}
    cases = json.dumps([case[:3] for case in HVD_CASES])
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", HVD_PROBE, cases],
                          capture_output=True, text=True, timeout=120, env=base)
    ranks: dict[str, list[str]] = {"0": [], "1": []}
    for rank, line in re.findall(r"^<(\d)\|(.*)>$", proc.stdout, re.MULTILINE):
        ranks[rank].append(line)
    assert len(ranks["0"]) == len(ranks["1"]) == len(HVD_CASES), (
        proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    for case, got0, got1 in zip(HVD_CASES, ranks["0"], ranks["1"], strict=True):
        assert got0 == got1, (case, got0, got1)
        assert got0.startswith(case[3]), (case, got0)
