"""Tensors handed to gloo, held until gloo's threads have let go of them.

A ProcessGroupGloo runs each collective on a thread of its own, which drops its reference to
the collective (and so to its tensors) a moment after the waiting caller has woken. Where
that is the last C++ reference but one to a tensor that has a Python object, dropping it takes
the GIL. If the interpreter is finalizing by then (the caller went on to the end of its
program while the thread was descheduled, which a loaded machine makes likely), the thread
is ended inside C++ code that cannot unwind, and the process aborts with ``terminate called
without an active exception`` after its work is done; torchrun then reports the job failed.

So every tensor ringcomm hands to gloo is recorded here (:func:`hold`) with the count of C++
references it had before, and at exit, while the interpreter is whole, :func:`let_go` waits
(the GIL released, so that gloo's threads can take it) until gloo holds none of them. A tensor
is forgotten as soon as its count is back where it was.

PyTorch's own collectives on a gloo group (DDP's, on a gloo process group that ringcomm's
``init_process_group_from_mpi`` made) leave their tensors to gloo's threads the same way, and
those ringcomm cannot hold: where ringcomm made or used a gloo group (:func:`pause_at_exit`),
or gloo's worker threads still run at exit (any gloo group of the process: ringcomm is loaded
into every torch process through its entry point), the exit also pauses briefly with the GIL
released, so that those threads can finish (a plain gloo DDP job under mpiexec aborted at exit
in 5 of 8 runs without the pause, none in 8 with 5 ms of it, none in 16 with the 20 ms kept).
"""

from __future__ import annotations

import atexit
import threading
import time
from pathlib import Path
from typing import Any

from ringcomm.core.log import get_logger

__all__ = ["held", "hold", "let_go", "pause_at_exit"]

#: How long the wait at exit may last: gloo lets go within microseconds of a collective's
#: end once its thread runs; a tensor still held after this is held by the program itself (an
#: unfinished asynchronous work it keeps).
EXIT_WAIT_S = 5.0

#: The GIL-free pause at exit where gloo groups were made (see pause_at_exit).
EXIT_PAUSE_S = 0.02

_LOG = get_logger("gloo")
_LOCK = threading.Lock()
# id(tensor) -> (tensor, its C++ reference count before gloo had it)
_HELD: dict[int, tuple[Any, int]] = {}
_PAUSE = [False]


def _count(t: Any) -> int:
    """The number of C++ references to ``t``'s TensorImpl (its Python object owns one)."""
    counter = getattr(t, "_use_count", None)
    return 1 if counter is None else int(counter())


def _forget_released() -> None:
    for key in [k for k, (t, before) in _HELD.items() if _count(t) <= before]:
        del _HELD[key]


def hold(*tensors: Any) -> None:
    """Record ``tensors``, about to be handed to a gloo collective, until gloo lets go of them.

    Call it before the collective; forgets, on the way, the tensors gloo already let go of."""
    with _LOCK:
        _forget_released()
        for t in tensors:
            before = _count(t)
            seen = _HELD.get(id(t))
            _HELD[id(t)] = (t, before if seen is None else min(before, seen[1]))


def held() -> int:
    """How many recorded tensors gloo still holds."""
    with _LOCK:
        _forget_released()
        return len(_HELD)


def let_go(timeout: float = EXIT_WAIT_S) -> int:
    """Wait until gloo holds none of the recorded tensors, at most ``timeout`` seconds, the
    GIL released between looks; return how many it still holds."""
    deadline = time.monotonic() + timeout
    while True:
        left = held()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.001)


def _gloo_threads_alive() -> bool:
    """Whether a gloo process group's worker threads (named ``pt_gloo_runloop`` by PyTorch)
    still run in this process (Linux: /proc; elsewhere, False)."""
    try:
        return any(comm.read_text().startswith("pt_gloo")
                   for comm in Path("/proc/self/task").glob("*/comm"))
    except OSError:
        return False


def pause_at_exit() -> None:
    """Ask for a pause at exit, the GIL released, for gloo's threads to let go of tensors this
    module does not hold (PyTorch's own, of a gloo group ringcomm made or used). On Linux the
    threads themselves are found at exit; this covers systems without /proc."""
    _PAUSE[0] = True


@atexit.register
def _let_go_at_exit() -> None:
    # Registered before the handlers that destroy ringcomm's gloo groups and shut its process
    # groups down (their modules import this one first), so it runs after them.
    left = let_go()
    if left:
        _LOG.debug("%d tensors still held by gloo at exit", left)
    if _PAUSE[0] or _gloo_threads_alive():
        time.sleep(EXIT_PAUSE_S)
