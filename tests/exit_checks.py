"""How the tests judge a multi-process job's exit, where PyTorch's own gloo backend is the
baseline.

gloo's worker threads dropped PyTorch's tensors during the interpreter's finalization now and
then, and a process aborted at exit after its work (``terminate called without an active
exception``), before ringcomm's exit pause (ringcomm/backends/gloo_held.py). Should it happen
again in a job on PyTorch's gloo backend, it is reported as a warning, as the abort is
PyTorch's, and the caller checks the work; every other job must end with exit status 0.
"""

from __future__ import annotations

import warnings

#: What the C++ runtime prints when a process aborts that way.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def check_exit(returncode: int, output: str, what: str, *, gloo_baseline: bool = False) -> None:
    """Fail unless the job ended with exit status 0; for ``gloo_baseline`` (a job on PyTorch's
    gloo backend), a gloo abort at exit is a warning instead. ``output``: the job's stdout and
    stderr, whose end the failure shows."""
    if gloo_baseline and returncode != 0 and GLOO_EXIT_ABORT in output:
        warnings.warn(f"{what}: a process of PyTorch's gloo backend aborted at exit after its "
                      "work was done", stacklevel=3)
        return
    assert returncode == 0, f"{what}\n{output[-6000:]}"
