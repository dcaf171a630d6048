"""Keys of a restarted torchrun job: which attempt's they are.

torchrun (``--max-restarts``) ends every worker of a job when one fails and starts them all
again. Since PyTorch 2.5 its workers share the agent's rendezvous store across these attempts
(``TORCHELASTIC_USE_AGENT_STORE=True``), and the store keeps what the earlier attempt wrote:
a second attempt reads the first one's addresses (PyTorch's own gloo then fails to connect,
pytorch/pytorch#135712, unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). Where one agent
starts every worker (a one-node job), its restart count (``TORCHELASTIC_RESTART_COUNT``) is the
same in every worker, and ringcomm writes each attempt's keys under a prefix of their own.
Across several agents the counts differ (an agent whose workers did not fail does not count
the restart), so there nothing is prefixed and a warning (:func:`stale_keys_warning`) says
what to set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ringcomm.core.log import get_logger

__all__ = ["agent_store_shared", "attempt_prefix", "stale_keys_warning"]

_LOG = get_logger("init")
_WARNED: list[str] = []  # the warning, once logged in this process


def agent_store_shared(env: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's agent serves this worker's store (every worker of the job, and of
    its later attempts, is its client)."""
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _restarted_on_shared_store(env: Mapping[str, str]) -> int:
    """The restart count where this worker's store is the agent's, shared with earlier
    attempts; 0 otherwise (not under torchrun, the first attempt, or a store per attempt)."""
    if not agent_store_shared(env):
        return 0
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(count) if count.isdigit() else 0


def _prefix(env: Mapping[str, str]) -> str:
    count = _restarted_on_shared_store(env)
    if count == 0 or env.get("GROUP_WORLD_SIZE", "").strip() != "1":
        return ""
    return f"ringcomm-attempt-{count}/"


def attempt_prefix(env: Mapping[str, str] | None = None) -> str:
    """A store prefix of this attempt's own where the store holds an earlier attempt's keys and
    every worker counts attempts alike (one agent); "" otherwise, with
    :func:`stale_keys_warning` logged once where an earlier attempt's keys may still be read."""
    env = os.environ if env is None else env
    prefix = _prefix(env)
    warning = None if prefix else stale_keys_warning(env)
    if warning and not _WARNED:
        _WARNED.append(warning)
        _LOG.warning("%s", warning)
    return prefix


def stale_keys_warning(env: Mapping[str, str] | None = None) -> str | None:
    """What to do where an earlier attempt's keys may be read and no prefix can tell them apart
    (several agents sharing their store across restarts); None where that cannot happen."""
    env = os.environ if env is None else env
    if _restarted_on_shared_store(env) == 0 or _prefix(env):
        return None
    return ("this torchrun job was restarted (TORCHELASTIC_RESTART_COUNT="
            f"{env.get('TORCHELASTIC_RESTART_COUNT')}) on a rendezvous store shared with its "
            "earlier attempts across several nodes, so addresses the earlier attempt wrote may "
            "be read (pytorch/pytorch#135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
            "torchrun to give each attempt a store of its own")
