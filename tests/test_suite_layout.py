"""The test suite's own layout: every test module has a name of its own.

pytest imports test files by their base name (the tests folders are not packages), so a
``tests/test_x.py`` and a ``tests/mpi/test_x.py`` stop the collection of the whole suite with
"import file mismatch" when both are collected in one session.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_module_names_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "upstream" not in p.parts)
    twice = sorted(name for name, count in names.items() if count > 1)
    assert not twice, f"test modules sharing a name (rename one of each): {twice}"
