"""The "ringcomm" torch.distributed backend, registered when PyTorch starts.

PyTorch calls the entry points of the group "torch.backends" at the end of ``import torch``
(its plugin mechanism for out-of-tree backends; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it
off). ringcomm's (pyproject.toml) is :func:`register`, so that
``torch.distributed.init_process_group("ringcomm")`` works in a program that never imports
ringcomm: a Lightning or Accelerate configuration naming the backend, a script launched as it
is. A failure here must not break ``import torch``: it is logged, and ``import ringcomm.torch``
then registers the backend (or says what is wrong).
"""

from __future__ import annotations

import logging

__all__ = ["register"]


def register() -> None:
    """Register the "ringcomm" backend with torch.distributed (importing ringcomm.torch)."""
    try:
        import ringcomm.torch  # noqa: F401  (registers "ringcomm")
    except Exception as err:  # never break import torch: ringcomm.torch says it again
        logging.getLogger("ringcomm").debug("backend 'ringcomm' not registered at torch's "
                                            "start: %s", err)
