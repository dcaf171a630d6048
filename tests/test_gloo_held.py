"""The record of tensors handed to gloo (ringcomm/backends/gloo_held.py): a tensor is held
while C++ references beyond those it had stay, and forgotten once they go; the wait at exit
returns at once when nothing is held and gives up after its timeout otherwise."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from ringcomm.backends import gloo_held  # noqa: E402


@pytest.fixture(autouse=True)
def _empty():
    gloo_held.let_go(timeout=0)
    assert gloo_held.held() == 0
    yield


def test_a_tensor_is_held_while_another_cpp_reference_stays():
    t = torch.ones(4)
    gloo_held.hold(t)
    holder = t.view(2, 2)  # a C++ reference to t, as a gloo work keeps
    assert gloo_held.held() == 1
    del holder
    assert gloo_held.held() == 0


def test_a_tensor_with_references_of_its_own_is_held_only_for_new_ones():
    t = torch.ones(4)
    kept = t.view(4)  # held by the program before gloo had it
    gloo_held.hold(t)
    assert gloo_held.held() == 0
    extra = t.view(2, 2)
    assert gloo_held.held() == 0  # not recorded any more: forgotten when it was released
    gloo_held.hold(t)
    assert gloo_held.held() == 0
    del kept, extra


def test_holding_the_same_tensor_twice_keeps_one_record_with_the_lower_count():
    t = torch.ones(4)
    gloo_held.hold(t)
    first = t.view(4)
    gloo_held.hold(t)  # its count is higher now; the record keeps the count from before
    second = t.view(4)
    assert gloo_held.held() == 1
    del first
    assert gloo_held.held() == 1
    del second
    assert gloo_held.held() == 0


def test_let_go_waits_for_another_thread_to_drop_its_reference():
    t = torch.ones(4)
    gloo_held.hold(t)
    box = [t.view(4)]
    threading.Timer(0.05, box.clear).start()
    start = time.monotonic()
    assert gloo_held.let_go(timeout=5.0) == 0
    assert 0.03 < time.monotonic() - start < 4.0


def test_let_go_gives_up_after_its_timeout():
    t = torch.ones(4)
    gloo_held.hold(t)
    holder = t.view(4)
    start = time.monotonic()
    assert gloo_held.let_go(timeout=0.05) == 1
    assert time.monotonic() - start < 2.0
    del holder
    assert gloo_held.let_go(timeout=0) == 0


def test_gloo_threads_are_seen_while_a_gloo_group_lives(tmp_path, subprocess_env):
    """The exit pauses where gloo's worker threads still run: they are found by name, in a
    process that made a gloo group (a fresh one, whose threads are its own), and not before.
    A thread names itself once it runs, a moment after the group is made, so the look waits
    for the name (it once came a moment late on a loaded machine)."""
    import subprocess
    import sys

    code = (
        "import os, torch.distributed as dist\n"
        "from ringcomm.backends import gloo_held\n"
        "before = gloo_held._gloo_threads_alive()\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, "
        "world_size=1)\n"
        "import time\n"
        "deadline = time.monotonic() + 30\n"
        "while not gloo_held._gloo_threads_alive() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(before, gloo_held._gloo_threads_alive())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"], proc.stdout
