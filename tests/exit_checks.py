"""How the tests judge a multi-process job's exit, where PyTorch's own gloo backend is the
baseline, and how they run one (``run_job``).

gloo's worker threads dropped PyTorch's tensors during the interpreter's finalization now and
then, and a process aborted at exit after its work (``terminate called without an active
exception``), before ringcomm's exit pause (ringcomm/backends/gloo_held.py). Should it happen
again in a job on PyTorch's gloo backend, it is reported as a warning, as the abort is
PyTorch's, and the caller checks the work; every other job must end with exit status 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
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


def run_job(cmd: list[str], *, timeout: float, **kwargs: object
            ) -> subprocess.CompletedProcess[str]:
    """Run a launcher (mpiexec, torchrun) to its end, its output captured as text; past
    ``timeout`` seconds its whole process group is killed and the result's return code is
    -9, its stderr saying so. (``subprocess.run``'s timeout kills the launcher alone: ranks
    waiting in a collective then live on, spinning, and slow every later test.)"""
    try:
        return run_bounded(cmd, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        err = expired.stderr or ""
        return subprocess.CompletedProcess(cmd, -9, out, f"{err}\n{cmd[:3]} timed out after "
                                                          f"{timeout} s: killed")


def run_bounded(cmd: list[str], *, timeout: float, **kwargs: object
                ) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``,
    except that a timeout kills the launcher's whole process group (its ranks too) before
    ``subprocess.TimeoutExpired`` is raised, with the output so far."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
