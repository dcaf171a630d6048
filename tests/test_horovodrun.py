"""ringcomm under Horovod's own launcher: ``horovodrun -np N python train.py`` where Horovod runs
without MPI (its "Gloo" mode: processes it starts itself, with ``HOROVOD_RANK``, ``HOROVOD_SIZE``
and the address of its rendezvous server). Each process once took itself for a job of one:
``ringcomm.init()`` and ``hvd.init()`` gave size 1 on every rank, and training went on without
a word, each rank alone. The processes now form one MPI world over horovodrun's rendezvous
server.

horovodrun is Horovod's own, from its source release on PyPI (tests/upstream/horovodrun.py:
``make`` unpacks it into .venv/horovod-src); the jobs below run real horovodrun command lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from exit_checks import run_bounded
from ports import free_port

from ringcomm import registry
from ringcomm.backends.rendezvous_http import RendezvousStore
from ringcomm.core import launch

ROOT = Path(__file__).resolve().parent.parent
HOROVODRUN = ROOT / "tests" / "upstream" / "horovodrun.py"
sys.path.insert(0, str(HOROVODRUN.parent))
from horovodrun import source_dir  # noqa: E402

SOURCE = source_dir()
needs_horovodrun = pytest.mark.skipif(
    SOURCE is None, reason="no Horovod sources: python tests/upstream/horovodrun.py --fetch "
    "(make test does it)")

pytestmark = pytest.mark.slow


def horovodrun(np_: int, args: list[str], env: dict[str, str], timeout: float = 150
               ) -> subprocess.CompletedProcess[str]:
    """``horovodrun -np np_ <args>`` (Horovod's own launcher, no MPI), bounded by ``timeout``."""
    return run_bounded([sys.executable, str(HOROVODRUN), "-np", str(np_), *args],
                       timeout=timeout, env=env, cwd=ROOT)


def outputs(text: str, marker: str) -> dict[int, str]:
    """What each rank printed after ``marker`` (horovodrun prefixes lines with ``[rank]``)."""
    found = re.findall(rf"^\[(\d+)\]<stdout>:{re.escape(marker)}(.*)$", text, re.MULTILINE)
    return {int(rank): rest for rank, rest in found}


@pytest.fixture
def env(subprocess_env: dict[str, str]) -> dict[str, str]:
    # A rank left waiting fails within a minute instead of the default half hour.
    return {**subprocess_env, "RINGCOMM_TIMEOUT": "60"}


JOB = textwrap.dedent(r"""
    import hashlib, os
    import numpy as np
    import ringcomm

    comm = ringcomm.init()
    said = tuple(int(os.environ[f"HOROVOD_{k}"]) for k in ("RANK", "SIZE", "LOCAL_RANK",
                                                          "LOCAL_SIZE"))
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == said, said
    n = comm.size
    big = np.arange(300_000, dtype=np.float32) * (comm.rank + 1)       # the ring
    total = comm.allreduce(big)
    assert np.array_equal(total, np.arange(300_000, dtype=np.float32) * (n * (n + 1) // 2))
    ints = comm.allreduce(np.full(5, comm.rank, dtype=np.int64), op="max")  # inline path
    assert ints.tolist() == [n - 1] * 5
    gathered = comm.allgather(np.array([comm.rank], dtype=np.int32))
    assert gathered.ravel().tolist() == list(range(n)), gathered
    noisy = np.random.default_rng(comm.rank).standard_normal(100_000).astype(np.float32)
    mean = comm.allreduce(noisy, op="avg", compression=ringcomm.Int8())
    digest = hashlib.sha256(mean.tobytes()).hexdigest()[:16]
    print(f"JOB {comm.backend} {comm.rank} {comm.size} {digest}", flush=True)
    comm.close()
""")


@needs_horovodrun
@pytest.mark.parametrize("ranks", [2, 3])
def test_horovodrun_processes_form_one_job(ranks, env, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = horovodrun(ranks, [sys.executable, str(script)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = outputs(proc.stdout, "JOB ")
    assert sorted(said) == list(range(ranks)), proc.stdout[-3000:]
    backends, digests = set(), set()
    for rank, line in said.items():
        backend, r, size, digest = line.split()
        assert (int(r), int(size)) == (rank, ranks)
        backends.add(backend)
        digests.add(digest)
    assert backends == {"mpi"}
    assert len(digests) == 1, said  # the compressed average is bit-identical on every rank


@needs_horovodrun
def test_horovod_training_script_trains_as_under_mpiexec(env, mpiexec):
    """examples/train_hvd.py (``import ringcomm.torch as hvd``; hvd.init(), a compressed
    DistributedOptimizer, broadcasts) under horovodrun trains to the same losses and accuracy,
    to the last printed digit, as under mpiexec."""
    args = [sys.executable, "examples/train_hvd.py", "--compression", "int8", "--epochs", "2"]
    under_horovodrun = horovodrun(2, args, env)
    assert under_horovodrun.returncode == 0, (under_horovodrun.stdout[-3000:]
                                              + under_horovodrun.stderr[-3000:])
    under_mpiexec = run_bounded([mpiexec, "-n", "2", *args], timeout=150, env=env, cwd=ROOT)
    assert under_mpiexec.returncode == 0, under_mpiexec.stderr[-3000:]

    def epochs(text: str) -> list[str]:  # loss and accuracy; not the step time
        return [re.sub(r"\s+step .*$", "", m) for m in
                re.findall(r"^(?:\[0\]<stdout>:)?(epoch .*)$", text, re.MULTILINE)]

    assert "over 2 ranks" in under_horovodrun.stdout
    assert len(epochs(under_mpiexec.stdout)) == 2
    assert epochs(under_horovodrun.stdout) == epochs(under_mpiexec.stdout)


def _errors(text: str) -> dict[int, str]:
    return {int(r): m for r, m in
            re.findall(r"^\[(\d+)\]<stderr>:(\w*Error: .*)$", text, re.MULTILINE)}


@needs_horovodrun
def test_mpi_that_cannot_start_on_one_rank_fails_every_rank_alike(env, tmp_path):
    """Rank 1 started MPI alone before ringcomm (a world of its own): every rank raises the
    same error, naming rank 1 and why, at once (no rank waits for the others)."""
    script = tmp_path / "job.py"
    # Each rank prints what it raised and ends well: horovodrun ends the others as soon as one
    # process fails, which may be before they print.
    script.write_text(textwrap.dedent("""
        import os
        if os.environ["HOROVOD_RANK"] == "1":
            from mpi4py import MPI  # noqa: F401
        import ringcomm
        try:
            ringcomm.init()
            print("JOB started", flush=True)
        except RuntimeError as err:
            print(f"RAISED {type(err).__name__}: {err}", flush=True)
    """))
    proc = horovodrun(2, [sys.executable, str(script)], env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "JOB started" not in proc.stdout
    errors = outputs(proc.stdout, "RAISED ")
    assert sorted(errors) == [0, 1], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert errors[0] == errors[1]
    assert errors[0].startswith("RuntimeError: HOROVOD_SIZE=2 (horovodrun): ringcomm runs "
                                "horovodrun's processes as one MPI world"), errors[0]
    assert "rank 1: mpi4py.MPI was imported before" in errors[0]


@needs_horovodrun
def test_gloo_backend_under_horovodrun_is_refused_on_every_rank(env, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import ringcomm\nringcomm.init('gloo')\nprint('JOB started')\n")
    proc = horovodrun(2, [sys.executable, str(script)], env, timeout=120)
    assert proc.returncode != 0 and "JOB started" not in proc.stdout
    # MPI has started by then: the first rank to raise ends the job (MPI_Abort), so the
    # other may not get to print its own (the same) error.
    errors = set(_errors(proc.stdout + proc.stderr).values())
    assert len(errors) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (error,) = errors
    assert "found HOROVOD_SIZE=2 (horovodrun)" in error
    assert "init_process_group_from_mpi" in error


def test_elastic_horovodrun_is_refused(monkeypatch):
    for name, value in {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
                        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                        "HOROVOD_GLOO_RENDEZVOUS_PORT": "9", "HOROVOD_ELASTIC": "1"}.items():
        monkeypatch.setenv(name, value)
    info = launch.detect(dict(os.environ))
    assert info.launcher == "horovodrun"
    with pytest.raises(RuntimeError, match=r"in elastic mode .* which ringcomm does not support"):
        registry.join_mpi_over_horovodrun(info, 5.0)


SERVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer()
    print(server.start(), flush=True)
    server.init([])
    sys.stdin.read()  # until the test closes it
    server.stop()
""")


@needs_horovodrun
def test_store_speaks_horovodrun_rendezvous_protocol():
    """RendezvousStore against Horovod's own rendezvous server: keys with "/" (mpi_join's),
    values as bytes, a key not yet there, waits that end and that time out."""
    import datetime

    server = subprocess.Popen([sys.executable, "-c", SERVER, str(SOURCE)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        store = RendezvousStore("127.0.0.1", port)
        other = RendezvousStore("127.0.0.1", port, scope="global")
        with pytest.raises(KeyError):
            store.get("ringcomm-mpi-join/status/0")
        assert not store.check(["a/b"])
        store.set("ringcomm-mpi-join/status/0", '{"flag": "1"}')
        store.set("a/b", b"\x00\xff")
        assert store.get("ringcomm-mpi-join/status/0") == b'{"flag": "1"}'
        assert store.get("a/b") == b"\x00\xff"
        with pytest.raises(KeyError):
            other.get("a/b")  # scopes apart
        store.wait(["a/b", "ringcomm-mpi-join/status/0"], datetime.timedelta(seconds=120))
        with pytest.raises(TimeoutError, match=r"timeout after 0.2 s waiting for late"):
            store.wait(["a/b", "late"], datetime.timedelta(seconds=0.2))
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)
    with pytest.raises(ConnectionError, match=f"rendezvous server at 127.0.0.1:{port}"):
        store.get("a/b")  # the server is gone


def test_horovod_variables_without_its_server_raise_naming_them(subprocess_env):
    """HOROVOD_RANK and HOROVOD_SIZE without horovodrun's rendezvous (set by hand, or left
    from another job): an error naming what is missing, not a job of one."""
    env = {**subprocess_env, "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}
    proc = run_bounded([sys.executable, "-c", "import ringcomm; ringcomm.init()"],
                       timeout=60, env=env)
    assert proc.returncode != 0
    assert ("RuntimeError: HOROVOD_SIZE=2 (horovodrun) but MPI.COMM_WORLD has 1 process: "
            "horovodrun's variables are set but not the address of its rendezvous server"
            in proc.stderr), proc.stderr[-2000:]



def test_horovodrun_variables_left_in_an_mpiexec_job_are_named(subprocess_env, mpiexec,
                                                              tmp_path):
    """horovodrun's variables, its rendezvous server's address included, left in the
    environment of an mpiexec job: every rank fails at once on the server that is gone, and
    the error says the process is an MPI launcher's too and which variables to unset (it
    named the server alone)."""
    # Each rank writes its result to a file of its own: printed at the same moment, the two
    # lines could reach mpiexec's output as one.
    code = ("import os, sys, ringcomm\n"
            "try:\n"
            "    ringcomm.init(abort_on_exception=False)\n"
            "    out = 'RESULT joined'\n"
            "except ConnectionError as err:\n"
            "    out = f'RESULT {err}'\n"
            "with open(f\"{sys.argv[1]}.{os.environ['PMI_RANK']}\", 'w') as f:\n"
            "    f.write(out)\n")
    env = {**subprocess_env, "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2",
           "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
           "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": str(free_port()), "RINGCOMM_TIMEOUT": "30"}
    out = tmp_path / "result"
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, "-c", code, str(out)], timeout=90,
                       env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [Path(f"{out}.{rank}").read_text() for rank in range(2)]
    for rank in (0, 1):
        assert any(f"MPI launcher's variables (PMI_RANK={rank}, PMI_SIZE=2)" in line
                   for line in results), results
    for line in results:
        assert "rendezvous server at 127.0.0.1:" in line, line
        assert "unset them before mpiexec" in line, line

CHILD = textwrap.dedent(r"""
    import subprocess, sys
    import numpy as np
    import ringcomm

    comm = ringcomm.init()
    child = subprocess.run([sys.executable, "-c", "import ringcomm; ringcomm.init()"],
                           capture_output=True, text=True, timeout=60)
    last = (child.stderr.strip().splitlines() or ["-"])[-1]
    print(f"CHILD {child.returncode} {last}", flush=True)
    total = comm.allreduce(np.full(3, comm.rank + 1.0, dtype=np.float32))
    print(f"AFTER {total.tolist()}", flush=True)
""")


@needs_horovodrun
def test_a_process_started_by_a_rank_is_not_one_of_the_job(env, tmp_path):
    """A rank runs a script of its own (``subprocess.run``), which inherits horovodrun's
    variables and calls ringcomm.init(): it fails at once, saying so, and the job goes on.
    (It joined as that rank a second time: the child of rank 1 ended the whole job, the child
    of rank 0 hung in MPI's start-up and kept horovodrun from ending.)"""
    script = tmp_path / "job.py"
    script.write_text(CHILD)
    proc = horovodrun(2, [sys.executable, str(script)], env, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    children, after = outputs(proc.stdout, "CHILD "), outputs(proc.stdout, "AFTER ")
    assert sorted(children) == [0, 1] and sorted(after) == [0, 1], proc.stdout[-3000:]
    for rank, line in children.items():
        assert line.startswith("1 RuntimeError: HOROVOD_SIZE=2 (horovodrun), inherited from "
                               "process "), line
        assert f"which already joined the job as rank {rank}" in line
    assert set(after.values()) == {"[3.0, 3.0, 3.0]"}


@needs_horovodrun
def test_init_process_group_under_horovodrun(env, tmp_path):
    """``dist.init_process_group("ringcomm")`` (torch's env:// rendezvous, which reads RANK)
    under horovodrun: the processes form one MPI world first, as ringcomm.init() makes them."""
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import ringcomm.torch  # noqa: F401
        dist.init_process_group("ringcomm")
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        print(f"DIST {dist.get_rank()} {dist.get_world_size()} {t.tolist()}", flush=True)
        dist.destroy_process_group()
    """))
    proc = horovodrun(2, [sys.executable, str(script)], env, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = outputs(proc.stdout, "DIST ")
    assert said == {0: "0 2 [3.0, 3.0, 3.0]", 1: "1 2 [3.0, 3.0, 3.0]"}, proc.stdout[-3000:]
