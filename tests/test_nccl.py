"""NCCL backend in one process: the library from the wheel, its errors, and init without a GPU.

These run on machines without a GPU (CI): loading NCCL, ncclGetVersion and ncclGetUniqueId need
none. Tests that assert the no-GPU behaviour skip where a GPU is visible.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from ports import free_port

import ringcomm
from ringcomm.backends import _nccl_lib, _nccl_setup, nccl
from ringcomm.ops import _cuda_stack

# What the messages of a missing CuPy, NCCL or GPU tell to install: the extra of this machine's
# CUDA major version.
HINT = re.escape(_cuda_stack.install_hint())


# The NCCL wheel of each CUDA major version; both install nvidia/nccl/lib/libnccl.so.2.
NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")


def nccl_wheel() -> tuple[str, str] | None:
    """The installed NCCL wheel and its version, or None; the first of NCCL_WHEELS found."""
    for dist in NCCL_WHEELS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@pytest.fixture(scope="module")
def wheel() -> tuple[str, str]:
    found = nccl_wheel()
    if found is None:
        pytest.skip(f"no NCCL wheel is installed (looked for {' and '.join(NCCL_WHEELS)}: "
                    "pip install 'ringcomm[cuda12]' or 'ringcomm[cuda13]')")
    return found


@pytest.fixture(scope="module")
def lib(wheel: tuple[str, str]) -> _nccl_lib.NCCLLibrary:
    return _nccl_lib.load()


@pytest.fixture(scope="module")
def gpu_count() -> int:
    cupy = pytest.importorskip("cupy")
    return _nccl_setup.device_count(cupy)[0]


@pytest.fixture
def no_gpu(gpu_count: int) -> None:
    if gpu_count:
        pytest.skip(f"a GPU is visible here ({gpu_count}); this checks the behaviour without one")


def test_library_loads_from_the_wheel(lib):
    assert lib.path.endswith("nvidia/nccl/lib/libnccl.so.2"), lib.path
    assert _nccl_lib.load() is lib  # loaded once per process


def test_version_matches_the_wheel(lib, wheel):
    assert lib.version >= _nccl_lib.MIN_VERSION
    dist, version = wheel
    assert version.startswith(lib.version_string), (dist, version, lib.version_string)


def test_the_wheels_library_comes_first(wheel):
    """Discovery puts the installed wheel's libnccl.so.2 before the loader's own search."""
    dist, _ = wheel
    files = importlib.metadata.files(dist) or []
    shipped = [str(f.locate()) for f in files if str(f).endswith("nccl/lib/libnccl.so.2")]
    assert shipped, f"{dist} lists no nvidia/nccl/lib/libnccl.so.2"
    paths = _nccl_lib.candidate_paths()
    assert paths[-1] == "libnccl.so.2"  # the loader's search comes last
    assert os.path.realpath(paths[0]) == os.path.realpath(shipped[0]), (paths, shipped)


@pytest.mark.parametrize("dists, expected", [
    ({"nvidia-nccl-cu12": "2.32.3"}, ("nvidia-nccl-cu12", "2.32.3")),
    ({"nvidia-nccl-cu13": "2.28.9"}, ("nvidia-nccl-cu13", "2.28.9")),
    ({}, None),
])
def test_either_nccl_wheel_is_accepted(monkeypatch, dists, expected):
    """A CUDA 13 machine has nvidia-nccl-cu13 only: the library tests run there too."""
    def version(dist: str) -> str:
        if dist not in dists:
            raise importlib.metadata.PackageNotFoundError(dist)
        return dists[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert nccl_wheel() == expected


@pytest.mark.parametrize(("code", "text"), [(23203, "2.32.3"), (21400, "2.14.0"),
                                            (2708, "2.7.8")])
def test_format_version(code, text):
    assert _nccl_lib.format_version(code) == text


def test_unique_id_without_gpu(lib):
    a, b = lib.unique_id(), lib.unique_id()
    assert isinstance(a, bytes) and len(a) == 128
    assert a != b


def test_error_text_carries_nccl_strings(lib):
    assert lib.error_text(4).startswith("NCCL error 4: invalid argument")
    with pytest.raises(_nccl_lib.NCCLError, match="ncclFoo failed: NCCL error 5: invalid usage") \
            as info:
        lib.check(5, "ncclFoo")
    assert isinstance(info.value, RuntimeError) and info.value.code == 5
    lib.check(0, "ncclFoo")  # success raises nothing


def test_failed_init_reports_last_error(lib, no_gpu):
    """Without a GPU ncclCommInitRank fails; the error names the call, the result and the
    reason NCCL recorded (ncclGetLastError)."""
    with pytest.raises(_nccl_lib.NCCLError, match=r"ncclCommInitRank \(rank 0 of 1\) failed: "
                                                  r"NCCL error \d+: .*; last error: \S"):
        lib.init_rank(1, lib.unique_id(), 0)


def test_init_rank_checks_the_id_length(lib):
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        lib.init_rank(1, b"abc", 0)


def test_split_is_bound_from_nccl_2_18(lib):
    """ncclCommSplit is bound where the library has it; NCCLTransport.split falls back to a
    fresh communicator per group (over the rendezvous) where it does not."""
    assert lib.can_split is (lib.version >= 21800)
    assert ("ncclCommSplit" in lib.fn) is lib.can_split


def test_dtype_codes():
    assert _nccl_lib.dtype_code("float32") == 7 and _nccl_lib.dtype_code("bfloat16") == 9
    with pytest.raises(TypeError, match="NCCL has no type for dtype complex64"):
        _nccl_lib.dtype_code("complex64")


def test_missing_library_names_what_to_install(monkeypatch):
    monkeypatch.setattr(_nccl_lib, "_loaded", [])
    monkeypatch.setattr(_nccl_lib, "candidate_paths", lambda: ["/nonexistent/libnccl.so.2"])
    with pytest.raises(RuntimeError,
                       match=r"could not load NCCL .*" + HINT):
        _nccl_lib.load()


def test_usable_is_false_without_gpu(no_gpu, monkeypatch):
    monkeypatch.setattr(nccl, "_usable", [])
    assert nccl.usable() is False
    assert ringcomm.nccl_available() is False


def test_without_the_cuda_driver_cupy_sees_no_device():
    """What the probes below rely on to skip CuPy: no libcuda, no device."""
    if _cuda_stack.driver_loads():
        pytest.skip("the CUDA driver loads here")
    cupy = pytest.importorskip("cupy")
    assert _nccl_setup.device_count(cupy)[0] == 0


def test_auto_without_the_cuda_driver_never_imports_cupy(mpiexec, subprocess_env):
    """A rank without a GPU chooses MPI without importing CuPy (with ml_dtypes, up to 1.5 s a
    process), alone and in a job of two."""
    if _cuda_stack.driver_loads():
        pytest.skip("the CUDA driver loads here")
    code = ("import sys, ringcomm\n"
            "from ringcomm.backends import nccl\n"
            "usable = nccl.usable()\n"
            "with ringcomm.init('auto', abort_on_exception=False) as comm:\n"
            "    sys.stdout.write(f'RESULT {comm.size} {comm.backend} {usable} '\n"
            "                     f'{\"cupy\" in sys.modules}\\n')\n")  # one write: whole
    for n in (1, 2):
        run = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-c", code],
                             env=subprocess_env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        lines = re.findall(r"RESULT \d+ \w+ \w+ \w+", run.stdout)
        assert lines == [f"RESULT {n} mpi False False"] * n, run.stdout + run.stderr


@pytest.mark.parametrize("world_size, refusal", [
    ("2", "RANK and WORLD_SIZE=2 (torchrun's variables) do not number the 2 processes of "
          "this MPI job: MPI ranks 0 to 1 have RANK [0, 0]."),
    ("4", "RANK and WORLD_SIZE=4 (torchrun's variables) do not give the 2 processes of this "
          "MPI job 2 distinct ranks below 4: MPI ranks 0 to 1 have RANK [0, 0]."),
    ("1", "RANK=0 and WORLD_SIZE=1 (torchrun's variables) describe a job of 1 process, but an "
          "MPI launcher started 2 processes in this one")])
def test_rendezvous_refuses_torchrun_variables_left_in_an_mpiexec_job(mpiexec, subprocess_env,
                                                                       tmp_path, world_size,
                                                                       refusal):
    """torchrun's RANK=0 and WORLD_SIZE=2 (or 4, or 1) left in the environment of mpiexec -n 2:
    the NCCL rendezvous (which needs no GPU) raises at once on both ranks, where both
    processes went to host torch.distributed's store as rank 0 (one failed to listen, the
    other waited its whole timeout, or with WORLD_SIZE=1 went on as a job of one)."""
    code = ("import os, sys\n"
            "from ringcomm.backends import _nccl_setup\n"
            "try:\n"
            "    _nccl_setup.connect(timeout=60)\n"
            "    out = 'connected'\n"
            "except RuntimeError as err:\n"
            "    out = f'error: {err}'\n"
            "with open(f\"{sys.argv[1]}.{os.environ['PMI_RANK']}\", 'w') as f:\n"
            "    f.write(out)\n")
    env = {**subprocess_env, "RANK": "0", "WORLD_SIZE": world_size, "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = tmp_path / "rank"
    run = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code, str(out)], env=env,
                         capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stdout + run.stderr
    texts = [(tmp_path / f"rank.{rank}").read_text() for rank in range(2)]
    assert texts[0] == texts[1], texts
    assert texts[0].startswith(f"error: {refusal}"), texts



@pytest.mark.parametrize("visible", ["", "-1"])
def test_usable_is_false_when_devices_are_hidden(monkeypatch, visible):
    monkeypatch.setattr(nccl, "_usable", [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert nccl.usable() is False


def test_usable_never_raises(monkeypatch):
    def broken() -> None:
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(nccl, "_usable", [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(_nccl_lib, "load", broken)
    assert nccl.usable() is False


def test_usable_everywhere_is_false_without_gpu(no_gpu):
    assert nccl.usable_everywhere() is False


def test_auto_picks_mpi_without_gpu(no_gpu, monkeypatch):
    monkeypatch.setattr(nccl, "_usable", [])
    with ringcomm.init("auto", abort_on_exception=False) as comm:
        assert comm.backend == "mpi"


def test_init_nccl_without_gpu_says_what_to_do(no_gpu):
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*" + HINT + r".*backend='mpi'"):
        ringcomm.init("nccl", abort_on_exception=False)


def test_missing_cupy_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes "import cupy" fail
    with pytest.raises(RuntimeError,
                       match=r"needs CuPy and NCCL: " + HINT):
        _nccl_setup.import_cupy()


# --------------------------------------------------------------------- startup checks, pure
def _ident(host: str, bus: str, uuid: str = "", device: int = 0) -> dict:
    return {"host": host, "bus": bus, "uuid": uuid, "device": device, "count": 1}


def test_distinct_devices_pass():
    _nccl_setup.check_distinct_devices([_ident("a", "0000:01:00.0", "u0"),
                                        _ident("a", "0000:02:00.0", "u1", 1),
                                        _ident("b", "0000:01:00.0", "u2")])
    # Without UUIDs the host and bus id tell GPUs apart.
    _nccl_setup.check_distinct_devices([_ident("a", "0000:01:00.0"),
                                        _ident("b", "0000:01:00.0")])


@pytest.mark.parametrize("uuid", ["same", ""])
def test_two_ranks_on_one_gpu_are_refused_clearly(uuid):
    idents = [_ident("a", "0000:01:00.0", uuid), _ident("b", "0000:02:00.0", uuid + "x"),
              _ident("a", "0000:01:00.0", uuid)]
    with pytest.raises(RuntimeError, match=r"ranks 0, 2 would share GPU 0000:01:00.0 .* on host "
                                           r"a; .*one GPU per rank.*backend='mpi'"):
        _nccl_setup.check_distinct_devices(idents)


class _FakeRendezvous:
    """Rendezvous of rank ``rank`` whose allgather returns what the other ranks would send."""

    kind, size, local_rank, local_size = "fake", 3, 0, 1

    def __init__(self, rank: int, others: list) -> None:
        self.rank, self._others = rank, others

    def allgather_object(self, obj):
        everyone = list(self._others)
        everyone.insert(self.rank, obj)
        return everyone


def test_startup_exchange_fails_on_every_rank():
    ok = (None, _ident("h", "b1"))
    bad = ("the NCCL backend needs a CUDA GPU", None)
    with pytest.raises(RuntimeError, match=r"^the NCCL backend needs a CUDA GPU$"):
        _nccl_setup.startup_exchange(_FakeRendezvous(1, [ok, ok]), *bad)
    with pytest.raises(RuntimeError, match="cannot start on rank 1: the NCCL backend needs"):
        _nccl_setup.startup_exchange(_FakeRendezvous(0, [bad, ok]), *ok)
    assert _nccl_setup.startup_exchange(_FakeRendezvous(2, [ok, ok]), *ok) == [ok[1]] * 3


# -------------------------------------------------------------------- torchrun rendezvous

def _torchrun_env(monkeypatch, rank: int, size: int, port: int) -> None:
    for key, value in {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": rank,
                       "LOCAL_WORLD_SIZE": size, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port}.items():
        monkeypatch.setenv(key, str(value))


def test_store_rendezvous_in_one_process(monkeypatch):
    pytest.importorskip("torch.distributed")
    _torchrun_env(monkeypatch, 0, 1, free_port())
    rdv = _nccl_setup.connect()
    assert (rdv.kind, rdv.rank, rdv.size, rdv.local_rank, rdv.local_size) == ("store", 0, 1, 0, 1)
    assert rdv.allgather_object({"a": 1}) == [{"a": 1}]
    assert rdv.allgather_object(2) == [2]  # a second call uses fresh keys
    assert rdv.bcast_bytes(b"id") == b"id"
    sub = rdv.split(3, 0)
    assert (sub.kind, sub.rank, sub.size, sub.local_rank, sub.local_size) == ("store", 0, 1, 0, 1)
    assert sub.allgather_object("x") == ["x"]
    assert rdv.allgather_object(3) == [3]  # the parent goes on after a split
    sub.close()
    rdv.close()


_SPLIT_CHILD = textwrap.dedent("""
    import json
    from ringcomm.backends import _nccl_setup

    rdv = _nccl_setup.connect()
    sub = rdv.split(rdv.rank % 2, -rdv.rank)
    seen = sub.allgather_object(rdv.rank)
    uid = sub.bcast_bytes(b"id%d" % rdv.rank if sub.rank == 0 else None, 0).decode()
    after = rdv.allgather_object(sub.rank)
    print("SPLIT", json.dumps([sub.rank, sub.size, sub.local_rank, sub.local_size, seen, uid,
                               after]))
    sub.close()
    rdv.close()
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_store_rendezvous_splits_like_mpi(subprocess_env):
    """Three torchrun-style processes split by rank parity with descending keys: each group
    orders its ranks by (key, rank), gets its own key space, and the parent goes on."""
    pytest.importorskip("torch.distributed")
    port, size = free_port(), 3
    procs = []
    for rank in range(size):
        env = dict(subprocess_env, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _SPLIT_CHILD], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    results = []
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
        results.append(json.loads(out.split("SPLIT ", 1)[1]))
    # Color 0 holds ranks 0 and 2 (keys 0 and -2, so rank 2 comes first); color 1 rank 1.
    assert results == [[1, 2, 1, 2, [2, 0], "id2", [1, 0, 0]],
                       [0, 1, 0, 1, [1], "id1", [1, 0, 0]],
                       [0, 2, 0, 2, [2, 0], "id2", [1, 0, 0]]]


_CHILD = textwrap.dedent("""
    import sys
    import ringcomm
    try:
        ringcomm.init("nccl", abort_on_exception=False)
    except RuntimeError as err:
        print("ERROR:", err)
        sys.exit(3)
    print("STARTED")
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_ranks_without_gpu_fail_together(no_gpu, subprocess_env):
    """Under torchrun (no MPI), both ranks meet in the store and raise the clear error."""
    pytest.importorskip("torch.distributed")
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(subprocess_env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 3, out
        assert "needs a CUDA GPU" in out and _cuda_stack.install_hint() in out, out
        assert "mpi4py" not in out


# ------------------------------------------------------------ call plumbing, recorded, no GPU
def _recording_comm(lib, rank: int, size: int, fail: str = "") -> tuple[object, list]:
    """An NCCLComm whose NCCL functions record their calls instead of running."""
    calls: list = []

    def recorder(name):
        def call(*args):
            calls.append((name, *args[:4]) if name in ("ncclSend", "ncclRecv") else (name,))
            return 5 if name == fail else 0
        return call

    comm = _nccl_lib.NCCLComm(lib, None, rank, size)
    comm.fn = {name: recorder(name) for name in ("ncclSend", "ncclRecv", "ncclGroupStart",
                                                 "ncclGroupEnd")}
    return comm, calls


def test_gatherv_posts_every_part_at_its_offset(lib):
    u8 = _nccl_lib.UINT8
    comm, calls = _recording_comm(lib, 1, 3)
    comm.gatherv(1000, 5000, [4, 0, 8], stream=7)  # rank 1 sends nothing
    assert calls == [("ncclGroupStart",), ("ncclRecv", 5000, 4, u8, 0),
                     ("ncclRecv", 5004, 8, u8, 2), ("ncclGroupEnd",)]
    comm, calls = _recording_comm(lib, 0, 3)
    comm.gatherv(1000, 5000, [4, 0, 8], stream=7)
    assert calls == [("ncclGroupStart",), ("ncclSend", 1000, 4, u8, 1),
                     ("ncclRecv", 5004, 8, u8, 2), ("ncclSend", 1000, 4, u8, 2),
                     ("ncclGroupEnd",)]


def test_sendrecv_is_one_group_and_skips_a_missing_side(lib):
    u8 = _nccl_lib.UINT8
    comm, calls = _recording_comm(lib, 0, 2)
    comm.sendrecv((100, 8), 1, None, 1, stream=0)
    assert calls == [("ncclGroupStart",), ("ncclSend", 100, 8, u8, 1), ("ncclGroupEnd",)]


def test_a_failed_call_still_ends_the_group(lib):
    comm, calls = _recording_comm(lib, 0, 2, fail="ncclRecv")
    with pytest.raises(_nccl_lib.NCCLError, match="ncclRecv of 8 bytes from rank 1 failed: "
                                                  "NCCL error 5: invalid usage"):
        comm.sendrecv((100, 8), 1, (200, 8), 1, stream=0)
    assert calls[-1] == ("ncclGroupEnd",)
