"""Contiguous stand-ins for the views a collective hands to gloo (the "ringcomm" backend's
fallback): gloo reads and writes a tensor's memory as if it were contiguous (torch 2.13: a
scatter from ``x[::2]`` sends ``x[:n]``, a reduce into ``base[::2]`` writes ``base[:n]``, a
gather of such a view gives zeros), without a word. A view that is not contiguous, or a
conjugate or negative one, travels as a contiguous copy of its values, and an output's copy is
written back through the view once gloo is done with it."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ringcomm.torch._tensors import resolved

__all__ = ["Views", "WrittenBack"]


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """What gloo may take for ``t``: ``t`` itself where it is sparse (gloo's own) or
    contiguous and no conjugate or negative view, else a contiguous copy of its values."""
    return t if t.layout != torch.strided else resolved(t).contiguous()


class Views:
    """The stand-ins of one call's tensors: ``read`` for its inputs, ``write`` for its outputs
    (their values copied too: a reduce reads its output), then ``work`` for what gloo returned.
    """

    __slots__ = ("_back",)

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """An input as gloo may take it."""
        return _stand_in(t)

    def reads(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.read(t) for t in ts]

    def write(self, t: torch.Tensor) -> torch.Tensor:
        """An output as gloo may take it: where that is a copy, written back into it by the
        work."""
        copy = _stand_in(t)
        if copy is not t:
            self._back.append((t, copy))
        return copy

    def writes(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.write(t) for t in ts]

    def work(self, work: Any, result: Any) -> Any:
        """``work`` itself where every output went as it is, else one that writes the copies
        back once gloo is done, before it counts as done; its ``result()`` is ``result``."""
        return work if not self._back else WrittenBack(work, self._back, result)


class WrittenBack(dist._Work):
    """A gloo work whose outputs' copies are written back into them once it is done: by
    ``wait()``, by ``is_completed()`` where it says done, and before its future completes
    (gloo's reduce, gather and scatter works have none, as on gloo)."""

    def __init__(self, work: Any, back: list[tuple[torch.Tensor, torch.Tensor]],
                 result: Any) -> None:
        super().__init__()
        self._work, self._result = work, result
        self._lock = threading.Lock()
        self._back: list[tuple[torch.Tensor, torch.Tensor]] | None = back

    def _copy_back(self) -> None:
        with self._lock:  # once, whichever thread sees the work done first
            back, self._back = self._back, None
            if back:
                with torch.no_grad():
                    for view, copy in back:
                        view.copy_(copy)

    def _written(self, gloo: Future[Any]) -> Any:
        gloo.value()  # gloo's error, if any, fails this future too
        self._copy_back()
        return self._result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._work.wait()  # gloo's error, raised here
        self._copy_back()
        return True

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> Future[Any]:
        return self._work.get_future().then(self._written)

    def is_completed(self) -> bool:
        done = bool(self._work.is_completed())
        if done and self._work.is_success():
            self._copy_back()
        return done

    def is_success(self) -> bool:
        return bool(self._work.is_success())
