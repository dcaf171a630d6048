"""Run Horovod's PyTorch examples against ringcomm.torch, one job per example and launcher.

    HOROVOD_SOURCE=/path/to/horovod python tests/upstream/run_horovod_examples.py [-n 2]
        [-k TEXT] [--launchers mpiexec,horovodrun] [--timeout 120] [--tail 30] [--json FILE]

Each example runs under mpiexec and under Horovod's own horovodrun (without MPI, as where
Horovod was built without it: tests/upstream/horovodrun.py, from Horovod's source release,
which ``make`` unpacks; skipped, saying so, where it is absent).

``HOROVOD_SOURCE`` is a checkout of github.com/horovod/horovod. Its examples/pytorch/
pytorch_mnist.py and pytorch_synthetic_benchmark.py run as a user who switched to ringcomm runs
them: unmodified except the line ``import horovod.torch as hvd``, which becomes
``import ringcomm.torch as hvd`` in a temporary copy (one line for one line, so tracebacks give
the original's line numbers). Their other imports that need something not installed come from
tests/upstream/example_shim, first on the examples' PYTHONPATH only: a ``torchvision`` stand-in
(MNIST from scikit-learn's digits, the transforms they use, resnet18) and the top-level
``horovod`` that pytorch_mnist imports for ``horovod.run``. Without ``HOROVOD_SOURCE`` the run is
skipped, saying so, with exit status 0.

An example passes when mpiexec exits 0 within the time limit and the output shows progress
(pytorch_mnist: a training-loss line and the test accuracy; the benchmark: its img/sec lines).
The exit status is 1 when any example failed or timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SHIM = HERE / "example_shim"

_IMPORT = re.compile(r"^import horovod\.torch as hvd$", re.MULTILINE)
_SWITCHED = "import ringcomm.torch as hvd"
_LAUNCHER_VARS = ("PMI_", "OMPI_", "PMIX_", "MPI_LOCAL", "HYDRA_")
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*")


class Example(NamedTuple):
    """One example: its path in Horovod's source, its arguments, the lines that show progress,
    and a line that only rank 0 of a job of every process prints, once (``{n}``: the number
    of processes): where each process took itself for a job of one, every one prints it."""

    name: str
    path: str
    args: tuple[str, ...]
    progress: tuple[str, ...]
    once: str


# Arguments small enough for a minute on two CPU cores.
EXAMPLES = (
    Example("pytorch_mnist", "examples/pytorch/pytorch_mnist.py",
            ("--epochs", "1", "--batch-size", "32", "--no-cuda"),
            (r"Train Epoch: 1 \[\d+/\d+ \(\d+%\)\]\tLoss: \d+\.\d+$",
             r"Test set: Average loss: \d+\.\d+, Accuracy: \d+\.\d+%$"),
            r"Test set: Average loss"),
    Example("pytorch_synthetic_benchmark", "examples/pytorch/pytorch_synthetic_benchmark.py",
            ("--model", "resnet18", "--batch-size", "2", "--num-warmup-batches", "1",
             "--num-batches-per-iter", "1", "--num-iters", "2", "--no-cuda"),
            (r"Iter #1: \d+\.\d+ img/sec per CPU$",
             r"Total img/sec on \d+ CPU\(s\): \d+\.\d+ \+-\d+\.\d+$"),
            r"Total img/sec on {n} CPU\(s\)"),
)


def find_source() -> Path | None:
    """``$HOROVOD_SOURCE`` when it holds every example, else None."""
    source = os.environ.get("HOROVOD_SOURCE")
    if not source or not all((Path(source) / e.path).is_file() for e in EXAMPLES):
        return None
    return Path(source).resolve()


def switch_import(text: str, origin: str = "<example>") -> str:
    """Replace the one ``import horovod.torch as hvd`` line by ``import ringcomm.torch as hvd``.

    Raises:
        ValueError: when ``text`` has no such line, or more than one.
    """
    switched, count = _IMPORT.subn(_SWITCHED, text)
    if count != 1:
        raise ValueError(f"expected 1 line 'import horovod.torch as hvd' in {origin}, "
                         f"got {count}")
    return switched


def _env(workdir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    env.update(PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT), env.get("PYTHONPATH", "")]),
               # A rank left waiting on a peer that failed alone ends after a minute.
               RINGCOMM_TIMEOUT=env.get("RINGCOMM_TIMEOUT", "60"),
               # pytorch_mnist locks ~/.horovod_lock; keep that in the run's directory.
               HOME=workdir)
    return env


def _launch(cmd: list[str], workdir: str, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd``; its exit status (None past ``timeout``) and its output, both streams."""
    proc = subprocess.Popen(cmd, cwd=workdir, env=_env(workdir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        # mpiexec passes SIGTERM on to the ranks (each in a session of its own, out of reach).
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return None, out


def launcher_command(launcher: str, n: int) -> list[str] | None:
    """What starts ``n`` processes under ``launcher`` ("mpiexec" or "horovodrun"), followed by
    the program; None where that launcher is not installed."""
    if launcher == "mpiexec":
        mpiexec = Path(sys.executable).parent / "mpiexec"
        return [str(mpiexec), "-n", str(n)] if mpiexec.exists() else None
    if launcher == "horovodrun":
        sys.path.insert(0, str(HERE))
        from horovodrun import source_dir

        return ([sys.executable, str(HERE / "horovodrun.py"), "-np", str(n)]
                if source_dir() is not None else None)
    raise ValueError(f"unknown launcher {launcher!r}; expected mpiexec or horovodrun")


def run_example(example: Example, source: Path, *, launch: list[str], n: int,
                timeout: float = 120.0, tail: int = 30) -> dict[str, object]:
    """Run ``example`` from ``source`` under ``launch`` (``launcher_command``'s, for ``n``
    processes), switched to ringcomm.torch.

    Returns:
        ``{"example", "outcome": "passed" | "failed" | "timeout", "reason", "seconds",
        "progress": the lines that matched the example's progress patterns, "tail"}``.
    """
    original = source / example.path
    text = switch_import(original.read_text(), str(original))
    with tempfile.TemporaryDirectory(prefix=f"{example.name}-") as workdir:
        copy = Path(workdir, original.name)
        copy.write_text(text)
        cmd = [*launch, sys.executable, str(copy), *example.args]
        start = time.monotonic()
        status, out = _launch(cmd, workdir, timeout)
        seconds = round(time.monotonic() - start, 1)
    lines = out.splitlines()
    # Every rank prints, and two ranks' lines can land on one line of the merged output:
    # a progress line may start anywhere in a line.
    progress = [next((ln for ln in lines if re.search(p, ln)), "") for p in example.progress]
    missing = [p for p, ln in zip(example.progress, progress, strict=True) if not ln]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    once = len([ln for ln in lines if re.search(example.once.replace("{n}", str(n)), ln)])
    if status is None:
        outcome, reason = "timeout", f"over {timeout:.0f} s"
    elif status != 0:
        outcome = "failed"
        reason = f"exit {status}" + (f": {errors[-1][:300]}" if errors else "")
    elif missing:
        outcome, reason = "failed", f"exit 0 but no line matching {missing[0]!r}"
    elif once != 1:
        outcome, reason = "failed", (f"{once} lines matching {example.once!r} (n={n}), where "
                                     "rank 0 of the whole job prints one")
    else:
        outcome, reason = "passed", ""
    return {"example": example.name, "outcome": outcome, "reason": reason, "seconds": seconds,
            "progress": [ln for ln in progress if ln], "tail": "\n".join(lines[-tail:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2, help="ranks per example")
    p.add_argument("-k", default="", help="run only examples whose name contains this")
    p.add_argument("--launchers", default="mpiexec,horovodrun",
                   help="comma-separated: mpiexec, horovodrun")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per example")
    p.add_argument("--tail", type=int, default=30, help="lines of output shown per example")
    p.add_argument("--json", help="write every example's outcome here")
    args = p.parse_args(argv)
    source = find_source()
    if source is None:
        print("skipped: Horovod's examples need HOROVOD_SOURCE=<a checkout of "
              "github.com/horovod/horovod> (looked for "
              f"{', '.join(e.path for e in EXAMPLES)} in {os.environ.get('HOROVOD_SOURCE')!r})")
        return 0
    launches = {}
    for launcher in args.launchers.split(","):
        command = launcher_command(launcher, args.n)
        if command is None:
            print(f"skipped under {launcher}: not installed (mpiexec: ringcomm[mpi]; "
                  "horovodrun: python tests/upstream/horovodrun.py --fetch)")
        else:
            launches[launcher] = command
    runs = [(e, launcher) for launcher in launches for e in EXAMPLES if args.k in e.name]
    results = []
    for i, (example, launcher) in enumerate(runs, 1):
        result = run_example(example, source, launch=launches[launcher], n=args.n,
                             timeout=args.timeout, tail=args.tail)
        result["launcher"] = launcher
        results.append(result)
        print(f"[{i}/{len(runs)}] {result['outcome']:<7} {example.name} under {launcher} "
              f"({result['seconds']} s)" + (f": {result['reason']}" if result["reason"] else ""))
        print("    " + str(result["tail"]).replace("\n", "\n    "), flush=True)
    passed = sum(r["outcome"] == "passed" for r in results)
    print(f"summary: {passed} of {len(results)} passed")
    if args.json:
        Path(args.json).write_text(json.dumps({"source": str(source), "ranks": args.n,
                                               "examples": results}, indent=1))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
