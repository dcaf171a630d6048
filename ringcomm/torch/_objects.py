"""Picklable objects over a Communicator: broadcast and allgather of their pickled bytes."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from ringcomm.comm.base import Communicator

__all__ = ["allgather_objects", "broadcast_object"]

try:  # cloudpickle also carries lambdas and local classes, as Horovod's broadcast_object does
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle


def _pack(obj: Any) -> tuple[np.ndarray, int]:
    """Pickle ``obj`` into int64 words (the communicator moves supported dtypes only)."""
    data = _pickler.dumps(obj)
    words = np.zeros(-(-len(data) // 8), dtype=np.int64)
    words.view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return words, len(data)


def _unpack(words: np.ndarray, nbytes: int) -> Any:
    return pickle.loads(words.view(np.uint8)[:nbytes].tobytes())


def _unpacked_everywhere(comm: Communicator, what: str, unpack: Callable[[], Any]) -> Any:
    """``unpack()``'s value, once every rank has unpickled what it received (collective).

    Raises:
        ValueError: some rank could not (a class or module missing there, a CUDA tensor on a
            rank without a GPU), on every rank, naming the ranks and the first one's error:
            raised on that rank alone, the others went on to their next collective and
            waited there for it.
    """
    try:
        value, error = unpack(), ""
    except Exception as err:
        value, error = None, f"{type(err).__name__}: {err}"
    failed = comm.allgather(np.array([bool(error)], dtype=np.int64)).ravel().tolist()
    if not any(failed):
        return value
    errors = _gathered(comm, error)  # plain strings: they unpickle everywhere
    ranks = [r for r, bad in enumerate(failed) if bad]
    raise ValueError(f"{what}: rank{'s' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))} could not unpickle what it received: "
                     f"{errors[ranks[0]]}")


def broadcast_object(comm: Communicator, obj: Any, root: int) -> Any:
    """Return root's ``obj`` on every rank (pickled; two broadcasts: length, then bytes).

    Raises:
        ValueError: root could not pickle ``obj`` (on every rank).
    """
    words, header, error = None, np.zeros(1, dtype=np.int64), None
    if comm.rank == root:
        try:
            words, nbytes = _pack(obj)
            header[0] = nbytes
        except Exception as err:  # told to every rank below, so that none waits for bytes
            header[0], error = -1, err
    comm.broadcast(header, root)
    nbytes = int(header[0])
    if nbytes < 0:
        raise ValueError(f"broadcast_object: rank {root} could not pickle the object"
                         + (f": {error}" if error else "")) from error
    if words is None:
        words = np.empty(-(-nbytes // 8), dtype=np.int64)
    comm.broadcast(words, root)
    if comm.rank == root:
        return _unpacked_everywhere(comm, "broadcast_object", lambda: obj)
    return _unpacked_everywhere(comm, "broadcast_object", lambda: _unpack(words, nbytes))


def allgather_objects(comm: Communicator, obj: Any) -> list[Any]:
    """Return every rank's ``obj``, in rank order.

    Raises:
        ValueError: some rank could not pickle its object, or unpickle another's (on every
            rank).
    """
    return _unpacked_everywhere(comm, "allgather_object", _gathering(comm, obj))


def _gathering(comm: Communicator, obj: Any) -> Callable[[], list[Any]]:
    """Gather every rank's pickled ``obj`` (collective); what unpickles them, in rank order.

    Raises:
        ValueError: some rank could not pickle its object (on every rank).
    """
    try:
        words, nbytes = _pack(obj)
    except Exception:  # told to every rank below, so that none waits for bytes
        words, nbytes = np.zeros(0, dtype=np.int64), -1
    sizes = comm.allgather(np.array([nbytes], dtype=np.int64))
    failed = [r for r, n in enumerate(sizes.tolist()) if n < 0]
    if failed:
        raise ValueError(f"allgather_object: ranks {failed} could not pickle their objects")
    gathered = comm.allgatherv(words)

    def unpack() -> list[Any]:
        out, start = [], 0
        for n in sizes.tolist():
            count = -(-n // 8)
            out.append(_unpack(gathered[start: start + count], n))
            start += count
        return out

    return unpack


def _gathered(comm: Communicator, text: str) -> list[str]:
    """Every rank's ``text`` (collective; strings unpickle on every rank, unchecked)."""
    return _gathering(comm, text)()
