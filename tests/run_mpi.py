"""Run the multi-process tests under mpiexec, once per process count.

    python tests/run_mpi.py -n 2 -n 4 [-- extra pytest arguments]

For each count it runs ``mpiexec -n N python -m pytest tests/mpi`` with rank 0's pytest output on
the console and the other ranks' in ``logs/mpi-nN/rank<r>.log`` (tests/mpi/conftest.py agrees on
every outcome across ranks). When a job fails, the end of each other rank's log is shown. The
last line is one pytest-style summary over all counts; the exit status is non-zero when any job
failed, timed out, or collected nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+,? ?)+) in [\d.]+s\b")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def run_one(n: int, pytest_args: list[str], timeout: float) -> tuple[int, dict[str, int]]:
    logdir = ROOT / "logs" / f"mpi-n{n}"
    logdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RINGCOMM_TEST_LOGDIR=str(logdir), PYTHONUNBUFFERED="1")
    # Test paths among the arguments narrow the run; without any, the whole of tests/mpi runs.
    named = any(a.startswith("tests/") for a in pytest_args)
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "tests/mpi_pytest.py",
           *([] if named else ["tests/mpi"]), "-p", "no:cacheprovider", *pytest_args]
    print(f"$ {' '.join(cmd)}", flush=True)
    counts: dict[str, int] = {}
    # A session of its own, so that a timeout ends the ranks too, not only mpiexec (ranks
    # left waiting in a collective spin on and slow every later job).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # The output is read to its end below, so the timeout is a timer that ends the job.
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, expire)
    timer.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            m = _SUMMARY.match(line.strip())
            if m:
                counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(num)
                          for num, kind in _COUNT.findall(m.group(1))}
        rc = proc.wait()
    finally:
        timer.cancel()
    if fired.is_set():
        print(f"\nmpiexec -n {n} timed out after {timeout:.0f} s: its process group was killed",
              flush=True)
    if rc != 0:
        for log in sorted(logdir.glob("rank*.log")):
            tail = log.read_text(errors="replace").splitlines()[-40:]
            print(f"\n----- end of {log.relative_to(ROOT)} -----\n" + "\n".join(tail))
    return rc, counts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", dest="counts", type=int, action="append",
                   help="process count (repeatable); default 2 and 4")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec job")
    args = p.parse_args(argv)
    total: dict[str, int] = {}
    failed_jobs = []
    start = time.monotonic()
    for n in args.counts or [2, 4]:
        rc, counts = run_one(n, extra, args.timeout)
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
        if rc != 0 or not counts.get("passed"):
            failed_jobs.append(f"-n {n} (exit {rc})")
    parts = [f"{v} {k}" for k, v in total.items()] or ["no pytest summary (a job ended early)"]
    if failed_jobs:
        parts.append("failed jobs: " + ", ".join(failed_jobs))
    counts = ", ".join(f"-n {n}" for n in args.counts or [2, 4])
    line = f" {', '.join(parts)} in {time.monotonic() - start:.2f}s (mpiexec {counts}) "
    print(line.center(78, "="), flush=True)
    return 1 if failed_jobs else 0


if __name__ == "__main__":
    sys.exit(main())
