"""pytest plugin for the upstream runner: what each rank saw of one test.

Writes ``<RINGCOMM_UPSTREAM_OUT>/rank<r>.json`` with the test's outcome, the skip or failure
reason, and every refusal ringcomm.torch logged (an unsupported feature's NotImplementedError)
while the test ran: a test that passes because such an error was expected has not passed.

One adaptation to the installed torch, reported with each result: Horovod's optimizer sweeps
(test_broadcast_state, test_broadcast_state_options, test_force_allreduce) take every
``torch.optim.Optimizer`` subclass but LBFGS and SparseAdam, and build each on a model with
1-D biases. torch.optim.Muon, added after Horovod's last release, takes 2-D parameters only and
raises in its own constructor; it is left out of ``Optimizer.__subclasses__()`` here.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

_REFUSALS: list[str] = []
_RESULT: dict[str, Any] = {"outcome": "not run", "reason": "", "refusals": _REFUSALS,
                           "hidden": []}
#: Optimizers newer than Horovod's tests that cannot run in its sweeps (see the docstring).
_TOO_NEW = ("Muon",)


def _hide_new_optimizers() -> None:
    try:
        import torch
    except ImportError:
        return
    base = torch.optim.Optimizer
    hidden = [c.__name__ for c in type.__subclasses__(base) if c.__name__ in _TOO_NEW]
    if not hidden:
        return
    _RESULT["hidden"] = hidden

    def subclasses() -> list[type]:
        return [c for c in type.__subclasses__(base) if c.__name__ not in _TOO_NEW]

    base.__subclasses__ = staticmethod(subclasses)  # type: ignore[method-assign]


class _Refusals(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _REFUSALS.append(record.getMessage())


def pytest_configure(config: pytest.Config) -> None:
    logger = logging.getLogger("ringcomm.torch.unsupported")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_Refusals())
    _hide_new_optimizers()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        if _RESULT["outcome"] in ("not run", "passed"):
            _RESULT["outcome"] = report.outcome
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                _RESULT["reason"] = str(report.longrepr[2])
            elif report.outcome == "failed":
                lines = report.longreprtext.strip().splitlines()
                errors = [line[1:].strip() for line in lines if line.startswith("E ")]
                _RESULT["reason"] = (errors[0] if errors else lines[-1])[:300]


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("RINGCOMM_UPSTREAM_OUT")
    if out:
        rank = next((os.environ[name] for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                                    "HOROVOD_RANK") if name in os.environ), "0")
        Path(out, f"rank{rank}.json").write_text(json.dumps(_RESULT))
