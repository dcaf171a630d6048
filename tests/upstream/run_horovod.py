"""Run Horovod's own PyTorch tests against ringcomm.torch, one mpiexec job per test.

    HOROVOD_SOURCE=/path/to/horovod python tests/upstream/run_horovod.py [-n 2] [-k TEXT]
        [--json FILE]

``HOROVOD_SOURCE`` is a checkout of github.com/horovod/horovod (its ``test/parallel/
test_torch.py`` and ``test/utils/common.py`` are used unmodified). ``import horovod.torch``
gives ``ringcomm.torch`` (tests/upstream/horovod_shim). Without ``HOROVOD_SOURCE`` the run is
skipped, saying so, with exit status 0.

Each test is classified: passed; passed on a refusal (it passed because an unsupported
feature raised NotImplementedError, a RuntimeError that the test expected: not a pass);
skipped (with the upstream reason: no GPU, ...); failed; timed out. The exit status is 1 when
any test failed or timed out, unless ``--allow`` names it.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TEST_FILE = Path("test/parallel/test_torch.py")


def test_names(path: Path) -> list[str]:
    """The test methods of the TestCase classes in ``path``, as pytest node ids' tails."""
    tree = ast.parse(path.read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names += [f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return names


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def _launch(launcher: str, n: int) -> list[str]:
    """What starts ``n`` processes under ``launcher``: mpiexec, or horovodrun without MPI
    (Horovod's own launcher, from its source release: tests/upstream/horovodrun.py), as
    Horovod's own CI runs this suite with its Gloo controller."""
    if launcher == "horovodrun":
        return [sys.executable, str(HERE / "horovodrun.py"), "-np", str(n)]
    return [_mpiexec(), "-n", str(n)]


def run_one(path: Path, name: str, n: int, timeout: float, launcher: str = "mpiexec"
            ) -> dict[str, object]:
    """Run one test under ``launcher`` with ``n`` processes; its outcome as every rank saw
    it."""
    with tempfile.TemporaryDirectory() as out:
        # A rank left waiting (its peer raised alone, or never calls) ends after a minute.
        env = dict(os.environ, RINGCOMM_UPSTREAM_OUT=out, PYTHONUNBUFFERED="1",
                   RINGCOMM_TIMEOUT=os.environ.get("RINGCOMM_TIMEOUT", "60"),
                   PYTHONPATH=os.pathsep.join([str(HERE / "horovod_shim"), str(HERE),
                                               str(ROOT), os.environ.get("PYTHONPATH", "")]))
        cmd = [*_launch(launcher, n), sys.executable, "-m", "pytest", "-q",
               "-p", "no:cacheprovider", "-p", "upstream_plugin", f"{path}::{name}"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, cwd=path.parent, capture_output=True,
                                  text=True, timeout=timeout)
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            return {"test": name, "outcome": "timeout", "reason": f"over {timeout:.0f} s",
                    "seconds": timeout}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    seconds = round(time.monotonic() - start, 1)
    if len(ranks) < n:
        last = tail.strip().splitlines()[-1][:300] if tail.strip() else "no output"
        return {"test": name, "outcome": "failed", "seconds": seconds,
                "reason": f"{len(ranks)} of {n} ranks reported (exit {proc.returncode}): {last}"}
    outcomes = {r["outcome"] for r in ranks}
    refusals = sorted({m for r in ranks for m in r["refusals"]})
    first = next((r for r in ranks if r["outcome"] != "passed"), ranks[0])
    if outcomes == {"passed"}:
        outcome = "passed on a refusal" if refusals else "passed"
        reason = refusals[0] if refusals else ""
    elif "failed" in outcomes:
        outcome, reason = "failed", next(r["reason"] for r in ranks if r["outcome"] == "failed")
    else:
        outcome, reason = first["outcome"], first["reason"]
    return {"test": name, "outcome": outcome, "reason": reason, "seconds": seconds,
            "refusals": refusals, "hidden": sorted({h for r in ranks for h in r.get("hidden", [])})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2, help="ranks per test (Horovod's suite: 2)")
    p.add_argument("-k", default="", help="run only tests whose name contains this")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--json", help="write every test's outcome here")
    p.add_argument("--allow", default="", help="comma list of tests allowed to fail")
    p.add_argument("--launcher", choices=("mpiexec", "horovodrun"), default="mpiexec",
                   help="horovodrun: Horovod's own launcher without MPI (python "
                        "tests/upstream/horovodrun.py --fetch first)")
    args = p.parse_args(argv)
    source = os.environ.get("HOROVOD_SOURCE")
    if not source or not (Path(source) / TEST_FILE).exists():
        print("skipped: Horovod's test suite needs HOROVOD_SOURCE=<a checkout of "
              f"github.com/horovod/horovod> (looked for {TEST_FILE} in {source!r})")
        return 0
    path = Path(source).resolve() / TEST_FILE
    names = [t for t in test_names(path) if args.k in t]
    results = []
    for i, name in enumerate(names, 1):
        result = run_one(path, name, args.n, args.timeout, args.launcher)
        results.append(result)
        print(f"[{i}/{len(names)}] {result['outcome']:<19} {name} ({result['seconds']} s)"
              + (f": {result['reason']}" if result["reason"] else ""), flush=True)
    counts = collections.Counter(str(r["outcome"]) for r in results)
    print("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    hidden = sorted({h for r in results for h in r.get("hidden", [])})
    if hidden:
        print(f"note: torch.optim.{', '.join(hidden)} left out of Optimizer.__subclasses__() "
              "(newer than Horovod's optimizer sweeps; see tests/upstream/upstream_plugin.py)")
    if args.json:
        Path(args.json).write_text(json.dumps({"source": str(path), "ranks": args.n,
                                               "launcher": args.launcher,
                                               "counts": counts, "tests": results}, indent=1))
    allowed = set(filter(None, args.allow.split(",")))
    bad = [r for r in results if r["outcome"] in ("failed", "timeout")
           and str(r["test"]).split("::")[-1] not in allowed]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
