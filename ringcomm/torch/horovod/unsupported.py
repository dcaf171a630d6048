"""Horovod features ringcomm.torch does not provide: each raises NotImplementedError saying why.

Every refusal is also logged at DEBUG on ``ringcomm.torch.unsupported``, so that a test
suite can tell a test that passed because an unsupported call raised (NotImplementedError is a
RuntimeError, which Horovod's error tests expect) from one that passed on its merits.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ringcomm.core.log import get_logger

__all__ = ["ELASTIC_REASON", "ElasticUnsupportedError", "elastic_refusal", "refusal"]

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



class ElasticUnsupportedError(NotImplementedError, AttributeError):
    """Elastic training is not supported. A NotImplementedError, as Horovod's refusals are,
    and an AttributeError, so that ``hasattr(hvd.elastic, "run")`` is False: code that
    detects elastic support falls back to a fixed set of ranks."""


ELASTIC_REASON = ("elastic training is not supported: ringcomm jobs have a fixed set of ranks; "
                  "run without elastic (hvd.elastic.run, State and ElasticSampler have no "
                  "ringcomm counterpart) and restart a job that lost a rank from a checkpoint, "
                  "with hvd.broadcast_parameters and hvd.broadcast_optimizer_state after loading")


def elastic_refusal(name: str) -> ElasticUnsupportedError:
    """The error of ``elastic.<name>`` (logged at DEBUG, as every refusal)."""
    message = f"elastic.{name}: {ELASTIC_REASON}"
    _LOG.debug("not supported: %s", message)
    return ElasticUnsupportedError(message)
