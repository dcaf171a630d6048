"""Lightning Fabric: a DDP strategy whose gradients ringcomm averages, on CPU and on CUDA.

Fabric's ``DDPStrategy`` takes no communication hook, and ``fabric.setup(model)`` returns
Fabric's own wrapper, not the ``DistributedDataParallel`` inside it, so
:func:`~ringcomm.torch.register_ddp_hook` has no public model to take. And, as under
Lightning's Trainer, a ``RingcommState`` made at the top of the script would be made too early:
``fabric.launch()`` runs the script in the main process, then again in each child, and the
processes are connected only inside ``launch()``. :class:`RingcommDDPStrategy` registers the
hook where Fabric wraps each model in DDP (``setup_module``, inside ``fabric.setup``), on every
rank, after the processes are connected, whatever the device.

Example (``python train.py``; ``fabric.launch()`` starts the other processes)::

    import lightning as L
    import ringcomm
    from ringcomm.torch.fabric import RingcommDDPStrategy

    strategy = RingcommDDPStrategy(state_kwargs={"compression": ringcomm.Int8()})
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ...
    print(strategy.ringcomm_state.stats)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.fabric.strategies import DDPStrategy
except ImportError as _err:
    raise ImportError("ringcomm.torch.fabric needs Lightning 2.x (Fabric): pip install "
                      f"lightning ({_err})") from _err

from ringcomm.torch.accelerate import check_strategy_state, hook_strategy_model
from ringcomm.torch.hooks import RingcommState

__all__ = ["RingcommDDPStrategy"]


class RingcommDDPStrategy(DDPStrategy):
    """Fabric's DDP strategy, with DDP's gradient buckets averaged by ringcomm's hook.

    It overrides ``setup_module``, the strategy's public step that wraps a model in DDP
    (``fabric.setup`` and ``fabric.setup_module`` call it): the model is wrapped as Fabric's
    ``DDPStrategy`` does, then a state is made and
    :func:`~ringcomm.torch.register_ddp_hook` called, on every rank, before the first
    backward. Each model set up gets a state of its own (a state counts its model's
    iterations and keeps the compressor's state by bucket index).

    Args:
        state: the hook's state, for the one model set up; made from ``state_kwargs`` when
            None. A state made before ``fabric.launch()`` connected the processes has a
            communicator of the wrong size and is refused, as is one given a second model.
        state_kwargs: arguments of :class:`~ringcomm.torch.RingcommState` (``compression``,
            ``start_iter``, ``min_compress_bytes``, ...) for the states made here, each with
            a communicator over torch.distributed's default group unless ``comm`` is among
            them, and the precision plugin's loss scaler (``precision="16-mixed"`` on CUDA)
            as their ``grad_scaler`` unless given.
        **kwargs: the arguments of Fabric's ``DDPStrategy`` (``timeout``,
            ``process_group_backend``, ``start_method``, ...) and, as there, of
            ``DistributedDataParallel`` (``bucket_cap_mb``, ``static_graph``, ...).

    Raises:
        TypeError: both ``state`` and ``state_kwargs`` are given, or ``state`` is not a
            RingcommState.

    ``fabric.setup`` raises what :func:`~ringcomm.torch.register_ddp_hook` raises: ValueError
    on every rank for a state whose communicator has another size than the process group, or
    that already runs another model's hook.

    Example::

        strategy = RingcommDDPStrategy(state_kwargs={"compression": ringcomm.Int8(),
                                                     "start_iter": 10})
        fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    """

    def __init__(self, *, state: RingcommState | None = None,
                 state_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        check_strategy_state("RingcommDDPStrategy", state, state_kwargs)
        super().__init__(**kwargs)
        self._given_state = state
        self._ringcomm_kwargs = dict(state_kwargs or {})
        self._states: list[RingcommState] = []

    @property
    def ringcomm_state(self) -> RingcommState | None:
        """The state of the model set up last (None before ``fabric.setup``)."""
        return self._states[-1] if self._states else None

    @property
    def ringcomm_states(self) -> tuple[RingcommState, ...]:
        """The states of the models set up, in the order ``fabric.setup`` got them."""
        return tuple(self._states)

    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP (as Fabric's ``DDPStrategy`` does), then register ringcomm's
        hook on it."""
        model = super().setup_module(module)
        self._states.append(hook_strategy_model(model, self._given_state, self._ringcomm_kwargs,
                                                getattr(self.precision, "scaler", None)))
        return model
