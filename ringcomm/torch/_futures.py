"""Futures that C++ (DDP's reducer) sees fail.

``torch.futures.Future.set_exception`` marks a future failed for Python alone: it stores the
exception as the future's *value* and makes Python's ``wait()``/``value()`` raise it. C++
code that waits on such a future (DDP's reducer, for a comm hook's future or a process
group's work) finds it done and reads the exception object as its tensors: the error is
lost, in a segmentation fault (a work's future) or in "Unable to cast ... to Tensor" (a
hook's). A future chained with ``then`` whose callback raises is failed for C++ as well, as
torch's own backends fail theirs; :func:`failing_for_cpp` makes that chain.
"""

from __future__ import annotations

from typing import Any

from torch.futures import Future

__all__ = ["failing_for_cpp"]


def _value(done: Future[Any]) -> Any:
    return done.value()  # raises the error set by set_exception


def failing_for_cpp(future: Future[Any]) -> Future[Any]:
    """A future completed with ``future``'s value, or failed (for C++ too) with its error."""
    return future.then(_value)
