"""Waits and exchanges on torch.distributed's key-value store bounded by ringcomm's timeout,
not the store's (the store of a group torch.distributed made waits that group's timeout)."""

from __future__ import annotations

import datetime
import time
from typing import Any

from ringcomm.core.types import CollectiveTimeoutError

__all__ = ["allgather", "missing_keys", "ranks_of", "wait_for"]


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


def wait_for(store: Any, keys: list[str], rank: int, size: int, timeout: float, what: str,
             peer: int | None = None) -> None:
    """Wait until ``store`` holds ``keys`` (those of ranks, ending in ``/<rank>``, or of
    ``peer``), at most ``timeout`` seconds.

    Raises:
        CollectiveTimeoutError: on rank ``rank`` of ``size``, naming the ranks whose keys are
            missing and ``what`` was waited for.
    """
    missing, elapsed = missing_keys(store, keys, timeout)
    if not missing:
        return
    ranks = ranks_of(missing) or ([peer] if peer is not None else [])
    waited = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" \
        if ranks else "the other ranks"
    raise CollectiveTimeoutError(
        f"ringcomm's start-up timed out on rank {rank} of {size} after {elapsed:.1f} s waiting "
        f"for {waited} in {what} over torch.distributed's store ({waited} did not come: "
        f"exited, stopped, or in another call). The timeout is {timeout:g} s "
        "(ringcomm.init's)", kind="start-up", peer=ranks[0] if len(ranks) == 1 else None,
        elapsed=elapsed, timeout=timeout)


def allgather(store: Any, tag: str, rank: int, size: int, value: bytes, timeout: float,
              what: str = "an exchange") -> list[bytes]:
    """Every rank's ``value``, in rank order: each of the ``size`` ranks sets its own under
    ``tag`` (a key space of this exchange alone: the same on every rank, used once) and reads
    the others'. Collective; bounded by ``timeout`` as :func:`wait_for`.

    Rank 0 returns once every rank has read every value: it may host the store's server (no
    torchrun agent's store), and must not leave before the others, on an error everyone is
    about to raise.
    """
    store.set(f"{tag}{rank}", value)
    keys = [f"{tag}{r}" for r in range(size)]
    wait_for(store, keys, rank, size, timeout, what)
    everyone = [bytes(store.get(key)) for key in keys]
    if store.add(f"{tag}read", 1) == size:
        store.set(f"{tag}all", b"1")
    if rank == 0:
        wait_for(store, [f"{tag}all"], rank, size, timeout, f"{what}'s end")
    return everyone
