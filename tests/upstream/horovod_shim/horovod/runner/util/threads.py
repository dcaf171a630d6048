"""``in_thread``, as Horovod's test utilities call it."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any


def in_thread(target: Callable[..., Any], args: tuple[Any, ...] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Run ``target(*args)`` on a new thread and return the thread; ``silent`` swallows what
    it raises (otherwise printed, as threads do)."""
    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                traceback.print_exc()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
