"""The settings that change what the ranks exchange: read once, and agreed when a communicator
starts.

``ringcomm.init``'s options and their ``RINGCOMM_*`` variables (segment and inline bytes, the
consistency check, the timeout, the allreduce algorithm and the topology) decide the size and
order of every message. Ranks that hold different values would exchange messages that do not
match: a hang, or data read as something else. So they are read here without raising (a bad
value is replaced by its default and its error kept), and every communicator starts with one
exchange of every rank's settings and errors (:func:`agree_at_start`): an error on any rank, or
a setting that differs, raises the same typed error on every rank, before any data moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ringcomm.comm import _twolevel
from ringcomm.comm._mismatch import rank_groups
from ringcomm.comm.topology import resolve_topology
from ringcomm.comm.transport import check_timeout
from ringcomm.core import log as _log
from ringcomm.core.env import env, env_bytes, env_flag
from ringcomm.core.types import (
    DEFAULT_TIMEOUT_S,
    ArgumentMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
    Transport,
)

__all__ = ["MAX_INLINE_BYTES", "MAX_SEGMENT_BYTES", "Settings", "agree_at_start",
           "agree_byte_limit", "agree_env", "check_bytes", "read"]

#: The largest inline slot: each rank keeps that much room for each other rank's message (and
#: where the exchange is a fixed-size allgather, the slot travels with every collective).
MAX_INLINE_BYTES = 1 << 20
# The name under which communicators agree on ringcomm's release (Communicator._settings).
VERSION_SETTING = "ringcomm version"
#: The largest ring segment (a segment is one message; larger ones only cost memory).
MAX_SEGMENT_BYTES = 1 << 30


@dataclass(frozen=True)
class Settings:
    """The settings of one communicator, checked (None: the measured default).

    Attributes:
        consistency_check: agree on every call's arguments before data moves.
        segment_bytes: ring segment size in bytes.
        inline_bytes: dense allreduces up to this size ride in the agreement message.
        timeout: seconds a collective waits for its peers.
        algorithm: the allreduce algorithm of calls that name none.
        topology: which ranks share a node ("auto" or ranks per node).
    """

    consistency_check: bool = True
    segment_bytes: int | None = None
    inline_bytes: int | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    algorithm: str = "auto"
    topology: str | int = "auto"


def read(consistency_check: Any = None, segment_bytes: Any = None, inline_bytes: Any = None,
         timeout: Any = None, algorithm: Any = None,
         topology: Any = None) -> tuple[Settings, Exception | None]:
    """Check ``ringcomm.init``'s options and read the unset ones from the environment.

    Never raises for a value: each invalid one is replaced by its default, and the error
    returned, so that it can be raised on every rank once the ranks can agree (a rank that
    raised alone before its backend started would leave the others waiting in its start-up).
    ``RINGCOMM_LOG_LEVEL`` is read (and logging configured) here too.

    Returns:
        The settings, and None or the error to raise (a TypeError or ValueError naming every
        bad option or variable, its value and what is expected).
    """
    errors: list[Exception] = []

    def checked(parse: Any, default: Any, *args: Any) -> Any:
        try:
            return parse(*args)
        except (TypeError, ValueError) as err:
            errors.append(err)
            return default

    settings = Settings(
        checked(_check_flag, True, consistency_check),
        checked(_byte_option, None, segment_bytes, "segment_bytes", 64, 1, MAX_SEGMENT_BYTES),
        checked(_byte_option, None, inline_bytes, "inline_bytes", 0, 8, MAX_INLINE_BYTES),
        checked(_timeout_option, DEFAULT_TIMEOUT_S, timeout),
        checked(_twolevel.resolve_algorithm, "auto", algorithm),
        checked(resolve_topology, "auto", "auto" if topology is None else topology))
    checked(_log.configure_from_env, None)
    return settings, _one_error(errors)


def _one_error(errors: list[Exception]) -> Exception | None:
    if len(errors) <= 1:
        return errors[0] if errors else None
    text = "; ".join(map(str, errors))
    return TypeError(text) if all(isinstance(e, TypeError) for e in errors) else ValueError(text)


def _check_flag(value: Any) -> bool:
    if value is None:
        return env_flag("RINGCOMM_CONSISTENCY_CHECK", True)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError("consistency_check must be True, False or None, "
                        f"got {type(value).__name__} {value!r}")
    return bool(value)


def _byte_option(value: Any, name: str, minimum: int, multiple: int,
                 maximum: int) -> int | None:
    """``value`` (or, when None, its environment variable) as an int, its range checked."""
    variable = f"RINGCOMM_{name.upper()}"
    if value is None:
        value, source = env_bytes(variable), variable
        if value is None:
            return None
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (a number of bytes), "
                        f"got {type(value).__name__} {value!r}")
    else:
        value, source = int(value), name
    return check_bytes(value, source, minimum, multiple, maximum)


def check_bytes(value: int, name: str, minimum: int, multiple: int, maximum: int) -> int:
    """``value`` when it is a multiple of ``multiple`` in [``minimum``, ``maximum``].

    Raises:
        ValueError: it is not, naming ``name`` (the option or its variable).
    """
    if not minimum <= value <= maximum or value % multiple:
        span = f"from {_size(minimum)} to {_size(maximum)}"
        rule = f"a multiple of {multiple} bytes {span}" if multiple > 1 else span
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def _size(nbytes: int) -> str:
    """``nbytes`` as people write it: 64 B, 1 MiB, 1 GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _timeout_option(timeout: Any) -> float:
    """``timeout`` (or ``RINGCOMM_TIMEOUT``, or the default) in seconds."""
    if timeout is not None:
        return check_timeout(timeout)
    raw = env("RINGCOMM_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        return check_timeout(float(raw))
    except ValueError:
        raise ValueError("RINGCOMM_TIMEOUT must be a positive number of seconds, such as "
                         f"600 or 1800, got {raw!r}") from None


def agree_at_start(t: Transport, settings: dict[str, Any],
                   problem: Exception | None = None) -> None:
    """Share every rank's settings and start-up error over ``t``; raise the same error on
    every rank when any rank had an error or any setting differs (collective).

    Args:
        t: the new communicator's transport.
        settings: this rank's settings, by name (values compared with ``==``).
        problem: this rank's error from :func:`read`, if any.

    Raises:
        InvalidArgumentError, InvalidTypeError: some rank's options or variables were invalid
            (the message names the ranks and their error).
        ArgumentMismatchError: a setting differs between ranks (the message names each such
            setting and its value on every rank).
    """
    mine = None if problem is None else (
        "TypeError" if isinstance(problem, TypeError) else "ValueError", str(problem))
    everyone = t.allgather_object((settings, mine))
    _raise_problems([p for _, p in everyone])
    differences = {}
    for name in settings:
        values = tuple(s.get(name) for s, _ in everyone)
        if len(set(map(repr, values))) > 1:
            differences[name] = values
    if differences:
        parts = "; ".join(f"{name} differs between ranks: {rank_groups(list(values))}"
                          for name, values in differences.items())
        advice = ("Every rank must be given the same settings (init's options and their "
                  "environment variables)")
        if VERSION_SETTING in differences:
            advice = ("Every rank must run the same ringcomm release (pip show ringcomm on "
                      "each node)")
        raise ArgumentMismatchError(f"init: {parts}. {advice}", kind="init",
                                    ranks=tuple(range(len(everyone))), differences=differences)


def agree_byte_limit(t: Transport, name: str, default: int) -> int:
    """A transport's byte limit from the environment variable ``name`` (``default`` when it is
    unset), checked to be the same on every rank: ranks that chose different algorithms for
    one call would wait for each other until the timeout (collective over ``t``).

    Raises:
        ArgumentMismatchError: the variable differs between ranks (on every rank).
        InvalidArgumentError: the variable is not a byte count (on every rank).
    """
    return agree_env(t, {name: default})[name]


_UNSET = "unset"


def agree_env(t: Transport, limits: dict[str, int | None],
              flags: dict[str, bool] | None = None) -> dict[str, Any]:
    """A transport's settings from the environment, checked to be the same on every rank in
    one exchange (collective over ``t``): each byte limit of ``limits`` and each yes/no
    variable of ``flags``, their defaults where unset. A limit whose default is None is None
    where unset (compared as "unset": a default that depends on the other settings is the
    caller's to derive from the agreed ones).

    Raises:
        ArgumentMismatchError: a variable differs between ranks (on every rank).
        InvalidArgumentError: a variable is not a byte count, or not yes/no (on every rank).
    """
    values: dict[str, Any] = {}
    problem = None
    for name, default in limits.items():
        try:
            found = env_bytes(name)
            values[name] = found if found is not None else _UNSET if default is None else default
        except ValueError as err:
            values[name], problem = 0, problem or err
    for name, default_flag in (flags or {}).items():
        try:
            values[name] = env_flag(name, default_flag)
        except ValueError as err:
            values[name], problem = default_flag, problem or err
    agree_at_start(t, values, problem)
    return {name: None if value == _UNSET else value for name, value in values.items()}


def _raise_problems(problems: list[tuple[str, str] | None]) -> None:
    failed: dict[tuple[str, str], list[int]] = {}
    for rank, problem in enumerate(problems):
        if problem is not None:
            failed.setdefault(problem, []).append(rank)
    if not failed:
        return
    parts = [f"on {'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {msg}"
             for (_, msg), rs in failed.items()]
    etype, reason = next(iter(failed))
    cls = InvalidTypeError if etype == "TypeError" else InvalidArgumentError
    raise cls(f"init failed {'; '.join(parts)}", kind="init",
              ranks=tuple(r for rs in failed.values() for r in rs), reason=reason)

