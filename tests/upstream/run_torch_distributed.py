"""Run PyTorch's own distributed tests on the "ringcomm" backend and say what each did.

    python tests/upstream/run_torch_distributed.py [-k EXPR] [--world-size 3]
        [--json FILE] [--md FILE] [--allow NAME ...]

The tests are ``DistributedTest._DistTestBase`` of the installed torch
(``torch.testing._internal.distributed.distributed_test``, unmodified), each spawning
``--world-size`` processes on "ringcomm" as PyTorch's test_distributed_spawn.py does on gloo
(tests/upstream/torch_distributed_suite.py). ``-k`` selects tests as pytest's ``-k`` does.

Each test is passed, skipped (with PyTorch's reason: a GPU, another backend, ...), failed
(with the first line of its error) or timed out. The exit status is 1 when any test failed
unless ``--allow`` names it (a failure understood and stated in the results).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "torch_distributed_suite.py"


def _first_line(text: str | None) -> str:
    """The line of an error report that says what went wrong."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "assert" in ln.lower() or "Exception" in ln) and \
                not ln.startswith("File "):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def outcomes(junit: Path) -> list[dict[str, str]]:
    """One row per test case of a JUnit XML report: name, outcome, and why."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        row = {"test": case.get("name", ""), "seconds": case.get("time", "0")}
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            text = (failure.get("message") or "") + "\n" + (failure.text or "")
            row["outcome"] = "timed out" if "Timeout" in text else "failed"
            row["why"] = _first_line(text)
        elif skipped is not None:
            row["outcome"] = "skipped"
            row["why"] = (skipped.get("message") or "").strip()[:300]
        else:
            row["outcome"] = "passed"
            row["why"] = ""
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, str]], meta: dict[str, object]) -> str:
    """The results as a Markdown page: the counts, every failure, the skips by reason."""
    counts = collections.Counter(row["outcome"] for row in rows)
    out = ["# PyTorch's distributed tests on the ringcomm backend\n",
           f"torch {meta['torch']}, {meta['world_size']} processes per test, "
           f"`-k {meta['k'] or '(all)'}`, {meta['seconds']:.0f} s, {meta['when']}; "
           f"run by `{meta['command']}`.\n",
           "| outcome | tests |", "| --- | ---: |"]
    out += [f"| {k} | {counts[k]} |" for k in ("passed", "failed", "timed out", "skipped")]
    bad = [row for row in rows if row["outcome"] in ("failed", "timed out")]
    if bad:
        out += ["", "## Failed", "", "| test | error |", "| --- | --- |"]
        out += [f"| {row['test']} | {row['why'].replace('|', '/')} |" for row in bad]
    reasons = collections.Counter(row["why"] for row in rows if row["outcome"] == "skipped")
    if reasons:
        out += ["", "## Skipped, by PyTorch's reason", "", "| reason | tests |", "| --- | ---: |"]
        out += [f"| {why.replace('|', '/')} | {n} |" for why, n in reasons.most_common()]
    passed = sorted(row["test"] for row in rows if row["outcome"] == "passed")
    out += ["", "## Passed", "", ", ".join(f"`{name}`" for name in passed) or "(none)", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="pytest -k expression selecting tests")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per test")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument("--md", type=Path, help="write the Markdown summary here")
    parser.add_argument("--allow", nargs="*", default=[],
                        help="tests whose failure is known and stated (exit status 0)")
    args = parser.parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        env = dict(os.environ, BACKEND="ringcomm", WORLD_SIZE=str(args.world_size),
                   TEMP_DIR=tmp, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--timeout={args.timeout}", f"--junitxml={junit}", str(SUITE)]
        if args.k:
            cmd += ["-k", args.k]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True)
        seconds = time.monotonic() - start
        if not junit.exists():
            sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            return 1
        rows = outcomes(junit)
    meta = {"torch": torch.__version__, "world_size": args.world_size, "k": args.k,
            "seconds": seconds, "when": time.strftime("%Y-%m-%d"),
            "command": "python tests/upstream/run_torch_distributed.py"
                       + (f" -k '{args.k}'" if args.k else "")}
    counts = collections.Counter(row["outcome"] for row in rows)
    print(f"PyTorch's distributed tests on ringcomm: {dict(counts)} in {seconds:.0f} s")
    for row in rows:
        if row["outcome"] in ("failed", "timed out"):
            print(f"  {row['outcome']}: {row['test']}: {row['why']}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "tests": rows}, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(rows, meta))
    unexpected = [row["test"] for row in rows if row["outcome"] in ("failed", "timed out")
                  and row["test"] not in args.allow]
    if not rows:
        print("no test ran")
        return 1
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
