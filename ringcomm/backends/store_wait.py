"""Waits on torch.distributed's key-value store bounded by ringcomm's timeout, not the store's
(the store of a group torch.distributed made waits that group's timeout)."""

from __future__ import annotations

import datetime
import time
from typing import Any

__all__ = ["missing_keys", "ranks_of"]


def missing_keys(store: Any, keys: list[str], timeout: float) -> tuple[list[str], float]:
    """Wait until ``store`` holds every key of ``keys``, at most ``timeout`` seconds; return
    the keys still missing then (none: every one came) and the seconds waited. Errors of the
    store other than its timeout are raised."""
    start = time.monotonic()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        return [], time.monotonic() - start
    except Exception as err:  # torch's DistStoreError or RuntimeError, by version
        if "timeout" not in str(err).lower():
            raise
    return [key for key in keys if not store.check([key])], time.monotonic() - start


def ranks_of(keys: list[str]) -> list[int]:
    """The ranks that keys ending in ``/<rank>`` name (others name none)."""
    return [int(r) for r in (key.rsplit("/", 1)[-1] for key in keys) if r.isdigit()]
