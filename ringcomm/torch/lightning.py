"""PyTorch Lightning: a DDP strategy whose gradients ringcomm averages, on CPU and on CUDA.

``DDPStrategy(ddp_comm_hook=ringcomm_hook, ddp_comm_state=state)`` does not do it: Lightning
registers a DDP communication hook only when the root device is CUDA
(``DDPStrategy._register_ddp_hooks``), so on CPU the hook is silently never called. And a
``RingcommState`` made at the top of the script would be made too early: Lightning's launcher
runs the script once in the main process before any process group exists, then again in each
child process, where it sets WORLD_SIZE, LOCAL_RANK, NODE_RANK, MASTER_ADDR and MASTER_PORT but
not RANK. :class:`RingcommDDPStrategy` makes the state (and its communicator) once DDP has
wrapped the model, on every rank, and registers the hook whatever the device.

Example (``python train.py``; Lightning starts the other processes)::

    import lightning.pytorch as pl
    import ringcomm
    from ringcomm.torch.lightning import RingcommDDPStrategy

    strategy = RingcommDDPStrategy(state_kwargs={"compression": ringcomm.Int8()})
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1)
    trainer.fit(model, loader)
    print(strategy.ringcomm_state.stats)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as _err:
    raise ImportError("ringcomm.torch.lightning needs PyTorch Lightning 2.x: pip install "
                      f"lightning ({_err})") from _err

from ringcomm.torch.accelerate import check_strategy_state, hook_strategy_model
from ringcomm.torch.hooks import RingcommState

__all__ = ["RingcommDDPStrategy"]

# DDPStrategy arguments that would register a second hook (or wrap or replace ours).
_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


class RingcommDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, with DDP's gradient buckets averaged by ringcomm's hook.

    It overrides ``configure_ddp``, the public step that wraps the model in DDP: the
    state is made, and :func:`~ringcomm.torch.register_ddp_hook` called, right after
    ``DDPStrategy.configure_ddp``, on every rank, only when fitting, and before the first
    backward. That is the one place that holds across Lightning 2.x on every device: the
    CUDA-only check lives in the private ``_register_ddp_hooks``; a callback would find the
    strategy configured already and could not keep a ``ddp_comm_hook`` from being
    registered first on CUDA.

    Args:
        state: the hook's state, reused at every fit; made at the first fit from
            ``state_kwargs`` when None. A state made before the processes are connected
            (at the top of the script) has a communicator of the wrong size and is refused.
        state_kwargs: arguments of :class:`~ringcomm.torch.RingcommState` (``compression``,
            ``start_iter``, ``min_compress_bytes``, ...) for the state made here, with a
            communicator over torch.distributed's default group unless ``comm`` is among them,
            and the precision plugin's loss scaler (``precision="16-mixed"``) as its
            ``grad_scaler`` unless given.
        **kwargs: the arguments of Lightning's ``DDPStrategy`` (``timeout``,
            ``process_group_backend``, ``start_method``, ...) and, as there, of
            ``DistributedDataParallel`` (``bucket_cap_mb``, ``static_graph``, ...).

    Raises:
        ValueError: ``ddp_comm_hook``, ``ddp_comm_state`` or ``ddp_comm_wrapper`` is given
            (this strategy registers ringcomm's hook itself, and DDP takes one hook).
        TypeError: both ``state`` and ``state_kwargs`` are given, or ``state`` is not a
            RingcommState.

    At fit, ``configure_ddp`` raises what :func:`~ringcomm.torch.register_ddp_hook` raises:
    ValueError on every rank for a state whose communicator has another size than the
    process group (one made at the top of the script, before the processes were connected).

    Example::

        strategy = RingcommDDPStrategy(state_kwargs={"compression": ringcomm.Int8(),
                                                     "start_iter": 10})
        pl.Trainer(accelerator="cpu", devices=4, strategy=strategy).fit(model, loader)
    """

    def __init__(self, *, state: RingcommState | None = None,
                 state_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        given = [name for name in _HOOK_ARGUMENTS if kwargs.get(name) is not None]
        if given:
            raise ValueError(f"RingcommDDPStrategy registers ringcomm_hook itself; got "
                             f"{', '.join(given)}: pass state= or state_kwargs= instead")
        check_strategy_state("RingcommDDPStrategy", state, state_kwargs)
        super().__init__(**kwargs)
        self._ringcomm_state = state
        self._ringcomm_kwargs = dict(state_kwargs or {})

    @property
    def ringcomm_state(self) -> RingcommState | None:
        """The hook's state (None before the first fit wraps the model in DDP)."""
        return self._ringcomm_state

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (as ``DDPStrategy`` does), then register ringcomm's hook."""
        super().configure_ddp()
        # configure_ddp wrapped it in DistributedDataParallel (register_ddp_hook checks that).
        model = cast(DistributedDataParallel, self.model)
        self._ringcomm_state = hook_strategy_model(
            model, self._ringcomm_state, self._ringcomm_kwargs,
            getattr(self.precision_plugin, "scaler", None))
