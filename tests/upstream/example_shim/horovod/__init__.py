"""The top-level ``horovod`` that Horovod's examples import beside ``horovod.torch``.

pytorch_mnist.py imports ``horovod`` for ``horovod.run`` (used only with ``--num-proc``).
There is deliberately no ``horovod.torch`` here: the example's ``import horovod.torch as hvd``
has become ``import ringcomm.torch as hvd``, and a leftover import of ``horovod.torch``
fails loudly instead of reaching ringcomm by another route.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(*args: Any, **kwargs: Any) -> Any:
    """Refuse to launch workers: ringcomm's processes are started by ``mpiexec``.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError("horovod.run starts its own workers; launch the example with "
                              "mpiexec -n N python EXAMPLE.py instead of passing --num-proc")
