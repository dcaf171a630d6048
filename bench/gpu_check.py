"""The GPU check: every GPU test, NCCL, DDP on CUDA tensors and the kernel benchmark, one report.

    python3 bench/gpu_check.py [--wheels DIR] [--out DIR] [--steps a,b] [--deadline SECONDS]
    python3 bench/gpu_check.py --dry-run            # the plan, nothing run

For a GPU machine without network: runs ringcomm from this source tree (PYTHONPATH, nothing
built) with the Python it is started with, and installs nothing from the network. Wheels carried
along (``--wheels DIR``: the ``mpich`` wheel, for the MPI steps, and ``mpi4py`` where the
machine has none or an old one) are installed with ``pip --no-index`` into a scratch prefix.
Each step has its own timeout, and a failing step does not stop the others; a step whose
requirement is missing (no GPU, no mpiexec, no MPI library) is reported as skipped with the
reason. The report (``gpu_check.json``, ``gpu_check.md``, and every step's output in
``gpu_check.log``) is rewritten after each step, under bench/results/gpu/ or ``--out``.
bench/GPU.md says what each step runs and how to read the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_probe import gpu_presence, machine, run_probe, source_tree  # noqa: E402
from gpu_check_report import (  # noqa: E402
    SCHEMA,
    parse_checks,
    parse_pytest,
    step_status,
    summary,
    write_report,
)

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu"
_PYTEST = ("-q", "-p", "no:cacheprovider", "-rfEs")
_KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL of a step's processes
_MARGIN = 15.0  # seconds a step's timeout keeps back for the report under --deadline


@dataclass(frozen=True)
class Step:
    """One step of the check: a command run with the check's interpreter."""

    name: str
    what: str
    argv: tuple[str, ...]  # after the interpreter
    needs: tuple[str, ...]  # of "gpu", "mpiexec", "mpi"
    timeout: float
    # How its output is read: "pytest", "checks", "bench" (the kernel benchmark, whose JSON
    # joins the report) or "tool" (its exit status alone).
    kind: str = "pytest"


def plan(bench_json: Path, mpiexec: str | None, bench_args: list[str],
         out: Path = DEFAULT_OUT, train_args: tuple[str, ...] = ()) -> list[Step]:
    """Every step, in the order they run; ``unit-all`` runs only when asked for.
    The training benchmark writes its tables to ``out`` (beside the report); ``train_args``
    are added to its command (later options override earlier ones)."""
    run_mpi = ("tests/run_mpi.py",)
    return [
        Step("unit-gpu", "every gpu-marked test in one process",
             ("-m", "pytest", "tests", *_PYTEST, "-m", "gpu"), ("gpu",), 600),
        Step("nccl-lib", "the NCCL library and communicator tests in one process",
             ("-m", "pytest", "tests/test_nccl.py", "tests/test_nccl_failure.py", *_PYTEST),
             ("gpu",), 300),
        Step("nccl-n1", "the NCCL backend's tests at one rank (mpiexec -n 1)",
             (*run_mpi, "-n", "1", "--", *_PYTEST, "tests/mpi/test_nccl_backend.py"),
             ("gpu", "mpiexec", "mpi"), 300),
        Step("mpi-gpu-n2", "every gpu-marked MPI test, 2 ranks sharing the GPU",
             (*run_mpi, "-n", "2", "--", *_PYTEST, "-m", "gpu"), ("gpu", "mpiexec", "mpi"), 600),
        Step("mpi-gpu-n4", "every gpu-marked MPI test, 4 ranks sharing the GPU",
             (*run_mpi, "-n", "4", "--", *_PYTEST, "-m", "gpu"), ("gpu", "mpiexec", "mpi"), 600),
        Step("ddp-cuda", "DDP with ringcomm_hook on CUDA tensors against DDP's own allreduce",
             ("bench/gpu_check_ddp.py", "--sizes", "1,2",
              "--timeout", "460", *(("--mpiexec", mpiexec) if mpiexec else ())), ("gpu",),
             480, "checks"),
        Step("kernels-bench", "kernel bandwidth against a device-to-device copy",
             ("bench/kernels_perf.py", "--json", str(bench_json), *bench_args), ("gpu",), 600,
             "bench"),
        Step("train-bench", "training step time: DDP default, PyTorch's hooks, ringcomm's "
             "(ResNet-18, ViT-S/16; 2 ranks under torchrun through ringcomm.torch.init())",
             ("bench/gpu_train.py", "--markdown", str(out / "gpu_train.md"),
              "--json", str(out / "gpu_train.json"), "--profile",
              str(out / "gpu_train_profile.txt"), "--traces", str(out / "gpu_train_traces.zip"),
              *train_args),
             ("gpu",), 420, "tool"),
        Step("unit-all", "the whole one-process suite (opt-in: --steps unit-all)",
             ("-m", "pytest", "tests", *_PYTEST), ("gpu",), 1800),
    ]


DEFAULT_STEPS = ("unit-gpu", "nccl-lib", "nccl-n1", "mpi-gpu-n2", "mpi-gpu-n4", "ddp-cuda",
                 "kernels-bench", "train-bench")


# ------------------------------------------------------------------------ carried wheels
def install_wheels(python: str, wheels: Path, prefix: Path) -> tuple[dict[str, Any], list[str]]:
    """Install every ``*.whl`` of ``wheels`` into ``prefix`` (pip --no-index --no-deps), one at
    a time, so that a wheel for another Python leaves the others installed.

    Returns:
        The environment additions that make them usable (PYTHONPATH, PATH, LD_LIBRARY_PATH:
        the mpich wheel's libmpi, which mpi4py looks up by name) with the names of the wheels
        installed, and the problems met.
    """
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return {}, [f"no *.whl in {wheels}"]
    installed, problems = [], []
    for wheel in found:
        cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
               "--no-warn-script-location", "--disable-pip-version-check", "--prefix",
               str(prefix), str(wheel)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            problems.append(f"{wheel.name} not installed: {err}")
            continue
        if done.returncode != 0:
            problems.append(f"{wheel.name} not installed: {done.stderr.strip()[-800:]}")
        else:
            installed.append(wheel.name)
    # lib/python3.X/site-packages usually; dist-packages, local/ or lib64/ where the
    # interpreter's install scheme says so
    sites = sorted({str(p) for name in ("site-packages", "dist-packages")
                    for p in prefix.rglob(name) if p.is_dir()})
    libs = sorted({str(p.parent) for p in prefix.rglob("libmpi*.so*")})
    extra = {"PYTHONPATH": sites, "LD_LIBRARY_PATH": libs,
             "PATH": [str(prefix / "bin")] if (prefix / "bin").is_dir() else [],
             "wheels": installed}
    return extra, problems


def step_env(extra: dict[str, Any]) -> dict[str, str]:
    """The environment of every step: this source tree first, carried wheels next, no
    launcher variables inherited (a check started under mpiexec must not make ranks of it)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_LOCAL"))}
    for var, first in (("PYTHONPATH", [str(ROOT), *extra.get("PYTHONPATH", [])]),
                       ("PATH", extra.get("PATH", [])),
                       ("LD_LIBRARY_PATH", extra.get("LD_LIBRARY_PATH", []))):
        rest = [p for p in env.get(var, "").split(os.pathsep) if p]
        if first or rest:
            env[var] = os.pathsep.join([*first, *rest])
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "240"  # pytest's FAILED lines whole, not cut at 80 columns
    return env


def find_mpiexec(python: str, env: dict[str, str]) -> str | None:
    """MPICH's mpiexec (Hydra): beside the interpreter, or from the carried mpich wheel."""
    here = Path(python).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec", path=env.get("PATH", ""))
    if found and Path(found).with_name("hydra_pmi_proxy").exists():
        return found
    return None


# ---------------------------------------------------------------------------- running
class Interrupted(Exception):
    """SIGTERM or SIGINT reached the check: the running step is stopped, the report written."""


def _on_signal(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def run_command(argv: list[str], env: dict[str, str], timeout: float,
                log: TextIO) -> tuple[int | None, str, bool]:
    """Run ``argv`` in its own process group, its output into ``log`` as it comes.

    Returns:
        (exit status, or None when stopped; the whole output; whether the timeout stopped it).
        The whole process group (mpiexec and its ranks, a job's workers) is ended on a timeout
        or an interruption.
    """
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        rc, timed_out = None, True
    finally:
        if proc.poll() is None:
            _end_group(proc)
    reader.join(timeout=30)
    return rc, "".join(lines), timed_out


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, _KILL_GRACE), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def skip_reason(step: Step, have: dict[str, str]) -> str:
    """Why ``step`` cannot run here ("" if it can): the first of its needs that is missing."""
    for need in step.needs:
        if have.get(need):
            return have[need]
    return ""


def run_step(step: Step, python: str, env: dict[str, str], timeout: float,
             log: TextIO) -> dict[str, Any]:
    """Run one step and read its outcome; never raises but for an interruption."""
    argv = [python, *step.argv]
    log.write(f"\n===== {step.name}: {shlex.join(argv)} (timeout {timeout:.0f} s)\n")
    log.flush()
    start = time.monotonic()
    try:
        rc, text, timed_out = run_command(argv, env, timeout, log)
    except OSError as err:
        return {"status": "error", "reason": f"could not start: {err}", "returncode": None,
                "duration_s": 0.0, "counts": {}, "failures": [], "skips": [], "tail": ""}
    duration = time.monotonic() - start
    if step.kind == "checks":
        counts, failures, skips = parse_checks(text)
    else:
        counts, failures, skips = parse_pytest(text)
    status, reason = step_status(rc, timed_out, counts, timeout)
    if step.kind in ("bench", "tool") and not timed_out:  # not tests: its exit status says it
        counts = {"passed": 1} if rc == 0 else {"failed": 1}
        status, reason = ("passed", "") if rc == 0 else ("failed", f"exit status {rc}")
    return {"status": status, "reason": reason, "returncode": rc,
            "duration_s": round(duration, 1), "counts": counts, "failures": failures,
            "skips": skips, "tail": text[-3000:]}


def read_bench(path: Path) -> dict[str, Any] | None:
    """The kernel benchmark's JSON output, or None when it wrote none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="directory of the report (default bench/results/gpu)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="directory of carried wheels (mpich, mpi4py) to install with --no-index")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter of the steps (default: the one running this script)")
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                   help="comma list of steps to run (default: all but unit-all)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole check; steps that no longer fit are skipped")
    p.add_argument("--timeout-scale", type=float, default=1.0,
                   help="multiply every step's timeout by this")
    p.add_argument("--bench-args", default="",
                   help='extra arguments of bench/kernels_perf.py, e.g. "-n 16M --iters 20"')
    p.add_argument("--train-args", default="",
                   help='extra arguments of bench/gpu_train.py, e.g. "--models resnet18 '
                        '--baseline .base"')
    p.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    p.add_argument("--assume-gpu", action="store_true",
                   help="run the GPU steps where no GPU is seen (to test this script)")
    args = p.parse_args(argv)
    known = {s.name for s in plan(Path(), None, [])}
    args.selected = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in args.selected if s not in known]
    if unknown:
        p.error(f"unknown step {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    return args


def _record(step: Step, python: str, timeout: float) -> dict[str, Any]:
    return {"name": step.name, "what": step.what, "command": shlex.join([python, *step.argv]),
            "needs": list(step.needs), "timeout_s": round(timeout), "status": "pending",
            "reason": "", "returncode": None, "duration_s": None, "counts": {},
            "failures": [], "skips": [], "tail": ""}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _requirements(probe: dict[str, Any], host: dict[str, Any], mpiexec: str | None,
                  assume_gpu: bool) -> tuple[dict[str, str], dict[str, Any]]:
    """What each need lacks here ("" when it is met), and the GPU and MPI findings."""
    gpu, gpu_why = gpu_presence(probe, host)
    mpi = probe.get("mpi", {})
    have = {"gpu": "" if gpu or assume_gpu else "no GPU (the machine section says why)",
            "mpiexec": "" if mpiexec else ("no MPICH mpiexec beside the interpreter or from "
                                           "carried wheels (carry the mpich wheel: --wheels)"),
            "mpi": "" if "library" in mpi else f"mpi4py cannot load MPI ({mpi.get('error')})"}
    return have, {"gpu": {"available": gpu, "reason": gpu_why},
                  "mpi": {"mpiexec": mpiexec, "library": mpi.get("library"),
                          "reason": have["mpiexec"] or have["mpi"]}}


def check(args: argparse.Namespace, report: dict[str, Any], log: TextIO, work: Path,
          t0: float) -> None:
    """Set up, probe, and run the selected steps (``t0``: when the check started, by
    time.monotonic), rewriting the report after each."""
    extra, problems = ({}, []) if args.wheels is None else \
        install_wheels(args.python, args.wheels, work / "prefix")
    report["setup"] = {"wheels": extra.get("wheels", []), "problems": problems}
    env = step_env(extra)
    report["probe"] = probe = run_probe(args.python, env, 180)
    log.write("===== probe\n" + json.dumps(probe, indent=2) + "\n")
    if "error" in probe.get("kernels", {}):
        report["setup"]["problems"].append(
            f"ringcomm's kernel sources cannot be read from this tree: {probe['kernels']['error']}")
    mpiexec = find_mpiexec(args.python, env)
    have, found = _requirements(probe, report["machine"], mpiexec, args.assume_gpu)
    report.update(found)
    bench_json = work / "kernels_perf.json"
    mpi_ok = not (have["mpiexec"] or have["mpi"])
    steps = [s for s in plan(bench_json, mpiexec if mpi_ok else None,
                             shlex.split(args.bench_args), args.out,
                             tuple(shlex.split(args.train_args)))
             if s.name in args.selected]
    scale = args.timeout_scale
    report["steps"] = [_record(s, args.python, s.timeout * scale) for s in steps]
    write_report(report, args.out)
    for step, rec in zip(steps, report["steps"], strict=True):
        left = float("inf") if args.deadline is None else \
            args.deadline - (time.monotonic() - t0) - _MARGIN
        reason = skip_reason(step, have)
        if reason:
            rec.update(status="skipped", reason=reason)
        elif left < 30:
            rec.update(status="skipped", reason="out of time (--deadline)")
        else:
            timeout = min(step.timeout * scale, left)
            rec["timeout_s"] = round(timeout)
            if have["mpi"] and step.argv[:3] == ("-m", "pytest", "tests"):
                # tests/mpi would not even import without an MPI library
                step = replace(step, argv=(*step.argv, "--ignore=tests/mpi"))
                rec["what"] += f" (tests/mpi left out: {have['mpi']})"
                rec["command"] = shlex.join([args.python, *step.argv])
            if step.argv[0] == "tests/run_mpi.py":  # its own limit first: it shows every log
                step = replace(step, argv=(step.argv[0], "--timeout", f"{timeout - 20:.0f}",
                                           *step.argv[1:]))
                rec["command"] = shlex.join([args.python, *step.argv])
            if step.name == "train-bench":  # its jobs share the step's time, less a margin
                step = replace(step, argv=(*step.argv, "--timeout", f"{timeout - 20:.0f}"))
                rec["command"] = shlex.join([args.python, *step.argv])
            print(f"[gpu-check] {step.name}: {step.what} ...", flush=True)
            try:
                rec.update(run_step(step, args.python, env, timeout, log))
            except Interrupted as why:
                rec.update(status="interrupted", reason=f"stopped by {why}")
                raise
            if step.kind == "bench":
                report["benchmark"] = read_bench(bench_json)
                if rec["status"] == "passed" and report["benchmark"] is None:
                    rec.update(status="failed", reason="the benchmark wrote no results")
        c = rec["counts"]
        print(f"[gpu-check] {step.name}: {rec['status']} {rec['reason']} "
              f"({c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
              f"{c.get('skipped', 0)} skipped) in {rec['duration_s'] or 0} s", flush=True)
        report["summary"] = summary(report["steps"])
        write_report(report, args.out)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when every step that ran passed, 1 when one did not, 2 when none ran."""
    args = parse_args(argv)
    if args.dry_run:
        for s in plan(Path("<tmp>/kernels_perf.json"), "<mpiexec>", shlex.split(args.bench_args),
                      args.out, tuple(shlex.split(args.train_args))):
            if s.name in args.selected:
                print(f"{s.name:<14} needs {'+'.join(s.needs):<16} timeout "
                      f"{s.timeout * args.timeout_scale:>5.0f} s  {s.what}\n"
                      f"{'':14} {shlex.join([args.python, *s.argv])}")
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    report: dict[str, Any] = {
        "schema": SCHEMA, "command": shlex.join([sys.executable, *sys.argv]),
        "started": _now(), "finished": None, "duration_s": None, "python": args.python,
        "source": source_tree(), "machine": machine(), "setup": {}, "probe": {},
        "gpu": {}, "mpi": {}, "steps": [], "benchmark": None, "summary": summary([])}
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with open(args.out / "gpu_check.log", "w") as log, \
                tempfile.TemporaryDirectory(prefix="ringcomm-gpu-check-") as tmp:
            check(args, report, log, Path(tmp), t0)
    except Interrupted as why:
        for rec in report["steps"]:
            if rec["status"] == "pending":
                rec.update(status="skipped", reason=f"not reached: the check was stopped ({why})")
    finally:
        report["finished"] = _now()
        report["duration_s"] = round(time.monotonic() - t0, 1)
        report["summary"] = summary(report["steps"])
        json_path, md_path = write_report(report, args.out)
    summ = report["summary"]
    print(f"[gpu-check] ran: {', '.join(summ['ran']) or 'nothing'}; failed: "
          f"{', '.join(summ['failed']) or 'none'}; skipped: {', '.join(summ['skipped']) or 'none'}"
          f"\n[gpu-check] report: {md_path} and {json_path}", flush=True)
    if summ["failed"]:
        return 1
    return 0 if summ["ran"] else 2


if __name__ == "__main__":
    sys.exit(main())
