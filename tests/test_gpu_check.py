"""The GPU check (bench/gpu_check.py) where there is no GPU: its plan, its report, its steps.

A GPU machine runs the check itself (bench/GPU.md); here it runs with every GPU step skipped,
and with made-up steps that pass, fail, hang and skip, to show that the report is written and
well-formed, that one step's failure or timeout leaves the others running, and that a step's
processes are ended at its timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import gpu_check_report as report_mod  # noqa: E402

STEP_KEYS = {"name": str, "what": str, "command": str, "needs": list, "timeout_s": int,
             "status": str, "reason": str, "counts": dict, "failures": list, "skips": list,
             "tail": str}
TOP_KEYS = {"schema", "command", "started", "finished", "duration_s", "python", "source",
            "machine", "setup", "probe", "gpu", "mpi", "steps", "benchmark", "summary"}


def check_schema(report: dict[str, Any]) -> None:
    """The layout bench/GPU.md describes: every key, the types, the statuses, a summary that
    agrees with the steps."""
    assert report["schema"] == report_mod.SCHEMA
    assert TOP_KEYS <= set(report), TOP_KEYS - set(report)
    assert report["finished"] and report["duration_s"] >= 0
    assert isinstance(report["machine"]["gpus"], list) and report["machine"]["cpus"]
    assert {"python", "versions", "cupy", "nccl", "torch", "mpi", "stack", "kernels"} <= \
        set(report["probe"]), report["probe"]
    for step in report["steps"]:
        for key, kind in STEP_KEYS.items():
            assert isinstance(step[key], kind), (step["name"], key, step[key])
        assert step["status"] in report_mod.STATUSES and step["status"] != "pending"
        assert set(step["counts"]) <= set(report_mod.COUNT_KEYS), step["counts"]
        assert all(isinstance(n, int) and n >= 0 for n in step["counts"].values())
        if step["status"] in ("skipped", "failed", "timeout", "error"):
            assert step["reason"], step
    summ = report["summary"]
    names = [s["name"] for s in report["steps"]]
    assert sorted(summ["ran"] + summ["skipped"]) == sorted(names)
    assert summ["ok"] == (bool(summ["ran"]) and not summ["failed"])


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_lists_the_steps():
    done = run_script("--dry-run")
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines() if not line.startswith(" ")]
    assert names == list(gpu_check.DEFAULT_STEPS)
    assert "tests/run_mpi.py -n 4" in done.stdout and "bench/kernels_perf.py" in done.stdout
    done = run_script("--dry-run", "--steps", "unit-all,ddp-cuda")
    names = [line.split()[0] for line in done.stdout.splitlines() if not line.startswith(" ")]
    assert names == ["ddp-cuda", "unit-all"]  # in the plan's order


def test_unknown_step_is_refused():
    done = run_script("--dry-run", "--steps", "unit-gpu,benchmarks")
    assert done.returncode == 2
    assert "unknown step benchmarks; expected some of" in done.stderr


@pytest.mark.timeout(300)
def test_without_gpu_every_step_is_skipped_and_the_report_written(tmp_path):
    probe = gpu_check.run_probe(sys.executable, gpu_check.step_env({}), 120)
    if gpu_check.gpu_presence(probe, gpu_check.machine())[0]:
        pytest.skip("a GPU is visible here; this checks the report of a machine without one")
    done = run_script("--out", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr  # nothing ran
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    check_schema(report)
    assert [s["name"] for s in report["steps"]] == list(gpu_check.DEFAULT_STEPS)
    assert {s["status"] for s in report["steps"]} == {"skipped"}
    assert all(s["reason"].startswith("no GPU") for s in report["steps"])
    assert report["gpu"]["available"] is False and report["gpu"]["reason"]
    assert report["summary"]["ran"] == [] and report["summary"]["ok"] is False
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# ringcomm GPU check: nothing ran")
    for name in gpu_check.DEFAULT_STEPS:
        assert f"| {name} | skipped |" in md
    assert (tmp_path / "gpu_check.log").exists()


def _ends(pid: int, within: float = 20.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie awaiting its reaper) within seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


_SAMPLE = textwrap.dedent("""
    import pytest

    def test_ok():
        pass

    def test_wrong():
        assert 1 == 2

    @pytest.mark.skip(reason="not here")
    def test_later():
        pass
""")
_HANG = ("import subprocess, sys, time; "
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
         "print('CHILD', p.pid, flush=True); time.sleep(120)")


@pytest.mark.timeout(300)
def test_steps_that_fail_or_hang_leave_the_others_running(tmp_path, monkeypatch):
    """A failing step and a hanging one (whose child would outlive it) come first; the steps
    after them still run, the hung one's processes are ended, and the report says it all."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(_SAMPLE)
    steps = [
        gpu_check.Step("mixed", "pass, fail, skip", ("-m", "pytest", str(sample), "-q", "-p",
                                                     "no:cacheprovider", "-rfEs"), ("gpu",), 120),
        gpu_check.Step("hang", "sleeps past its timeout", ("-c", _HANG), ("gpu",), 3),
        gpu_check.Step("needs-mpi", "never runs here", ("-c", "pass"), ("gpu", "mpiexec"), 5),
        gpu_check.Step("fine", "passes", ("-c", "print('1 passed in 0.01s')"), ("gpu",), 60),
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda *args: steps)
    monkeypatch.setattr(gpu_check, "find_mpiexec", lambda python, env: None)
    out = tmp_path / "out"
    start = time.monotonic()
    rc = gpu_check.main(["--out", str(out), "--assume-gpu",
                         "--steps", "mixed,hang,needs-mpi,fine"])
    assert time.monotonic() - start < 120
    assert rc == 1
    report = json.loads((out / "gpu_check.json").read_text())
    check_schema(report)
    by = {s["name"]: s for s in report["steps"]}
    assert by["mixed"]["status"] == "failed"
    assert by["mixed"]["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert by["mixed"]["failures"][0].startswith("FAILED ") and "test_wrong" in \
        by["mixed"]["failures"][0]
    assert by["mixed"]["skips"] == [{"count": 1, "reason": "not here"}]
    assert by["hang"]["status"] == "timeout" and by["hang"]["returncode"] is None
    assert by["needs-mpi"]["status"] == "skipped" and "mpiexec" in by["needs-mpi"]["reason"]
    assert by["fine"]["status"] == "passed" and by["fine"]["counts"] == {"passed": 1}
    assert report["summary"]["failed"] == ["mixed", "hang"]
    assert report["summary"]["ran"] == ["mixed", "hang", "fine"]
    child = int(by["hang"]["tail"].split("CHILD", 1)[1].split()[0])
    assert _ends(child), "the hung step's child outlived it"  # the whole group was ended
    log = (out / "gpu_check.log").read_text()
    assert "===== mixed:" in log and "test_wrong" in log and "===== fine:" in log
    md = (out / "gpu_check.md").read_text()
    assert "| hang | timeout |" in md and "### mixed: failed" in md


def test_kernel_sources_are_read_from_the_source_tree():
    """The check runs ringcomm from this tree on PYTHONPATH, not installed: the kernel sources
    must be found that way too (an editable install's finder would hide the difference, so
    site-packages are put on PYTHONPATH and site's .pth files left unread: ``python -S``)."""
    paths = sysconfig.get_paths()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *dict.fromkeys([paths["purelib"], paths["platlib"]])]))
    code = ("from ringcomm.ops import _cuda_source as s\n"
            "print(len(s.SOURCES), all(len(s.read_source(n)) > 0 for n in s.SOURCES))")
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT / "bench", env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    count, read = done.stdout.split()
    assert int(count) == len(list((ROOT / "kernels").glob("*.cu"))) and read == "True"


@pytest.mark.parametrize(("text", "counts"), [
    ("..\n2 passed, 1 skipped in 1.20s\n", {"passed": 2, "skipped": 1}),
    ("=== 1 failed, 3 passed, 2 errors in 4.00s ===\n", {"failed": 1, "passed": 3, "error": 2}),
    ("rank 0: 3 passed in 1.0s\n" + "=" * 20 + " 6 passed, 4 skipped in 9.10s "
     "(mpiexec -n 2) " + "=" * 20 + "\n", {"passed": 6, "skipped": 4}),
    ("no tests ran in 0.01s\n", {}),
    ("Traceback (most recent call last):\nImportError: no\n", {}),
])
def test_pytest_counts(text, counts):
    assert report_mod.parse_pytest(text)[0] == counts


def test_checks_are_read():
    text = "\n".join([
        'CHECK {"name": "a", "status": "passed", "detail": "x"}',
        'noise CHECK {"name": "b"}',
        'CHECK {"name": "b", "status": "failed", "detail": "differs"}',
        'CHECK {"name": "c", "status": "skipped", "detail": "no NCCL"}',
        "CHECK {not json}",
    ])
    counts, failures, skips = report_mod.parse_checks(text)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1}
    assert failures == ["b: differs"] and skips == [{"count": 1, "reason": "c: no NCCL"}]


@pytest.mark.parametrize(("rc", "timed_out", "counts", "status"), [
    (0, False, {"passed": 3, "skipped": 1}, "passed"),
    (1, False, {"passed": 3, "failed": 1}, "failed"),
    (1, False, {"skipped": 5}, "skipped"),  # run_mpi.py exits 1 when nothing passed
    (0, False, {}, "failed"),
    (5, False, {"deselected": 9}, "failed"),
    (139, False, {"passed": 3}, "failed"),  # a crash after the tests
    (None, True, {"passed": 3}, "timeout"),
])
def test_step_status(rc, timed_out, counts, status):
    assert report_mod.step_status(rc, timed_out, counts, 60)[0] == status


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_checks_run_on_cpu_tensors():
    """bench/gpu_check_ddp.py's jobs, its comparisons and its report lines, on CPU tensors
    (its GPU run is the GPU check's ddp-cuda step): the hook matches DDP's allreduce."""
    pytest.importorskip("torch.distributed")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check_ddp.py"),
                           "--device", "cpu", "--sizes", "2", "--timeout", "240"], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    counts, failures, _ = report_mod.parse_checks(done.stdout)
    assert done.returncode == 0 and not failures, done.stdout + done.stderr
    assert counts == {"passed": 1 + len(__import__("gpu_check_ddp").CASES)}, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_benchmark_runs_on_cpu(tmp_path):
    """bench/gpu_train.py (the GPU check's train-bench step) on CPU tensors: every variant
    trains, its parameters are identical on both ranks, and ringcomm's uncompressed hook, both
    ways, gives DDP default's parameters bit for bit."""
    pytest.importorskip("torch.distributed")
    out = tmp_path / "train.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--device",
                           "cpu", "--models", "mlp", "--batch", "8", "--steps", "3", "--warmup",
                           "1", "--timeout", "240", "--json", str(out), "--markdown",
                           str(tmp_path / "train.md"), "--profile", str(tmp_path / "p.txt"),
                           "--traces", str(tmp_path / "traces.zip")],
                          cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == list(__import__("gpu_train").VARIANTS)
    assert all(r["identical_on_ranks"] and r["finite"] for r in results.values()), results
    for r in results.values():  # each rank's time in forward, where DDP waits for the others
        assert len(r["forward_ms_by_rank"]) == 2 and min(r["forward_ms_by_rank"]) > 0, r
    assert "| forward, by rank |" in (tmp_path / "train.md").read_text()
    assert results["ringcomm"]["same_as_ddp"] is True
    assert results["ringcomm (piece by piece)"]["same_as_ddp"] is True
    assert results["ringcomm Int8"]["same_as_ddp"] is False  # compressed: the digest tells
    auto = results["ringcomm auto"]  # timed once its trial iterations ended, its choice told
    assert auto["settle_steps"] > 0, auto
    assert list(auto["auto"]) == ["every compressed bucket"], auto
    assert auto["auto"]["every compressed bucket"].split("(")[0] in (
        "none", "FP16", "BF16", "Int8", "TopK"), auto
    # what the trials measured: every candidate's slowest rank's median iteration
    assert list(auto["auto_trials"]["ms"]) == ["none", "BF16()", "Int8(block_size=256, "
                                              "stochastic=False, seed=0)"], auto
    assert min(auto["auto_trials"]["ms"].values()) > 0, auto
    assert auto["auto_trials"]["of"] == "slowest rank's", auto
    # The hook's communicator: torchrun's processes joined one MPI world where PyTorch sees
    # no GPU, else gloo (the table says which).
    import torch

    over = "gloo" if torch.cuda.is_available() else "mpi"
    assert results["ringcomm"]["communicator"] == over, results["ringcomm"]
    assert f"| ringcomm (over {over}) | " in (tmp_path / "train.md").read_text()
    assert "- ringcomm auto: timed after its trials ended" in (
        tmp_path / "train.md").read_text()
    assert "Its trials' iterations (slowest rank's median): none " in (
        tmp_path / "train.md").read_text()
    assert "## mlp, ringcomm Int8:" in (tmp_path / "p.txt").read_text()
    with zipfile.ZipFile(tmp_path / "traces.zip") as z:  # both ranks, DDP default and the hook
        assert sorted(z.namelist()) == [f"trace_mlp_{v}_rank{r}.json" for v in
                                        ("DDP_default", "ringcomm") for r in (0, 1)]
        assert json.loads(z.read("trace_mlp_ringcomm_rank1.json"))["traceEvents"]


_BENCH = {"device": {"name": "Some GPU"}, "elements": 1024, "iters": 5, "results": [
    {"kernel": "d2d copy f32 (ceiling)", "bytes": 8192, "us": 2.0, "gbps": 4.096,
     "of_copy": 1.0},
    {"kernel": "int8 quantize", "bytes": 5136, "us": 2.5, "gbps": 2.0544, "of_copy": 0.5},
    {"kernel": "topk exact k=11 [19 launches, 12 allocs, 0 waits]", "bytes": 132, "us": 4.5,
     "gbps": None, "of_copy": None},
    {"kernel": "  topk exact / rc::select_hist x6", "bytes": None, "us": 1.0, "gbps": None,
     "of_copy": None},
    {"kernel": "topk exact, candidates in one pass k=11 [17 launches, 10 allocs, 0 waits]",
     "bytes": 132, "us": 3.0, "gbps": None, "of_copy": None},
    {"kernel": "torch.topk k=11", "bytes": None, "us": 9.0, "gbps": None, "of_copy": None}]}


@pytest.mark.timeout(300)
def test_benchmark_results_reach_the_report(tmp_path, monkeypatch):
    """The benchmark step's JSON becomes the report's benchmark section and table; a benchmark
    that exits 0 without results is a failure."""
    def plan(bench_json: Path, *rest: Any) -> list[gpu_check.Step]:
        write = f"import json, sys; open(sys.argv[1], 'w').write(json.dumps({_BENCH!r}))"
        return [gpu_check.Step("bench", "writes results", ("-c", write, str(bench_json)),
                               ("gpu",), 60, "bench"),
                gpu_check.Step("mute", "writes nothing", ("-c", "pass"), ("gpu",), 60,
                               "bench")]

    monkeypatch.setattr(gpu_check, "plan", plan)
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--assume-gpu", "--steps", "bench"]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    check_schema(report)
    assert report["benchmark"] == _BENCH and report["steps"][0]["status"] == "passed"
    md = (out / "gpu_check.md").read_text()
    assert "## Kernel benchmark" in md and "Some GPU, 1024 float32 elements" in md
    assert "| int8 quantize | 5136 | 2.5 | 2.1 | 50% |" in md
    assert "| torch.topk k=11 | - | 9.0 | - | - |" in md
    # Each variant beside its default: 4.5 / 3.0 us, and torch.topk's 9.0 us over each.
    assert ("| topk exact k=11 | candidates in one pass | 4.5 | 3.0 | 1.50 | 2.00x | 3.00x |"
            in md)
    assert gpu_check.main(["--out", str(out), "--assume-gpu", "--steps", "mute"]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["steps"][0]["status"] == "failed"
    assert report["steps"][0]["reason"] == "the benchmark wrote no results"
