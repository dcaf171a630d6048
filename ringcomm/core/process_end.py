"""Work that must run as this process ends, also where multiprocessing ends it.

multiprocessing ends the processes it starts by fork or forkserver (Python 3.14's default on
Linux; ``torch.multiprocessing.start_processes(..., start_method="fork")``; Lightning's
"ddp_fork" and "ddp_notebook" strategies) with ``os._exit`` once their target returns: no
``atexit`` handler runs there, and no library's own exit work either (mpi4py's
``MPI_Finalize``). Only multiprocessing's finalizers registered in that process run.
:func:`at_process_end` registers one there, so that a rank started that way ends as it would
after ``sys.exit``: its process groups shut down and MPI finalized, instead of leaving a job
whose launcher counts a rank gone before ``MPI_Finalize`` as failed.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import sys
from collections.abc import Callable

__all__ = ["at_process_end", "failed_status"]

_LOG = logging.getLogger("ringcomm.init")
_REGISTERED: set[tuple[int, Callable[[], None]]] = set()  # (pid, function): once a process
_FAILED: list[int] = []  # the exit status of this process's failed target, once seen


def at_process_end(function: Callable[[], None], order: int) -> None:
    """Run ``function`` (which must do nothing when there is nothing left to do) as this
    process ends, where multiprocessing started it; higher ``order`` runs first.

    Elsewhere the caller's ``atexit`` handler does the work, and this does nothing. In a
    process multiprocessing started by spawn, ``function`` runs as the process's target
    returns, before its ``atexit`` handlers (which then find nothing left). Registered once a
    process for each function, however often it is called.

    Where the target failed (an exception, or ``sys.exit`` with a status other than 0, as
    ``torch.multiprocessing`` turns an exception into ``sys.exit(1)``), ``function`` does not
    run: the other ranks may still wait for this one, and a shutdown or ``MPI_Finalize`` would
    wait for them in turn; :func:`failed_status` says so instead.
    """
    if multiprocessing.parent_process() is None:
        return
    key = (os.getpid(), function)
    if key in _REGISTERED:
        return
    _REGISTERED.add(key)
    multiprocessing.util.Finalize(None, _logged(function), exitpriority=order)


def failed_status() -> int | None:
    """The exit status of this process's target where multiprocessing saw it fail, else None
    (also before its end)."""
    return _FAILED[0] if _FAILED else None


def _failure_in_flight() -> int | None:
    """The exit status of the exception ending the target, else None: multiprocessing runs
    its finalizers in a ``finally`` around the target, where the exception is still in
    flight."""
    err = sys.exc_info()[1]
    if err is None:
        return None
    if isinstance(err, SystemExit):
        if err.code is None or err.code == 0:
            return None
        return err.code if isinstance(err.code, int) else 1
    return 1


def _logged(function: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        status = _failure_in_flight()
        if status is not None:
            if not _FAILED:
                _FAILED.append(status)
            _LOG.debug("%s skipped: the process's target failed", function.__qualname__)
            return
        try:
            function()
        except Exception as err:  # a peer already gone: the process ends all the same
            _LOG.debug("%s at the end of the process: %s", function.__qualname__, err)
    return run
