"""``hvd.elastic``: Horovod's elastic training, which ringcomm does not provide.

ringcomm jobs have a fixed set of ranks, chosen by the launcher. Every name Horovod's
``horovod.torch.elastic`` has (``run``, ``State``, ``ObjectState``, ``TorchState``,
``ElasticSampler``, ...) is absent here: using one raises :class:`ElasticUnsupportedError`,
which is a ``NotImplementedError`` (as Horovod's refusals are) and an ``AttributeError``, so
``hasattr(hvd.elastic, "run")`` is False and code that detects elastic support falls back to
a fixed set of ranks. ``from ringcomm.torch.elastic import TorchState`` fails with an
ImportError naming this module.

What to do instead: train without the elastic wrapper, save checkpoints, and restart a job
that lost a rank from the last one, broadcasting the loaded state from rank 0
(``hvd.broadcast_parameters(model.state_dict(), root_rank=0)`` and
``hvd.broadcast_optimizer_state(optimizer, root_rank=0)``).
"""

from __future__ import annotations

from typing import NoReturn

from ringcomm.torch.horovod.unsupported import ElasticUnsupportedError, elastic_refusal

__all__ = ["ElasticUnsupportedError"]


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):  # introspection (copy, pickle, inspect) must see no such name
        raise AttributeError(name)
    raise elastic_refusal(name)
