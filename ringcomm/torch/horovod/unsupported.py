"""Horovod features ringcomm.torch does not provide: each raises NotImplementedError saying why.

Every refusal is also logged at DEBUG on ``ringcomm.torch.unsupported``, so that a test
suite can tell a test that passed because an unsupported call raised (NotImplementedError is a
RuntimeError, which Horovod's error tests expect) from one that passed on its merits.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ringcomm.core.log import get_logger

__all__ = ["elastic", "refusal"]

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



class _Elastic:
    """Stands in for ``hvd.elastic``: every attribute raises NotImplementedError."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):  # introspection (copy, pickle, inspect) must see no such name
            raise AttributeError(name)
        raise refusal(
            f"elastic.{name}: elastic training is not supported: ringcomm jobs have a fixed set "
            "of ranks (restart the job from a checkpoint instead)")


elastic = _Elastic()
