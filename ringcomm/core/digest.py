"""Fingerprints of values that ranks compare without sending them whole."""

from __future__ import annotations

import hashlib

__all__ = ["fingerprint"]


def fingerprint(value: object) -> int:
    """A 62-bit digest (BLAKE2b) of ``repr(value)``, as a non-negative int that fits an int64
    with room to add small codes.

    For what ranks compare through a fixed-size word (a call's trailing dimensions, its
    compression and name, a parameter layout, a history of changes): not CRC32, whose
    linearity makes equal checksums of different values common, such as those of the shapes
    ``(4, 38, 50)`` and ``(597, 12, 1)``; two different values share a fingerprint with odds
    of about 2^-62.
    """
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
