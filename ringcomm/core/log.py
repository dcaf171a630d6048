"""ringcomm's loggers: silent unless asked, and every line says which rank wrote it.

The loggers form one hierarchy under ``"ringcomm"`` (``ringcomm.init``, ``ringcomm.auto``, ...).
A NullHandler on ``"ringcomm"`` keeps them quiet by default, so records reach only the handlers
an application configures itself (the root logger's, for instance). ``RINGCOMM_LOG_LEVEL=INFO``
(or DEBUG, WARNING, ...) instead gives ``"ringcomm"`` its own handler on stderr, whose lines read
``[ringcomm rank 1/4] INFO ringcomm.init: ...``.

This module is in the bottom layer: it imports only the standard library.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

__all__ = ["LEVEL_VARIABLE", "ROOT", "configure_from_env", "get_logger", "parse_level",
           "set_rank"]

#: The name of the top logger; every ringcomm logger is a child of it.
ROOT = "ringcomm"
#: The environment variable that turns logging to stderr on.
LEVEL_VARIABLE = "RINGCOMM_LOG_LEVEL"

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logging.getLogger(ROOT).addHandler(logging.NullHandler())


class _RankFormatter(logging.Formatter):
    """Prefix each line with this process's rank, which ``set_rank`` updates once it is known."""

    def __init__(self) -> None:
        super().__init__("%(prefix)s %(levelname)s %(name)s: %(message)s")
        self.prefix = "[ringcomm rank ?/?]"

    def format(self, record: logging.LogRecord) -> str:
        record.prefix = self.prefix
        return super().format(record)


class _Handler(logging.StreamHandler):
    """The handler ``RINGCOMM_LOG_LEVEL`` installs (one at most, told apart by its class)."""


def get_logger(name: str = "") -> logging.Logger:
    """Return the logger ``ringcomm.<name>`` (``ringcomm`` itself when ``name`` is empty).

    Args:
        name: the child's name, such as "init" or "auto".
    """
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def parse_level(raw: str, variable: str = LEVEL_VARIABLE) -> int:
    """Return the logging level that ``raw`` names ("INFO", "debug", "20", ...).

    Args:
        raw: a level name (case-insensitive) or a non-negative number.
        variable: the name of the variable ``raw`` came from, for the error message.

    Raises:
        ValueError: ``raw`` names no level.
    """
    text = raw.strip().upper()
    if text == "WARN":
        text = "WARNING"
    if text in _LEVELS:
        return int(getattr(logging, text))
    if text.isdigit():
        return int(text)
    raise ValueError(f"{variable} must be one of {', '.join(_LEVELS)} (or a number), got {raw!r}")


def configure_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """Turn logging to stderr on when ``RINGCOMM_LOG_LEVEL`` is set; do nothing otherwise.

    Sets the level of the ``ringcomm`` logger and gives it one stderr handler (a second call
    replaces the first one's, it never adds another). The handler's records do not propagate
    further, so an application's own handlers do not print them a second time.

    Args:
        env: the environment to read; ``os.environ`` when omitted.

    Returns:
        The level set, or None when the variable is unset or empty.

    Raises:
        ValueError: the variable names no level (the message names it and its value).
    """
    env = os.environ if env is None else env
    raw = env.get(LEVEL_VARIABLE, "")
    if not raw.strip():
        return None
    level = parse_level(raw)
    logger = get_logger()
    handler = _installed()
    if handler is None:
        handler = _Handler(sys.stderr)
        handler.setFormatter(_RankFormatter())
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return level


def set_rank(rank: int | None, size: int | None) -> None:
    """Name ``rank`` of ``size`` in the lines that the ``RINGCOMM_LOG_LEVEL`` handler writes.

    Args:
        rank: this process's rank, or None where it is not known yet.
        size: the number of processes, or None where it is not known yet.
    """
    handler = _installed()
    if handler is not None and isinstance(handler.formatter, _RankFormatter):
        shown = "?" if rank is None else rank
        handler.formatter.prefix = f"[ringcomm rank {shown}/{'?' if size is None else size}]"


def _installed() -> _Handler | None:
    """The handler ``configure_from_env`` installed, if any."""
    for handler in get_logger().handlers:
        if isinstance(handler, _Handler):
            return handler
    return None
