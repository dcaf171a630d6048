"""Horovod's PyTorch examples, changed only in their import line, train under mpiexec -n 2 and
under horovodrun -np 2 (Horovod's own launcher, without MPI).

The examples are read from ``$HOROVOD_SOURCE`` (tests/upstream/run_horovod_examples.py);
without it these tests are skipped.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent / "upstream" / "run_horovod_examples.py"
_SPEC = importlib.util.spec_from_file_location("run_horovod_examples", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
runner = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = runner
_SPEC.loader.exec_module(runner)

SOURCE = runner.find_source()
TIMEOUT = 180.0


def test_switch_import_changes_exactly_one_line():
    text = "import os\nimport horovod\nimport horovod.torch as hvd\nhvd.init()\n"
    assert runner.switch_import(text) == text.replace("horovod.torch as", "ringcomm.torch as")
    for bad in ("import horovod\n", "import horovod.torch as hvd\n" * 2):
        with pytest.raises(ValueError, match="expected 1 line"):
            runner.switch_import(bad)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.skipif(SOURCE is None, reason="Horovod's examples need HOROVOD_SOURCE=<a checkout "
                    "of github.com/horovod/horovod> with examples/pytorch/")
@pytest.mark.parametrize("launcher", ["mpiexec", "horovodrun"])
@pytest.mark.parametrize("example", runner.EXAMPLES, ids=lambda e: e.name)
def test_horovod_example_trains(example, launcher):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    launch = runner.launcher_command(launcher, 2)
    if launch is None:
        pytest.skip(f"{launcher} is not installed")
    result = runner.run_example(example, SOURCE, launch=launch, n=2, timeout=TIMEOUT,
                                tail=60)
    assert result["outcome"] == "passed", f"{result['reason']}\n{result['tail']}"
    # One line per progress pattern: a loss and the test accuracy, or img/sec per iteration
    # and in total.
    assert len(result["progress"]) == len(example.progress), result["tail"]
