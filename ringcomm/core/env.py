"""Reading ringcomm's environment variables: flags and byte counts, with clear errors."""

from __future__ import annotations

import os
import re

__all__ = ["env", "env_bytes", "env_flag", "flag_value"]

_BYTES = re.compile(r"\s*([0-9]+)\s*(?:([KMG])(?:iB)?)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def env(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank."""
    raw = os.environ.get(name)
    return raw if raw is not None and raw.strip() else None


def flag_value(raw: str) -> bool | None:
    """A yes/no value (1/0, true/false, yes/no, on/off, any case) as a bool; None otherwise."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def env_flag(name: str, default: bool) -> bool:
    """A yes/no variable (1/0, true/false, yes/no, on/off); ``default`` when unset.

    Raises:
        ValueError: any other value, naming the variable.
    """
    raw = env(name)
    if raw is None:
        return default
    value = flag_value(raw)
    if value is None:
        raise ValueError(f"{name} must be 0 or 1 (or true/false, yes/no, on/off), got {raw!r}")
    return value


def env_bytes(name: str) -> int | None:
    """A byte-count variable (``1048576``, ``512K``, ``2M``, ``1G``); None when unset.

    Raises:
        ValueError: not a byte count, naming the variable.
    """
    raw = env(name)
    if raw is None:
        return None
    match = _BYTES.fullmatch(raw)
    if match is None:
        raise ValueError(f"{name} must be a byte count such as 1048576, 512K, 2M or 1G "
                         f"(K, M, G: KiB, MiB, GiB), got {raw!r}")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
