"""The examples run as a user runs them: under mpiexec, from the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from exit_checks import run_bounded

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script", "args"), [
    ("train_digits.py", ["--compression", "int8", "--epochs", "2"]),
    ("train_ddp.py", ["--compression", "int8", "--epochs", "1"]),
    ("train_hvd.py", ["--compression", "topk", "--epochs", "1"]),
])
def test_example_trains(mpiexec, subprocess_env, script, args):
    if script != "train_digits.py":
        pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    proc = run_bounded([mpiexec, "-n", "2", sys.executable, str(ROOT / "examples" / script),
                        *args], timeout=240, cwd=ROOT, env=subprocess_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch")]
    assert epochs and "test acc" in epochs[-1] and "KiB/step" in epochs[-1]
