"""Every call ringcomm makes into torch.distributed exists in the oldest supported PyTorch.

The suite runs one PyTorch (the newest); these tests hold ringcomm's calls against
torch.distributed as the oldest supported version declares it (tests/data/, recorded from that
version's sources by tests/torch_api.py), so a parameter that version lacks (``sort_ranks``,
``group_src``) fails here instead of on a user's machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import torch_api

ROOT = Path(__file__).resolve().parent.parent
RECORDED = sorted((ROOT / "tests" / "data").glob("torch_distributed_*.json"))
# What runs on a user's PyTorch: the package, and the scripts the GPU check runs there.
SOURCES = [*sorted((ROOT / "ringcomm").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py")),
           *sorted((ROOT / "examples").glob("*.py"))]


def _oldest() -> dict:
    return json.loads(RECORDED[0].read_text())


def test_recorded_version_is_the_declared_minimum():
    """The recording is of the version pyproject.toml declares as the oldest supported."""
    assert len(RECORDED) == 1, RECORDED
    declared = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert declared is not None, "pyproject.toml declares no torch>= in its extras"
    assert _oldest()["torch"].startswith(declared.group(1) + "."), (_oldest()["torch"],
                                                                    declared.group(1))


def test_calls_exist_in_the_oldest_supported_torch():
    api = _oldest()
    found = [use for path in SOURCES for use in torch_api.uses(path)]
    assert len(found) > 30  # the scan sees the calls (the gloo transport alone makes ~20)
    assert torch_api.problems(api, found) == []


@pytest.mark.parametrize("line, expected", [
    ("dist.new_group(ranks=[0], sort_ranks=False)", "has no parameter 'sort_ranks'"),
    ("dist.irecv(t, group=g, group_src=1)", "has no parameter 'group_src'"),
    ("self.bounded('b', 0, dist.broadcast, t, group=g, group_src=0)",
     "has no parameter 'group_src'"),
    ("torch.distributed.isend(t, group_dst=1)", "has no parameter 'group_dst'"),
    ("x = dist.all_gather_single", "all_gather_single does not exist in torch 2.4"),
])
def test_a_call_the_oldest_torch_lacks_is_found(line, expected):
    """The check itself: each of these is reported (sort_ranks was the torch 2.11 failure)."""
    source = f"import torch\nimport torch.distributed as dist\n{line}\n"
    found = torch_api.uses(Path("made_up.py"), source)
    reported = torch_api.problems(_oldest(), found)
    assert len(reported) == 1 and expected in reported[0], reported


@pytest.mark.parametrize("line", [
    "dist.new_group(ranks=[0], use_local_synchronization=True, **keep_order)",
    "f = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor",
    "dist.irecv(t, src=3, group=g, tag=7)",
])
def test_what_the_oldest_torch_has_passes(line):
    source = f"import torch.distributed as dist\n{line}\n"
    assert torch_api.problems(_oldest(), torch_api.uses(Path("ok.py"), source)) == []
