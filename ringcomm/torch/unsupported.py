"""Horovod features ringcomm.torch does not provide: each raises NotImplementedError saying why.

Every refusal is also logged at DEBUG on ``ringcomm.torch.unsupported``, so that a test suite
can tell a test that passed because an unsupported call raised (NotImplementedError is a
RuntimeError, which Horovod's error tests expect) from one that passed on its merits.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ringcomm.comm.log import get_logger

__all__ = ["SyncBatchNorm", "alltoall", "alltoall_async",
           "elastic", "reducescatter", "reducescatter_async", "refusal",
           "start_timeline", "stop_timeline"]

_LOG = get_logger("torch.unsupported")


def refusal(message: str) -> NotImplementedError:
    """The NotImplementedError of an unsupported feature (logged at DEBUG); raise it."""
    _LOG.debug("not supported: %s", message)
    return NotImplementedError(message)



def _unsupported(name: str, reason: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise refusal(f"{name}: {reason}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not supported: {reason}."
    return refuse


alltoall = _unsupported("alltoall", "ringcomm has no all-to-all collective")
alltoall_async = _unsupported("alltoall_async", "ringcomm has no all-to-all collective")
reducescatter = _unsupported("reducescatter",
                             "use the communicator's reduce_scatter on flat arrays")
reducescatter_async = _unsupported("reducescatter_async",
                                   "use the communicator's reduce_scatter on flat arrays")
SyncBatchNorm = _unsupported("SyncBatchNorm", "use torch.nn.SyncBatchNorm with DDP")
start_timeline = _unsupported("start_timeline", "ringcomm has no timeline; use comm.stats")
stop_timeline = _unsupported("stop_timeline", "ringcomm has no timeline; use comm.stats")


class _Elastic:
    """Stands in for ``hvd.elastic``: every attribute raises NotImplementedError."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):  # introspection (copy, pickle, inspect) must see no such name
            raise AttributeError(name)
        raise refusal(
            f"elastic.{name}: elastic training is not supported: ringcomm jobs have a fixed set "
            "of ranks (restart the job from a checkpoint instead)")


elastic = _Elastic()
