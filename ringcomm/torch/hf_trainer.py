"""Hugging Face Transformers' Trainer: ringcomm's DDP hook on the model it trains.

The Trainer wraps the model in DDP itself, through Accelerate, inside ``trainer.train()``;
before that there is no DDP model to give :func:`~ringcomm.torch.register_ddp_hook`, and
``TrainingArguments`` takes no communication hook (its ``ddp_backend`` names a
torch.distributed backend). :func:`register_trainer_hook` adds a callback to the trainer that
registers the hook on the DDP model at the start of training (``on_train_begin``: after the
model is wrapped, before the first backward), on every rank. The torch.distributed
"ringcomm" backend needs none of this: ``torch.distributed.init_process_group("ringcomm")``
before ``TrainingArguments`` is made, and the Trainer keeps that group.

Example (``torchrun --nproc-per-node 2 train.py``)::

    import ringcomm
    from transformers import Trainer, TrainingArguments
    from ringcomm.torch.hf_trainer import register_trainer_hook

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=data)
    hook = register_trainer_hook(trainer, compression=ringcomm.Int8())
    trainer.train()
    print(hook.state.stats)
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch.nn.parallel import DistributedDataParallel

try:
    from transformers import TrainerCallback
except ImportError as _err:
    raise ImportError("ringcomm.torch.hf_trainer needs Hugging Face Transformers: pip install "
                      f"transformers ({_err})") from _err

from ringcomm.torch.accelerate import check_strategy_state, hook_strategy_model
from ringcomm.torch.hooks import RingcommState

__all__ = ["RingcommCallback", "register_trainer_hook"]

_LOG = logging.getLogger(__name__)


class RingcommCallback(TrainerCallback):
    """A Trainer callback that registers ringcomm's hook on the trainer's DDP model when
    training starts. Made and added by :func:`register_trainer_hook`.

    The state is made at the first ``train()`` (from ``state_kwargs``, with the Accelerator's
    loss scaler as its ``grad_scaler`` unless given) and kept for later ones that train the
    same DDP model; a ``train()`` of another model (a Trainer with ``model_init``, which makes
    one each time) gets a state of its own. In a job of one process the Trainer wraps no DDP
    model and the callback does nothing (``state`` stays None).

    Raises (at ``trainer.train()``):
        TypeError: the job has several processes and the Trainer trains its model otherwise
            than with DDP (FSDP, DeepSpeed): ringcomm's hook is a DDP communication hook.
        ValueError: what :func:`~ringcomm.torch.register_ddp_hook` raises (a state whose
            communicator has another size than the model's process group, or that already
            runs another model's hook).
    """

    def __init__(self, trainer: Any, state: RingcommState | None,
                 state_kwargs: dict[str, Any]) -> None:
        self._trainer = weakref.ref(trainer)
        self._given = state
        self._kwargs = dict(state_kwargs)
        self._model: Any = None  # the DDP model hooked (a weak reference), or None
        self.state: RingcommState | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Register the hook on the trainer's DDP model, unless it is registered already."""
        trainer = self._trainer()
        if trainer is None:
            return
        model = trainer.model_wrapped
        model = getattr(model, "_orig_mod", model)  # the DDP model inside a compiled one
        if self._model is not None and self._model() is model:
            return
        if not isinstance(model, DistributedDataParallel):
            if args.world_size > 1:
                raise TypeError(
                    "ringcomm's hook is a DDP communication hook, but this Trainer trains its "
                    f"model of {args.world_size} processes as "
                    f"{type(model).__module__}.{type(model).__qualname__}, not in "
                    "DistributedDataParallel (FSDP and DeepSpeed reduce gradients themselves): "
                    "use the torch.distributed \"ringcomm\" backend there instead")
            _LOG.info("one process: the Trainer wraps no DDP model, and ringcomm's hook has "
                      "nothing to average")
            return
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        self.state = hook_strategy_model(model, self._given, self._kwargs, scaler)
        self._model = weakref.ref(model)


def register_trainer_hook(trainer: Any, state: RingcommState | None = None,
                          **state_kwargs: Any) -> RingcommCallback:
    """Have ``trainer`` (a ``transformers.Trainer``) average its DDP gradients with ringcomm's
    hook: a :class:`RingcommCallback` is added to it, which registers the hook when
    ``trainer.train()`` has wrapped the model in DDP. Call it on every rank, before
    ``train()``.

    Args:
        trainer: the Trainer.
        state: the hook's state; made at the first ``train()`` from ``state_kwargs`` (the
            arguments of :class:`~ringcomm.torch.RingcommState`) when None, with a
            communicator over torch.distributed's default group unless ``comm`` is among
            them.
        **state_kwargs: ``compression``, ``start_iter``, ``min_compress_bytes``, ... for the
            state made there.

    Returns:
        The callback; its ``state`` is the hook's once ``train()`` has started.

    Raises:
        TypeError: both ``state`` and ``state_kwargs`` are given, ``state`` is not a
            RingcommState, or ``trainer`` has no ``add_callback``.
    """
    check_strategy_state("register_trainer_hook", state, state_kwargs)
    if not callable(getattr(trainer, "add_callback", None)):
        raise TypeError(f"register_trainer_hook expects a transformers.Trainer, got "
                        f"{type(trainer).__module__}.{type(trainer).__qualname__}")
    callback = RingcommCallback(trainer, state, state_kwargs)
    trainer.add_callback(callback)
    return callback
